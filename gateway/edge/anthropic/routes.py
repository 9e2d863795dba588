"""The Anthropic routes as the app mounts them: `/v1/messages` is the OpenAI
generation route (`gateway.edge.openai.generation`) with the Messages parser and
encoder, so it takes the same slots, deadlines, cancellation, team limits,
queue, metrics, access log and traces as chat completions;
`/v1/messages/count_tokens` is a unary worker call. The app puts its checks
(Host, key, content type) in front of each, and `AnthropicShape` around them, so
every refusal, the checks' included, is in Anthropic's shape.
"""

from __future__ import annotations

from gateway.edge.anthropic.count_tokens import CountTokensRoute
from gateway.edge.anthropic.encoding import MessagesEncoder
from gateway.edge.anthropic.errors import sent_status
from gateway.edge.anthropic.validation import parse_messages
from gateway.edge.asgi import ASGIApp
from gateway.edge.openai.generation import GenerationRoute
from gateway.edge.openai.input_limits import InputLimits
from gateway.edge.request import Parts

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


def anthropic_routes(parts: Parts, limits: InputLimits) -> dict[str, ASGIApp]:
    """Path → route, for the app's hot routes."""
    messages = GenerationRoute(parse_messages, MessagesEncoder, parts, limits, CHAT_PARAMS)
    count = CountTokensRoute(parts)
    for route in (messages, count):  # `AnthropicShape` sends their refusals' own codes
        route.sent_status = sent_status
    return {MESSAGES: messages, COUNT_TOKENS: count}


def anthropic_paths() -> tuple[str, ...]:
    """The paths whose refusals `AnthropicShape` reshapes."""
    return (MESSAGES, COUNT_TOKENS)
