"""Prefill/decode disaggregation (`models[].prefill_workers`): a request's prompt is
prefilled on a prefill worker, which keeps its KV blocks, and the decode worker the fleet
then calls pulls them instead of computing them (vLLM's NixlConnector, as vLLM's own
proxy and vllm-router drive it), over vLLM's OpenAI server or its gRPC server (`Prefills`).

The prefill workers are a pool of their own, picked by the model's `balance`, or by its
`prefill_routing` (else its `routing`) on their own engines' KV events and loads (where a
prompt's prefix is already cached, its prefill is shortest: the tier where prefix hits pay).

The prefill is one unary call before the decode call's tries, never retried: whatever
goes wrong with it (no prefill worker available, a refusal, a timeout, an answer without
`kv_transfer_params`), the decode worker is called without the blocks' whereabouts and
prefills the prompt itself, so a sick prefill tier costs time, never an answer. A refusal
of the request itself (a prompt beyond the context) comes back from the decode worker,
in its own words, as without disaggregation.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from gateway.protocol import errors
from gateway.protocol.types import GenerateRequest
from gateway.telemetry import RequestRecord
from gateway.upstreams.base import CANCELLED, CallEnd, Prefills

if TYPE_CHECKING:
    from gateway.fleet.pool import ModelPool

log = logging.getLogger("furnace.fleet")


async def prefilled(
    prefill: ModelPool,
    request: GenerateRequest,
    timeout: float,  # noqa: ASYNC109 (the prefill's own bound, within the request's deadline)
    metadata: tuple[tuple[str, str], ...],
    record: RequestRecord | None,
) -> GenerateRequest:
    """`request` with where a prefill worker of `prefill` left its prompt's KV blocks
    (`GenerateRequest.kv_transfer`), or as it was when the prefill did not happen; each
    outcome counted on the pool (`ModelPool.prefills`)."""
    router = prefill.router  # on the prefill workers' own caches and loads
    if router is not None:
        await router.prepare(request, prefill.workers.values())
    worker = prefill.pick(request, set())
    if worker is None:
        prefill.prefills["no_worker"] += 1
        return request
    hit = None if router is None else router.last.cache_hit_blocks
    upstream = worker.upstream
    assert isinstance(upstream, Prefills)  # the config allows no other
    worker.count_call(1)
    outcome: CallEnd = CANCELLED  # until it ends otherwise: the client left meanwhile
    try:
        decoded = await upstream.prefill(request, timeout, metadata)
        outcome = None
    except errors.GatewayError as error:
        outcome = error
        prefill.prefills["failed"] += 1
        log.warning(
            "model %s: prefill on %s failed, decoding without it: %s",
            prefill.name,
            worker.address,
            error.message,
        )
        return request
    finally:
        worker.release(outcome)
    prefill.prefills["transferred"] += 1
    if record is not None:
        record.prefill_worker, record.prefill_cache_hit_blocks = worker.address, hit
    return decoded
