"""`POST /v1/messages/count_tokens`: the tokens the prompt of a Messages body
would take (system, messages, tools), `{"input_tokens": N}`: the edge's counting
route (gateway/edge/counting.py: where it is counted, how it is admitted, what it
bills) with the Messages API's body and answer.
"""

from __future__ import annotations

from typing import Any

from gateway.edge.anthropic.validation import parse_count
from gateway.edge.counting import CountingRoute
from gateway.edge.request import Exchange
from gateway.protocol.types import GenerateRequest


class CountTokensRoute(CountingRoute):
    """`POST /v1/messages/count_tokens`."""

    async def request_of(self, body: Any, ex: Exchange) -> GenerateRequest:
        return parse_count(body, ex.record.request_id)

    def answer(self, tokens: int) -> dict[str, Any]:
        return {"input_tokens": tokens}
