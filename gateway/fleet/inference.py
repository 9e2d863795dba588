"""Tensor models on the fleet: one inference on one of the model's workers, and the model's
metadata (read from a worker, cached by its upstream), with the balancing, ejection and retry
rules of LLM requests, less what has no meaning here.

An inference has no first event to wait for, so the only failure retried on another worker is
one that shows the worker never saw the call (`never_started`: UNAVAILABLE on a channel that
was not connected); anything later may have run and is the client's to retry.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from gateway.admission.deadline import Deadline
from gateway.protocol import errors
from gateway.protocol.types import GenerateRequest
from gateway.upstreams.base import CANCELLED
from gateway.upstreams.kserve_grpc import (
    InferRequest,
    InferResult,
    KServeGrpcUpstream,
    ModelMetadata,
)

if TYPE_CHECKING:
    from gateway.fleet import Fleet
    from gateway.fleet.pool import ModelPool
    from gateway.fleet.worker import Worker

METADATA_TIMEOUT = 5.0


def _pick(pool: ModelPool, tried: set[Worker]) -> tuple[Worker, KServeGrpcUpstream]:
    worker = pool.pick(GenerateRequest(model=pool.name, prompt=""), tried)
    if worker is None:
        raise errors.Unavailable(f"No healthy worker is available for the model `{pool.name}`.")
    client = worker.client
    if not isinstance(client, KServeGrpcUpstream):
        raise errors.NotAnLLM(f"The model `{pool.name}` is not served by tensor workers.")
    return worker, client


async def model_metadata(pool: ModelPool, version: str) -> ModelMetadata:
    """The model's inputs and outputs, as a worker declares them."""
    tried: set[Worker] = set()
    while True:
        worker, client = _pick(pool, tried)
        tried.add(worker)
        try:
            return await client.model_metadata(version, METADATA_TIMEOUT)
        except errors.Unavailable:
            if not pool.available(tried):
                raise


async def infer(
    fleet: Fleet,
    pool: ModelPool,
    request: InferRequest,
    deadline: Deadline,
    metadata: tuple[tuple[str, str], ...] = (),
) -> InferResult:
    """Runs the inference on a worker; retries elsewhere only what never started."""
    fleet.budget.record_request()
    tried: set[Worker] = set()
    attempts = max(1, fleet.config.retry_attempts)
    for attempt in range(1, attempts + 1):
        worker, client = _pick(pool, tried)
        tried.add(worker)
        worker.outstanding += 1
        outcome: errors.EngineError | str | None = None
        try:
            return await client.infer(request, deadline.remaining(), metadata)
        except errors.EngineError as error:
            outcome = error
            retry = (
                getattr(error, "never_started", False)
                and attempt < attempts
                and deadline.remaining() > 0
                and bool(pool.available(tried))
                and fleet.budget.try_spend()
            )
            if not retry:
                raise
            pool.retries_total += 1
        except asyncio.CancelledError:
            outcome = CANCELLED
            raise
        finally:
            worker.release(outcome)
    raise AssertionError("unreachable: the last attempt returns or raises")
