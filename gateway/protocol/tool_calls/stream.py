"""One choice's tool-call parsing as our events: what an engine or upstream
that detokenizes itself feeds (text with its token count and logprobs), and
the `Text` and `ToolCallDelta` events that come out, so every engine counts
tokens and ends answers alike.

Tokens follow the text: a piece's tokens (and logprobs) wait with the text the
parser holds back and go with the first event that text releases, a `Text`
(which then carries their logprobs) or a call's first `ToolCallDelta` (logprobs
of tokens that became a call are not reported: OpenAI reports logprobs of
content only). Without a parser (no tools in play) text goes straight through
with the same accounting."""

from __future__ import annotations

from gateway.protocol.tool_calls.base import Parsed, ToolCallParser
from gateway.protocol.types import Event, FinishReason, Text, TokenLogprob, ToolCallDelta


class _Plain(ToolCallParser):
    """No tools in play: all text, nothing held (and no state: one serves every choice)."""

    def __init__(self) -> None:
        super().__init__(())

    def feed(self, text: str) -> Parsed:
        return Parsed(text)

    def finish(self) -> Parsed:
        return Parsed("")


_PLAIN = _Plain()


class ChoiceToolCalls:
    """Feeds one choice's text through a parser, giving our events."""

    __slots__ = ("_index", "_logprobs", "_parser", "_tokens")

    def __init__(self, parser: ToolCallParser | None, index: int = 0) -> None:
        self._parser = parser or _PLAIN
        self._index = index
        self._tokens = 0
        self._logprobs: list[TokenLogprob] | None = None

    def feed(
        self, text: str, tokens: int, logprobs: tuple[TokenLogprob, ...] | None = None
    ) -> list[Event]:
        """The events `text` (of `tokens` tokens) releases; none while held back."""
        self._tokens += tokens
        if logprobs is not None:
            self._logprobs = [*(self._logprobs or ()), *logprobs]
        return self._events(self._parser.feed(text))

    def finish(self) -> list[Event]:
        """The events of what was held back, once the answer ended. Tokens that
        released nothing (an end-of-sequence token) go with an empty `Text` when
        they carry logprobs (one each, as vLLM reports them); otherwise only the
        choice's `Finished` counts them."""
        events = self._events(self._parser.finish())
        if self._tokens and self._logprobs:
            events.append(self._text(""))
        self._tokens = 0
        return events

    def finish_reason(self, reason: FinishReason) -> FinishReason:
        """The choice's finish reason: `tool_calls` when it called and stopped."""
        if reason is FinishReason.STOP and self._parser.called:
            return FinishReason.TOOL_CALLS
        return reason

    def _text(self, text: str) -> Text:
        logprobs = None if self._logprobs is None else tuple(self._logprobs)
        event = Text(text, self._tokens, self._index, logprobs)
        self._tokens = 0
        if self._logprobs is not None:
            self._logprobs = []
        return event

    def _events(self, parsed: Parsed) -> list[Event]:
        events: list[Event] = []
        if parsed.text:
            events.append(self._text(parsed.text))
        for piece in parsed.calls:
            events.append(
                ToolCallDelta(
                    self._index,
                    piece.call_index,
                    piece.id,
                    piece.name,
                    piece.arguments,
                    self._tokens,
                )
            )
            self._tokens = 0
            if self._logprobs is not None:
                self._logprobs = []
        return events
