"""The Llama 3.x JSON format: the answer is one or more calls, each
`{"name": ..., "parameters": {...}}` ("arguments" is taken too), separated by
`;`, possibly after `<|python_tag|>` (a special token, so usually already gone
from the detokenized text). As in vLLM's llama3_json parser, only an answer
that begins with a call (or the tag) holds calls: an answer that begins with
other text is all text. After a call, anything but `;` and another call is
text, and so is an object that is not a call of the request's tools.
"""

from __future__ import annotations

import enum

from gateway.protocol.tool_calls.base import (
    MAX_WHITESPACE,
    CallPiece,
    CallText,
    Parsed,
    ToolCallParser,
    parse_object,
)
from gateway.protocol.types import Tool

TAG = "<|python_tag|>"
SEPARATOR = ";"
KEYS = ("parameters", "arguments")


class _State(enum.Enum):
    START = "start"  # nothing but whitespace yet: the tag or a call may come
    BEFORE = "before"  # after the tag or a `;`: a call's `{` must come
    OBJECT = "object"  # inside a call's JSON (the buffer starts with its `{`)
    AFTER = "after"  # after a call: `;` or the end
    TEXT = "text"  # plain text to the end


class Llama3JsonParser(ToolCallParser):
    """Holds the answer's start while it may be the tag or a call, then each
    call's JSON until it closes."""

    def __init__(self, tools: tuple[Tool, ...], *, single: bool = False) -> None:
        super().__init__(tools, single=single)
        self._state = _State.START
        self._buffer = ""
        #: What was consumed of a segment that may still turn out to be no call
        #: (whitespace, the tag, a `;`): shown if it is text after all.
        self._consumed = ""
        self._call = CallText()  # the call's JSON read so far (state OBJECT)

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        shown: list[str] = []
        calls: list[CallPiece] = []
        while self._buffer:
            state, buffer = self._state, self._buffer
            if state is _State.TEXT:
                shown.append(self.show(self._consumed + buffer))
                self._consumed = self._buffer = ""
            elif state is _State.OBJECT:
                closed = self._call.feed(buffer)
                self._buffer = ""
                if closed is None:
                    break
                value, self._buffer = closed
                pieces = self.call(parse_object(value), KEYS)
                if pieces is None:  # not a call: text from here on
                    self._consumed += value
                    self._state = _State.TEXT
                    continue
                calls.extend(pieces)
                self._consumed = ""
                self._state = _State.AFTER
            else:
                stripped = buffer.lstrip()
                if not stripped:
                    if len(self._consumed) + len(buffer) > MAX_WHITESPACE:
                        self._state = _State.TEXT
                        continue
                    if state is _State.AFTER:  # held with what it turns out to be
                        self._consume(len(buffer), state)
                    break
                skipped = len(buffer) - len(stripped)
                if state is _State.START and stripped.startswith(TAG):
                    self._consume(skipped + len(TAG), _State.BEFORE)
                elif state is _State.START and TAG.startswith(stripped):
                    break  # may be the tag
                elif state is _State.AFTER and stripped[0] == SEPARATOR:
                    self._consume(skipped + 1, _State.BEFORE)
                elif state is not _State.AFTER and stripped[0] == "{":
                    self._consume(skipped, _State.OBJECT)
                    self._call = CallText()
                else:
                    self._state = _State.TEXT
        return Parsed("".join(shown), tuple(calls))

    def _consume(self, size: int, state: _State) -> None:
        self._consumed += self._buffer[:size]
        self._buffer = self._buffer[size:]
        self._state = state

    def finish(self) -> Parsed:
        rest = self._consumed + self._call.take() + self._buffer
        if self._state is _State.BEFORE and self.called and not rest.strip(" \t\n\r;"):
            rest = ""  # a `;` after the last call
        self._consumed = self._buffer = ""
        self._state = _State.TEXT
        return Parsed(self.show(rest))
