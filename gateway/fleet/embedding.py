"""Embeddings on the fleet: one Embed call on one of the model's workers, through its
upstream (`Upstream.embed`), or one call for a cross-encoder's scores (`Reranks.rerank`)
or a classifier's classes (`Classifies.classify`),
with the time left as its deadline and the balancing, ejection and retry rules of the
fleet's unary calls (`unary`).

Which failures go to another worker: every retryable one (busy, unreachable, the model not
found there), as for a generation before its first event. An embedding (a score) is a pure
function of its inputs and nothing of it reaches the client before the whole answer, so a try that
may have run on a worker that then failed costs that worker's time, never a wrong answer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.fleet.unary import call_unary
from gateway.protocol import errors
from gateway.protocol.deadline import Deadline
from gateway.protocol.types import (
    Classifications,
    Embeddings,
    EmbedRequest,
    RerankRequest,
    Scores,
)
from gateway.upstreams.base import Classifies, Reranks

if TYPE_CHECKING:
    from gateway.fleet import Fleet
    from gateway.fleet.pool import ModelPool
    from gateway.fleet.worker import Worker


def _retryable(error: errors.GatewayError) -> bool:
    return error.retryable


async def embed(
    fleet: Fleet,
    pool: ModelPool,
    request: EmbedRequest,
    deadline: Deadline,
    metadata: tuple[tuple[str, str], ...] = (),
) -> tuple[Embeddings, str]:
    """The request's embeddings from a worker of `pool`, and that worker's address."""

    async def call(worker: Worker) -> Embeddings:
        embeddings = await worker.upstream.embed(request, deadline.remaining(), metadata)
        if len(embeddings.vectors) != request.count:  # it broke the protocol
            raise errors.Failed(
                f"The worker {worker.address} answered {len(embeddings.vectors)} embeddings "
                f"for {request.count} inputs."
            )
        return embeddings

    embeddings, worker = await call_unary(fleet, pool, deadline, call, _retryable)
    return embeddings, worker.address


async def rerank(
    fleet: Fleet,
    pool: ModelPool,
    request: RerankRequest,
    deadline: Deadline,
    metadata: tuple[tuple[str, str], ...] = (),
) -> tuple[Scores, str]:
    """Each document's score against the query from a worker of `pool` (a cross-encoder:
    `models[].scoring`), and that worker's address."""

    async def call(worker: Worker) -> Scores:
        upstream = worker.upstream
        if not isinstance(upstream, Reranks):  # the config allows no other
            raise errors.Failed(f"The worker {worker.address} scores no pairs itself.")
        return await upstream.rerank(request, deadline.remaining(), metadata)

    scores, worker = await call_unary(fleet, pool, deadline, call, _retryable)
    return scores, worker.address


async def classify(
    fleet: Fleet,
    pool: ModelPool,
    request: EmbedRequest,
    deadline: Deadline,
    metadata: tuple[tuple[str, str], ...] = (),
) -> tuple[Classifications, str]:
    """A classification of each input from a worker of `pool`, and that worker's address."""

    async def call(worker: Worker) -> Classifications:
        upstream = worker.upstream
        if not isinstance(upstream, Classifies):  # a fallback of another worker protocol
            raise errors.Invalid(
                f"The model `{pool.name}` does not serve classification.", param="model"
            )
        return await upstream.classify(request, deadline.remaining(), metadata)

    classes, worker = await call_unary(fleet, pool, deadline, call, _retryable)
    return classes, worker.address
