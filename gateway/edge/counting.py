"""The routes that count a prompt's tokens without generating: Anthropic's
`POST /v1/messages/count_tokens` and OpenAI's `POST /v1/responses/input_tokens`.
They differ only in how a body becomes our request and how the count is answered;
the rest is this one route (`CountingRoute`), so that both count the same way.

Counted where the model's chat template and tokenizer are: by the gateway's own
tokenizer for a `vllm-grpc` model, else by a worker (our workers' `CountTokens`
RPC, an OpenAI-compatible server's `/tokenize`), through the fleet's unary call
(`gateway.fleet.counting`). The request is admitted like any other (drain, team
limits, a slot), bounded by `request_timeout`, cancelled when its client leaves,
and leaves one record in the metrics and the access log. It uses no tokens: a
count is not a prompt the engine took, so the ledger, the budgets, the team's
token limits and the token counters see none (neither Anthropic nor OpenAI bills
counting); the count is on the request's span.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import orjson

from gateway.edge.asgi import send_json
from gateway.edge.openai.body import read_json
from gateway.edge.openai.validation import model_of
from gateway.edge.request import Exchange, RequestRoute, priority
from gateway.fleet.counting import count_tokens
from gateway.protocol.deadline import Deadline
from gateway.protocol.errors import Outcome
from gateway.protocol.types import GenerateRequest, Message
from gateway.telemetry.tracing import annotate

if TYPE_CHECKING:
    from gateway.fleet.pool import ModelPool

#: The CLIENT span's name for a worker call: the gRPC method it is.
COUNT_TOKENS = "furnace.engine/CountTokens"


#: What an API's counting route reads a body as (its request, and anything its answer needs).
P = TypeVar("P")
#: What a tokenizer's call answers.
T = TypeVar("T")
#: A worker call's gRPC metadata (the request's id, its trace).
Metadata = tuple[tuple[str, str], ...]
#: Counts another prompt for the same admitted request (`count_prompt`, bound).
Recount = Callable[[GenerateRequest], Awaitable[int]]
#: A prompt's messages → its tokens, the request's other fields as they are (a route
#: that edits a prompt to fit: Anthropic's context editing, the Responses API's truncation).
PromptCount = Callable[[tuple[Message, ...]], Awaitable[int]]


class TokenizerRoute(RequestRoute[Exchange], Generic[P]):
    """A route answered by the model's tokenizer, in the edge's request frame
    (request.py): an API's route gives `parse` (its body → what it read), `prompt` (that →
    the request whose prompt it reads, None for none) and `work` (that → the answer's
    body, in the admitted request's slot)."""

    exchange = Exchange

    async def parse(self, body: Any, ex: Exchange) -> P:
        """The body as read, or a 4xx naming the parameter."""
        raise NotImplementedError

    def prompt(self, parsed: P) -> GenerateRequest | None:
        """The request whose prompt is read (None: it reads no prompt)."""
        raise NotImplementedError

    async def work(self, ex: Exchange, pool: ModelPool, parsed: P) -> dict[str, Any]:
        """The answer's JSON body, from the admitted request's calls on `pool`."""
        raise NotImplementedError

    async def serve(self, ex: Exchange) -> None:
        """Reads and checks the body (the model first: an unknown one is a 404 whatever
        else is wrong), admits it through admission's stages, has it answered."""
        ctx, record = ex.ctx, ex.record
        admission = self.admission
        meter = admission.before_body(ctx)  # the team's rate, and the bytes being read
        body = await read_json(ex.scope, ex.receive, self.config.max_body_bytes, meter)
        pool = admission.visibility(ctx, model_of(body))
        parsed = await self.parse(body, ex)
        request = self.prompt(parsed)
        if request is not None:  # a prompt read, nothing written: no completion reserved
            sampling = replace(request.sampling, max_tokens=0)
            ctx.request = replace(request, model=pool.name, sampling=sampling)
        ctx.priority = priority(ex)
        ex.watch_client()  # from here: a client that leaves while queued leaves the queue
        async with admission.admit(ctx):
            answer = orjson.dumps(await self.work(ex, _pool(ex), parsed))
        record.status, record.outcome = 200, Outcome.COMPLETED
        request_id = record.request_id.encode("latin-1")
        await send_json(ex.send, 200, answer, [(b"x-request-id", request_id)])


def _pool(ex: Exchange) -> ModelPool:
    """The admitted request's model (a fallback's where admission moved it)."""
    pool = ex.ctx.pool
    assert pool is not None, "admitted"
    return pool


class CountingRoute(TokenizerRoute[P]):
    """A counting route: its API gives `parse`, `prompt` and `answer` (the count → its
    body; `recount` counts another prompt, in the same slot)."""

    def prompt(self, parsed: P) -> GenerateRequest:
        """The request whose prompt is counted."""
        raise NotImplementedError

    async def answer(self, parsed: P, tokens: int, recount: Recount) -> dict[str, Any]:
        """The answer's JSON body for `tokens`."""
        raise NotImplementedError

    async def work(self, ex: Exchange, pool: ModelPool, parsed: P) -> dict[str, Any]:
        request = replace(self.prompt(parsed), model=pool.name)
        tokens = await count_prompt(self, ex, pool, request)

        async def recount(other: GenerateRequest) -> int:
            return await count_prompt(self, ex, pool, replace(other, model=pool.name))

        return await self.answer(parsed, tokens, recount)


async def count_prompt(
    route: RequestRoute[Exchange], ex: Exchange, pool: ModelPool, request: GenerateRequest
) -> int:
    """The tokens of `request`'s prompt, counted on `pool` for the admitted request of
    `ex` (`on_tokenizer`'s rules): a counting route's answer, or a generation route's
    figure (Anthropic's context editing)."""

    def work(deadline: Deadline, metadata: Metadata) -> Awaitable[tuple[int, str]]:
        return count_tokens(route.fleet, pool, request, deadline, metadata)

    return await on_tokenizer(route, ex, pool, COUNT_TOKENS, "The count", work, int)


async def on_tokenizer(
    route: RequestRoute[Exchange],
    ex: Exchange,
    pool: ModelPool,
    method: str,
    what: str,
    work: Callable[[Deadline, Metadata], Awaitable[tuple[T, str]]],
    counted: Callable[[T], int] | None = None,
) -> T:
    """`work`'s answer (a fleet call: `gateway.fleet.counting`) for the admitted request
    of `ex`, in its slot, within `request_timeout`, on a CLIENT span named `method`
    (`what` names it in a timeout's message); the worker that answered goes on the
    request's record and the span, with the tokens `counted` where it counts some."""
    timeout = route.config.request_timeout
    with route.tracing.engine_call(pool.name, ex.metadata, method) as (span, meta):
        call = work(Deadline(timeout), meta)
        answer, ex.record.worker = await route.admission.unary(ex.ctx, call, timeout, what)
        attributes: dict[str, Any] = {"furnace.worker": ex.record.worker}
        if counted is not None:
            attributes["furnace.counted_tokens"] = counted(answer)
        annotate(span, attributes)
    return answer


def prompt_counter(
    route: RequestRoute[Exchange], ex: Exchange, pool: ModelPool, request: GenerateRequest
) -> PromptCount:
    """Counts `request` with other messages, on `pool`, for the admitted request of `ex`
    (`count_prompt`'s rules)."""
    request = replace(request, model=pool.name)

    async def count(messages: tuple[Message, ...]) -> int:
        return await count_prompt(route, ex, pool, replace(request, messages=messages))

    return count
