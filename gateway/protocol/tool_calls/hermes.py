"""The Hermes format (Hermes 2 Pro, Qwen 2.5 and Qwen 3): each call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, possibly several,
text around them. A `<tool_call>` left open when the answer ends is read up to
the end, as vLLM's hermes parser reads it. The markers must survive
detokenization: in Qwen's and Hermes' vocabularies they are added tokens that
are not special, so skipping special tokens keeps them.
"""

from __future__ import annotations

from gateway.protocol.tool_calls.base import (
    MAX_CALL_CHARS,
    CallPiece,
    Parsed,
    ToolCallParser,
    overlap,
    parse_object,
    too_long,
)
from gateway.protocol.types import Tool

START = "<tool_call>"
END = "</tool_call>"
#: The keys a call's arguments may come under.
KEYS = ("arguments", "parameters")


class HermesParser(ToolCallParser):
    """Text outside the markers is shown (all but an end that may begin
    `<tool_call>`); a call's JSON is held until `</tool_call>`."""

    def __init__(self, tools: tuple[Tool, ...]) -> None:
        super().__init__(tools)
        self._buffer = ""
        self._in_call = False
        self._searched = 0  # how far the call's buffer is known to hold no END

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        shown: list[str] = []
        calls: list[CallPiece] = []
        while True:
            if not self._in_call:
                at = self._buffer.find(START)
                if at < 0:
                    keep = overlap(self._buffer, START)
                    cut = len(self._buffer) - keep
                    shown.append(self.show(self._buffer[:cut]))
                    self._buffer = self._buffer[cut:]
                    break
                shown.append(self.show(self._buffer[:at]))
                self._buffer = self._buffer[at + len(START) :]
                self._in_call, self._searched = True, 0
                continue
            at = self._buffer.find(END, self._searched)
            if at < 0:
                if len(self._buffer) > MAX_CALL_CHARS:
                    raise too_long()
                self._searched = max(0, len(self._buffer) - len(END) + 1)
                break
            body, self._buffer = self._buffer[:at], self._buffer[at + len(END) :]
            self._in_call = False
            self._take(body, closed=True, shown=shown, calls=calls)
        return Parsed("".join(shown), tuple(calls))

    def finish(self) -> Parsed:
        shown: list[str] = []
        calls: list[CallPiece] = []
        if self._in_call:
            self._take(self._buffer, closed=False, shown=shown, calls=calls)
        else:
            shown.append(self.show(self._buffer))
        self._buffer, self._in_call = "", False
        return Parsed("".join(shown), tuple(calls))

    def _take(self, body: str, *, closed: bool, shown: list[str], calls: list[CallPiece]) -> None:
        pieces = self.call(parse_object(body), KEYS)
        if pieces is None:  # not a call of these tools: the text it was
            shown.append(self.show(START + body + (END if closed else "")))
        else:
            calls.extend(pieces)
