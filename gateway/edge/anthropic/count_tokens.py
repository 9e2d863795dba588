"""`POST /v1/messages/count_tokens`: the tokens the prompt of a Messages body
would take (system, messages, tools), `{"input_tokens": N}`: the edge's counting
route (gateway/edge/counting.py: where it is counted, how it is admitted, what it
bills) with the Messages API's body and answer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gateway.edge.anthropic.context_editing import ContextEdits, edit, once
from gateway.edge.anthropic.validation import parse_count
from gateway.edge.counting import CountingRoute, Recount
from gateway.edge.request import Exchange
from gateway.protocol.types import GenerateRequest, Message

#: A body as read: its prompt, and what its `context_management` did (None: not asked).
Counted = tuple[GenerateRequest, ContextEdits | None]


class CountTokensRoute(CountingRoute[Counted]):
    """`POST /v1/messages/count_tokens`; with `context_management`, the count is of the
    prompt edited, and `original_input_tokens` of the prompt as it came (as Anthropic's)."""

    async def parse(self, body: Any, ex: Exchange) -> Counted:
        return parse_count(body, ex.record.request_id)

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
