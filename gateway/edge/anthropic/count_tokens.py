"""`POST /v1/messages/count_tokens`: the tokens the prompt of a Messages body
would take (system, messages, tools, and the tools of its `mcp_servers`, listed as
its answer lists them), `{"input_tokens": N}`: the edge's counting route
(gateway/edge/counting.py: where it is counted, how it is admitted, what it bills)
with the Messages API's body and answer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gateway.edge.anthropic.context_editing import ContextEdits, edit, once
from gateway.edge.anthropic.mcp import listing_failed
from gateway.edge.anthropic.validation import parse_count
from gateway.edge.counting import CountingRoute, Recount
from gateway.edge.mcp.routes import planned
from gateway.edge.mcp.turns import MAX_CALLS, ListingFailed
from gateway.edge.request import Exchange
from gateway.protocol.types import GenerateRequest, Message

#: A body as read: its prompt, and what its `context_management` did (None: not asked).
Counted = tuple[GenerateRequest, ContextEdits | None]


class CountTokensRoute(CountingRoute[Counted]):
    """`POST /v1/messages/count_tokens`; with `context_management`, the count is of the
    prompt edited, and `original_input_tokens` of the prompt as it came (as Anthropic's)."""

    async def parse(self, body: Any, ex: Exchange) -> Counted:
        request, edits, mcp = parse_count(body, ex.record.request_id)
        if mcp.servers:  # their tools are the prompt's too: listed as an answer lists them
            pool = ex.ctx.pool  # the model's, found before the body was read
            assert pool is not None
            try:
                _, request = await planned(self, mcp.servers, mcp.listed, request, MAX_CALLS, pool)
            except ListingFailed as failure:
                raise listing_failed(failure) from None
        return request, edits

    def prompt(self, parsed: Counted) -> GenerateRequest:
        return parsed[0]

    async def answer(self, parsed: Counted, tokens: int, recount: Recount) -> dict[str, Any]:
        request, edits = parsed
        if edits is None:
            return {"input_tokens": tokens}
        assert request.messages is not None

        async def count(messages: tuple[Message, ...]) -> int:
            return await recount(replace(request, messages=messages))

        counted = once(count, request.messages, tokens)
        messages, applied = await edit(request.messages, edits, counted)
        edited = await counted(messages)
        original = applied[0].tokens_before if applied else edited
        return {"input_tokens": edited, "context_management": {"original_input_tokens": original}}
