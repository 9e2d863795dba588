"""`POST /v1/responses/input_tokens` (the SDK's `responses.input_tokens.count`): the
tokens the prompt of a Responses body would take, `{"object": "response.input_tokens",
"input_tokens": N}`, so that a client can see whether a turn fits before it sends it.

It is the edge's counting route (gateway/edge/counting.py: where it is counted, how it
is admitted, what it bills), shared with Anthropic's count_tokens, and its prompt is
the one `POST /v1/responses` would send: the body goes through that route's own
`parse_body`, so the input items, `instructions`, tools, `tool_choice`, `text.format`,
`reasoning`, `truncation` and a stored conversation
(`previous_response_id`'s, or a `conversation`'s items: the caller's team's, with their
bounds) are read as there, and a count equals the answer's `usage.input_tokens`. Only the
fields OpenAI defines for this route are taken: any other is a 400 naming it (a
generation's `max_output_tokens` is no part of a count). `personality` (a model-owned
style preset) means nothing to these models and is refused by name.

With `truncation: "auto"`, the count is of the prompt that `POST /v1/responses` would
send: items dropped from the conversation's beginning until it leaves a token of the
model's context (truncation.py, with the counts it makes, in the same slot); a model
whose context is unknown refuses it, naming `truncation`, as there. A body's remote MCP
servers have their tools listed (gateway/edge/mcp) and counted with the prompt, as its
answer's first turn gives them to the model.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from gateway.edge.counting import CountingRoute, Recount
from gateway.edge.errors import invalid, unknown_parameters
from gateway.edge.mcp.routes import planned
from gateway.edge.mcp.turns import MAX_CALLS, ListingFailed
from gateway.edge.request import Exchange, Parts
from gateway.edge.responses.mcp import listing_failed, listings
from gateway.edge.responses.routes import (
    RESPONSES,
    ResponsesRequest,
    ResponsesRoute,
    no_truncation,
)
from gateway.edge.responses.truncation import fit
from gateway.protocol.types import GenerateRequest, Message

if TYPE_CHECKING:
    from gateway.fleet.pool import ModelPool

INPUT_TOKENS = RESPONSES + "/input_tokens"
#: The body's fields OpenAI defines for this route.
FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "previous_response_id",
        "reasoning",
        "text",
        "truncation",
        "conversation",
        "personality",
    }
)


def check_fields(body: dict[str, Any]) -> None:
    """A 400 naming the first field this route does not take, or takes but does not
    serve (at any value but null, which asks nothing)."""
    unknown_parameters(body, FIELDS)
    if body.get("personality") is not None:
        raise invalid("personality", "'personality' is not supported by this gateway.")


#: A body as this route reads it: the request, and with `truncation: "auto"` the model's
#: pool, whose context the prompt is fitted to (None: no truncation).
Read = tuple[ResponsesRequest, "ModelPool | None"]


class InputTokensRoute(CountingRoute[Read]):
    """`POST /v1/responses/input_tokens`, reading bodies as `responses` does."""

    def __init__(self, parts: Parts, responses: ResponsesRoute) -> None:
        super().__init__(parts)
        self.responses = responses

    async def parse(self, body: Any, ex: Exchange) -> Read:
        check_fields(body)  # `CountingRoute.serve` checked that it is an object
        parsed = await self.responses.parse_body(body, ex)
        assert isinstance(parsed, ResponsesRequest) and parsed.body is not None
        body = parsed.body
        pool = ex.ctx.pool  # the model's, found before the body was read
        assert pool is not None
        if body.mcp:  # their tools are the prompt's too: listed as an answer lists them
            servers, listed = body.mcp, listings([*parsed.history, *body.items])
            try:
                _, generate = await planned(self, servers, listed, parsed.generate, MAX_CALLS, pool)
            except ListingFailed as failure:
                raise listing_failed(failure) from None
            parsed = replace(parsed, generate=generate)
        if not body.truncate:
            return parsed, None
        if not pool.max_context:
            raise no_truncation(pool.name, "its context length is unknown")
        return parsed, pool

    def prompt(self, parsed: Read) -> GenerateRequest:
        return parsed[0].generate

    async def answer(self, parsed: Read, tokens: int, recount: Recount) -> dict[str, Any]:
        request, pool = parsed
        if pool is not None and pool.max_context and request.body is not None:
            body = request.body

            async def count(messages: tuple[Message, ...]) -> int:
                return await recount(replace(request.generate, messages=messages))

            items = [*request.history, *body.items]
            fitted = await fit(body.instructions, items, count, pool.max_context, 1, tokens)
            tokens = fitted.tokens
        return {"object": "response.input_tokens", "input_tokens": tokens}
