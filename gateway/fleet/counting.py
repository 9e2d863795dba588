"""A prompt's tokens on the fleet: counted (Anthropic's count_tokens, the Responses API's
input_tokens), shown (`/tokenize`) and ids decoded (`/detokenize`). Each is one unary call
on one of the model's workers, through its upstream, with the time left as its deadline
and the fleet's unary rules (`unary`): a retryable failure goes to another worker. All
are pure functions of what they are given, so a retry costs time, never a wrong answer. An
upstream that holds the model's tokenizer itself (`vllm-grpc`) answers in the gateway and
never reaches the worker. A LoRA adapter's tokens are its base's (the same tokenizer and
template), on any of its workers, with no load of the adapter.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

from gateway.fleet.unary import call_unary
from gateway.protocol import errors, features
from gateway.protocol.deadline import Deadline
from gateway.protocol.types import GenerateRequest, Tokens
from gateway.upstreams.base import Tokenizes

if TYPE_CHECKING:
    from gateway.fleet import Fleet
    from gateway.fleet.pool import ModelPool
    from gateway.fleet.worker import Worker

T = TypeVar("T")
Metadata = tuple[tuple[str, str], ...]


async def count_tokens(
    fleet: Fleet,
    pool: ModelPool,
    request: GenerateRequest,
    deadline: Deadline,
    metadata: Metadata = (),
) -> tuple[int, str]:
    """The tokens of the prompt `request` makes, by a worker of `pool`, and that worker's
    address."""
    pool, request = _base(pool, request)
    _check_chat_end(pool, request)

    async def call(worker: Worker) -> int:
        return await worker.upstream.count_tokens(request, deadline.remaining(), metadata)

    return await _on_worker(fleet, pool, deadline, call)


async def tokenize(
    fleet: Fleet,
    pool: ModelPool,
    request: GenerateRequest,
    token_strs: bool,
    deadline: Deadline,
    metadata: Metadata = (),
) -> tuple[Tokens, str]:
    """The ids of the prompt `request` makes (those `count_tokens` counts), with their
    strings when `token_strs`, by a worker of `pool`, and that worker's address."""
    pool, request = _base(pool, request)
    _check_tokenizes(pool)
    _check_chat_end(pool, request)

    async def call(worker: Worker) -> Tokens:
        upstream = _tokenizer(worker, pool)
        return await upstream.tokenize(request, token_strs, deadline.remaining(), metadata)

    return await _on_worker(fleet, pool, deadline, call)


async def detokenize(
    fleet: Fleet, pool: ModelPool, ids: list[int], deadline: Deadline, metadata: Metadata = ()
) -> tuple[str, str]:
    """The text `ids` decode to by `pool`'s tokenizer, special tokens kept, and the address
    of the worker that decoded them."""
    if pool.base is not None:
        pool = pool.base
    _check_tokenizes(pool)
    model = pool.name

    async def call(worker: Worker) -> str:
        upstream = _tokenizer(worker, pool)
        return await upstream.detokenize(model, ids, deadline.remaining(), metadata)

    return await _on_worker(fleet, pool, deadline, call)


def _base(pool: ModelPool, request: GenerateRequest) -> tuple[ModelPool, GenerateRequest]:
    """An adapter's request as its base's (the same tokenizer and template)."""
    base = pool.base
    if base is None:
        return pool, request
    return base, replace(request, model=base.name)


async def _on_worker(
    fleet: Fleet, pool: ModelPool, deadline: Deadline, call: Callable[[Worker], Awaitable[T]]
) -> tuple[T, str]:
    answer, worker = await call_unary(fleet, pool, deadline, call, lambda e: e.retryable)
    return answer, worker.address


def _check_tokenizes(pool: ModelPool) -> None:
    """A 400 naming `model` when its workers say they show no tokens (our workers that
    do not list "tokenize"; a tensor model's)."""
    served = pool.features()
    if served is not None and features.TOKENIZE not in served:
        raise _cannot(pool)


def _check_chat_end(pool: ModelPool, request: GenerateRequest) -> None:
    """A 400 naming the parameter when the model's workers cannot end the chat as it
    asks (as its generation is refused), not a count of another prompt; workers not
    described yet refuse for themselves."""
    served = pool.features()
    lacking = None if served is None else features.missing_chat_end(request, served)
    if lacking is not None:
        feature, param = lacking
        raise errors.Invalid(f"The model `{pool.name}` does not support '{feature}'.", param=param)


def _tokenizer(worker: Worker, pool: ModelPool) -> Tokenizes:
    upstream = worker.upstream
    if not isinstance(upstream, Tokenizes):
        raise _cannot(pool)
    return upstream


def _cannot(pool: ModelPool) -> errors.CannotCount:
    return errors.CannotCount(
        f"The workers of `{pool.name}` do not show their tokens (/tokenize, /detokenize).",
        param="model",
    )
