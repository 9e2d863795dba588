"""The Anthropic routes as the app mounts them: `/v1/messages` is the OpenAI
generation route (`gateway.edge.openai.generation`) with the Messages parser and
encoder, so it takes the same slots, deadlines, cancellation, team limits,
queue, metrics, access log and traces as chat completions;
`/v1/messages/count_tokens` is a unary worker call. The app puts its checks
(Host, key, content type) in front of each, and `AnthropicShape` around them, so
every refusal, the checks' included, is in Anthropic's shape.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from gateway.edge.anthropic.count_tokens import CountTokensRoute
from gateway.edge.anthropic.encoding import MessagesEncoder
from gateway.edge.anthropic.errors import sent_status
from gateway.edge.anthropic.validation import MessagesRequest, parse_messages
from gateway.edge.asgi import ASGIApp
from gateway.edge.counting import count_prompt
from gateway.edge.openai.generation import GenerationRoute
from gateway.edge.openai.input_limits import InputLimits
from gateway.edge.openai.validation import ParsedRequest
from gateway.edge.request import Exchange, Parts

if TYPE_CHECKING:
    from gateway.edge.openai.encoding import Encoder
    from gateway.fleet.pool import ModelPool

MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
#: Chat's parameters (as the checks shared with chat name them) → this API's.
CHAT_PARAMS = {
    "stop": "stop_sequences",
    "user": "metadata.user_id",
    "thinking_token_budget": "thinking.budget_tokens",
    "reasoning_effort": "output_config.effort",
    "response_format": "output_config.format",
}


class MessagesRoute(GenerationRoute):
    """`POST /v1/messages`: the generation route, with Anthropic's context editing
    reported: a request whose `context_management` cleared some thinking has its prompt
    as it came counted first, in its slot, for the answer's `cleared_input_tokens`."""

    def __init__(self, parts: Parts, limits: InputLimits) -> None:
        super().__init__(parse_messages, MessagesEncoder, parts, limits, CHAT_PARAMS)

    async def _serve(self, parsed: ParsedRequest, pool: ModelPool, ex: Exchange) -> None:
        if isinstance(parsed, MessagesRequest) and parsed.edits.unedited is not None:
            unedited = replace(parsed.generate, messages=parsed.edits.unedited, model=pool.name)
            parsed = replace(parsed, unedited_tokens=await count_prompt(self, ex, pool, unedited))
        await super()._serve(parsed, pool, ex)

    def encoder(self, parsed: ParsedRequest, pool: ModelPool) -> Encoder:
        encoder = super().encoder(parsed, pool)
        if isinstance(parsed, MessagesRequest):
            assert isinstance(encoder, MessagesEncoder)
            encoder.edits, encoder.unedited_tokens = parsed.edits, parsed.unedited_tokens
        return encoder


def anthropic_routes(parts: Parts, limits: InputLimits) -> dict[str, ASGIApp]:
    """Path → route, for the app's hot routes."""
    messages = MessagesRoute(parts, limits)
    count = CountTokensRoute(parts)
    for route in (messages, count):  # `AnthropicShape` sends their refusals' own codes
        route.sent_status = sent_status
    return {MESSAGES: messages, COUNT_TOKENS: count}


def anthropic_paths() -> tuple[str, ...]:
    """The paths whose refusals `AnthropicShape` reshapes."""
    return (MESSAGES, COUNT_TOKENS)
