"""The Anthropic routes as the app mounts them: `/v1/messages` is the OpenAI
generation route (`gateway.edge.openai.generation`) with the Messages parser and
encoder, so it takes the same slots, deadlines, cancellation, team limits,
queue, metrics, access log and traces as chat completions;
`/v1/messages/count_tokens` is a unary worker call. The app puts its checks
(Host, key, content type) in front of each, and `AnthropicShape` around them, so
every refusal, the checks' included, is in Anthropic's shape.
"""

from __future__ import annotations

from dataclasses import fields as dataclass_fields
from dataclasses import replace
from typing import TYPE_CHECKING

from gateway.edge.anthropic.compaction import COMPACT
from gateway.edge.anthropic.context_editing import (
    CLEAR_THINKING,
    CLEAR_TOOL_USES,
    ContextEdits,
    edit,
)
from gateway.edge.anthropic.count_tokens import CountTokensRoute
from gateway.edge.anthropic.encoding import MessagesEncoder
from gateway.edge.anthropic.errors import sent_status
from gateway.edge.anthropic.mcp import listing_failed
from gateway.edge.anthropic.validation import (
    CompactingRequest,
    ConnectorRequest,
    MessagesRequest,
    parse_messages,
)
from gateway.edge.asgi import ASGIApp
from gateway.edge.compacting import summarizing
from gateway.edge.counting import prompt_counter
from gateway.edge.errors import APIError, invalid
from gateway.edge.mcp.routes import planned
from gateway.edge.mcp.turns import MAX_CALLS, ListingFailed
from gateway.edge.openai.generation import GenerationRoute
from gateway.edge.openai.input_limits import InputLimits
from gateway.edge.openai.validation import ParsedRequest
from gateway.edge.request import Exchange, Parts
from gateway.protocol import errors

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
    applied in the request's slot, before its generation (`context_editing.edit`: the
    prompts it needs counted are counted there, on the pool that serves), and reported
    in the answer's `context_management`; then its compaction, when it applies: the
    answer's turns (`compaction.py`), the summary's first."""

    def __init__(self, parts: Parts, limits: InputLimits) -> None:
        super().__init__(parse_messages, MessagesEncoder, parts, limits, CHAT_PARAMS)

    async def _serve(self, parsed: ParsedRequest, pool: ModelPool, ex: Exchange) -> None:
        if isinstance(parsed, MessagesRequest) and parsed.edits is not None:
            generate = parsed.generate
            count = prompt_counter(self, ex, pool, generate)
            assert generate.messages is not None
            try:
                messages, applied = await edit(generate.messages, parsed.edits, count)
            except errors.CannotCount:
                raise _uncountable(pool.name, parsed.edits) from None
            generate = replace(generate, messages=messages)
            parsed = replace(parsed, generate=generate, applied=applied)
        if isinstance(parsed, MessagesRequest) and parsed.mcp.servers:
            parsed = await self._planned(parsed, pool)
        if isinstance(parsed, MessagesRequest) and parsed.compaction is not None:
            parsed = await self._compacting(parsed, pool, ex)
        await super()._serve(parsed, pool, ex)

    async def _compacting(
        self, request: MessagesRequest, pool: ModelPool, ex: Exchange
    ) -> MessagesRequest:
        """`request` as a compacting one when its compaction applies (its trigger
        reached: the prompt, as the other edits left it, counted on `pool`), in its slot."""
        compaction, generate = request.compaction, request.generate
        assert compaction is not None and generate.messages is not None
        if compaction.trigger is not None:
            count = prompt_counter(self, ex, pool, generate)
            try:
                tokens = await count(generate.messages)
            except errors.CannotCount:
                raise _uncountable(pool.name, COMPACT) from None
            if tokens < compaction.trigger:
                return request
        fields = {f.name: getattr(request, f.name) for f in dataclass_fields(request)}
        summary = summarizing(generate, compaction.instructions)
        return CompactingRequest(**{**fields, "generate": summary, "asked": generate})

    async def _planned(self, request: MessagesRequest, pool: ModelPool) -> ConnectorRequest:
        """`request` with its MCP servers' tools given to the model, in its slot."""
        servers, listed = request.mcp.servers, request.mcp.listed
        try:
            plan, generate = await planned(self, servers, listed, request.generate, MAX_CALLS, pool)
        except ListingFailed as failure:
            raise listing_failed(failure) from None
        fields = {f.name: getattr(request, f.name) for f in dataclass_fields(request)}
        return ConnectorRequest(**{**fields, "generate": generate, "plan": plan})

    def encoder(self, parsed: ParsedRequest, pool: ModelPool) -> Encoder:
        encoder = super().encoder(parsed, pool)
        if isinstance(parsed, MessagesRequest) and parsed.edits is not None:
            assert isinstance(encoder, MessagesEncoder)
            encoder.applied = parsed.applied
        if isinstance(parsed, MessagesRequest) and parsed.thinking_omitted:
            assert isinstance(encoder, MessagesEncoder)
            encoder.omit_thinking = True
        return encoder


def _uncountable(model: str, edits: ContextEdits | str) -> APIError:
    """A 400 for edits (or the edit named) the model's upstream cannot count the prompt
    for (an OpenAI-compatible server without `/tokenize`), in the words of Anthropic's
    own, which Claude Code reads to stop sending the edit to that model."""
    if isinstance(edits, str):
        kind = edits
    else:
        kind = CLEAR_TOOL_USES if edits.tools is not None else CLEAR_THINKING
    return invalid(
        "context_management.edits",
        f"{model} does not support the {kind} context management strategy: its upstream "
        "server cannot count the prompt's tokens (context_management.edits).",
    )


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
