"""Counting a prompt's tokens on the fleet (Anthropic's count_tokens): one unary call on
one of the model's workers, through its upstream (`Upstream.count_tokens`), with the time
left as its deadline and the fleet's unary rules (`unary`): a retryable failure goes to
another worker. A count is a pure function of the prompt, so a retry costs time, never a
wrong answer. An upstream that holds the model's tokenizer itself (`vllm-grpc`) counts in
the gateway and never reaches the worker.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from gateway.fleet.unary import call_unary
from gateway.protocol.deadline import Deadline
from gateway.protocol.types import GenerateRequest

if TYPE_CHECKING:
    from gateway.fleet import Fleet
    from gateway.fleet.pool import ModelPool
    from gateway.fleet.worker import Worker


async def count_tokens(
    fleet: Fleet,
    pool: ModelPool,
    request: GenerateRequest,
    deadline: Deadline,
    metadata: tuple[tuple[str, str], ...] = (),
) -> tuple[int, str]:
    """The tokens of the prompt `request` makes, by a worker of `pool`, and that worker's
    address. A LoRA adapter's prompt is counted by its base (the same tokenizer and
    template), on any of its workers, with no load of the adapter."""
    base = pool.base
    if base is not None:
        pool, request = base, replace(request, model=base.name)

    async def call(worker: Worker) -> int:
        return await worker.upstream.count_tokens(request, deadline.remaining(), metadata)

    tokens, worker = await call_unary(fleet, pool, deadline, call, lambda e: e.retryable)
    return tokens, worker.address
