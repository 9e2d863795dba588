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
#: Counts another prompt for the same admitted request (`count_prompt`, bound).
Recount = Callable[[GenerateRequest], Awaitable[int]]
#: A prompt's messages → its tokens, the request's other fields as they are (a route
#: that edits a prompt to fit: Anthropic's context editing, the Responses API's truncation).
PromptCount = Callable[[tuple[Message, ...]], Awaitable[int]]


class CountingRoute(RequestRoute[Exchange], Generic[P]):
    """A counting route in the edge's request frame (request.py); an API's route
    gives `parse` (its body → what it read), `prompt` (that → the request whose prompt is
    counted) and `answer` (the count → its body; `recount` counts another prompt, in the
    same slot)."""

    exchange = Exchange

    async def parse(self, body: Any, ex: Exchange) -> P:
        """The body as read, or a 4xx naming the parameter."""
        raise NotImplementedError

    def prompt(self, parsed: P) -> GenerateRequest:
        """The request whose prompt is counted."""
        raise NotImplementedError

    async def answer(self, parsed: P, tokens: int, recount: Recount) -> dict[str, Any]:
        """The answer's JSON body for `tokens`."""
        raise NotImplementedError

    async def serve(self, ex: Exchange) -> None:
        """Reads and checks the body (the model first: an unknown one is a 404 whatever
        else is wrong), admits it through admission's stages, has the prompt counted
        and answers."""
        ctx, record = ex.ctx, ex.record
        admission = self.admission
        meter = admission.before_body(ctx)  # the team's rate, and the bytes being read
        body = await read_json(ex.scope, ex.receive, self.config.max_body_bytes, meter)
        pool = admission.visibility(ctx, model_of(body))
        parsed = await self.parse(body, ex)
        request = replace(self.prompt(parsed), model=pool.name)
        ctx.request = request
        ctx.priority = priority(ex)
        ex.watch_client()  # from here: a client that leaves while queued leaves the queue
        async with admission.admit(ctx):
            tokens = await count_prompt(self, ex, pool, request)

            async def recount(other: GenerateRequest) -> int:
                return await count_prompt(self, ex, pool, replace(other, model=pool.name))

            answer = orjson.dumps(await self.answer(parsed, tokens, recount))
        record.status, record.outcome = 200, Outcome.COMPLETED
        request_id = record.request_id.encode("latin-1")
        await send_json(ex.send, 200, answer, [(b"x-request-id", request_id)])


async def count_prompt(
    route: RequestRoute[Exchange], ex: Exchange, pool: ModelPool, request: GenerateRequest
) -> int:
    """The tokens of `request`'s prompt, counted on `pool` for the admitted request of
    `ex` (in its slot, within `request_timeout`, on a span of its own): a counting
    route's answer, or a generation route's figure (Anthropic's context editing)."""
    timeout = route.config.request_timeout
    with route.tracing.engine_call(pool.name, ex.metadata, COUNT_TOKENS) as (span, meta):
        work = count_tokens(route.fleet, pool, request, Deadline(timeout), meta)
        tokens, ex.record.worker = await route.admission.unary(ex.ctx, work, timeout, "The count")
        annotate(span, {"furnace.worker": ex.record.worker, "furnace.counted_tokens": tokens})
    return tokens


def prompt_counter(
    route: RequestRoute[Exchange], ex: Exchange, pool: ModelPool, request: GenerateRequest
) -> PromptCount:
    """Counts `request` with other messages, on `pool`, for the admitted request of `ex`
    (`count_prompt`'s rules)."""
    request = replace(request, model=pool.name)

    async def count(messages: tuple[Message, ...]) -> int:
        return await count_prompt(route, ex, pool, replace(request, messages=messages))

    return count
