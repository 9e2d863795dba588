"""Tensor models on the fleet: one inference on one of the model's workers, and the model's
metadata (read from a worker, cached by its upstream), with the balancing, ejection and retry
rules of LLM requests, less what has no meaning here (`unary`).

An inference has no first event to wait for, so the only failure retried on another worker is
one that shows the worker never saw the call (`never_started`: UNAVAILABLE on a channel that
was not connected); anything later may have run and is the client's to retry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gateway.fleet.unary import call_unary, never_started, pick
from gateway.protocol import errors
from gateway.protocol.deadline import Deadline
from gateway.protocol.inference import InferRequest, InferResult, ModelMetadata
from gateway.upstreams.kserve_grpc import KServeGrpcUpstream

if TYPE_CHECKING:
    from gateway.fleet import Fleet
    from gateway.fleet.pool import ModelPool
    from gateway.fleet.worker import Worker

METADATA_TIMEOUT = 5.0


def _tensor_upstream(pool: ModelPool, worker: Worker) -> KServeGrpcUpstream:
    upstream = worker.upstream
    if not isinstance(upstream, KServeGrpcUpstream):
        raise errors.NotAnLLM(f"The model `{pool.name}` is not served by tensor workers.")
    return upstream


async def model_metadata(pool: ModelPool, version: str) -> ModelMetadata:
    """The model's inputs and outputs, as a worker declares them."""
    tried: set[Worker] = set()
    while True:
        worker = pick(pool, tried)
        upstream = _tensor_upstream(pool, worker)
        tried.add(worker)
        try:
            return await upstream.model_metadata(version, METADATA_TIMEOUT)
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

    async def call(worker: Worker) -> InferResult:
        return await _tensor_upstream(pool, worker).infer(request, deadline.remaining(), metadata)

    result, _ = await call_unary(fleet, pool, deadline, call, never_started)
    return result
