"""The Hermes format (Hermes 2 Pro, Qwen 2.5 and Qwen 3): each call is
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, possibly several,
text around them. A `<tool_call>` left open when the answer ends is read up to
the end, as vLLM's hermes parser reads it. The markers must survive
detokenization: in Qwen's and Hermes' vocabularies they are added tokens that
are not special, so skipping special tokens keeps them.
"""

from __future__ import annotations

from gateway.protocol.tool_calls.base import (
    CallPiece,
    CallText,
    Parsed,
    ToolCallParser,
    overlap,
    parse_object,
)
from gateway.protocol.types import Tool

START = "<tool_call>"
END = "</tool_call>"
#: The keys a call's arguments may come under.
KEYS = ("arguments", "parameters")


class HermesParser(ToolCallParser):
    """Text outside the markers is shown (all but an end that may begin
    `<tool_call>`); a call's JSON is held until `</tool_call>`."""

    def __init__(self, tools: tuple[Tool, ...], *, single: bool = False) -> None:
        super().__init__(tools, single=single)
        self._held = ""  # text that may begin START
        self._call: CallText | None = None  # inside a call: its text so far
        self._tail = ""  # the call's last characters, which may begin END

    def feed(self, text: str) -> Parsed:
        shown: list[str] = []
        calls: list[CallPiece] = []
        while text:
            if self._call is None:
                text, self._held = self._held + text, ""
                if "<" not in text:  # the common case: plain text
                    shown.append(self.show(text))
                    break
                at = text.find(START)
                if at < 0:
                    cut = len(text) - overlap(text, START)
                    shown.append(self.show(text[:cut]))
                    self._held = text[cut:]
                    break
                shown.append(self.show(text[:at]))
                text = text[at + len(START) :]
                self._call, self._tail = CallText(), ""
                continue
            window = self._tail + text
            at = window.find(END)
            if at < 0:
                self._call.add(text)
                self._tail = window[-(len(END) - 1) :]
                break
            cut = at - len(self._tail)  # where END starts in `text` (< 0: in the tail)
            body = self._call.take(text[: max(cut, 0)])
            if cut < 0:
                body = body[:cut]
            text = text[cut + len(END) :]
            self._call = None
            self._take(body, closed=True, shown=shown, calls=calls)
        return Parsed("".join(shown), tuple(calls))

    def finish(self) -> Parsed:
        shown: list[str] = []
        calls: list[CallPiece] = []
        if self._call is not None:
            self._take(self._call.take(), closed=False, shown=shown, calls=calls)
        else:
            shown.append(self.show(self._held))
        self._held, self._call = "", None
        return Parsed("".join(shown), tuple(calls))

    def _take(self, body: str, *, closed: bool, shown: list[str], calls: list[CallPiece]) -> None:
        pieces = self.call(parse_object(body), KEYS)
        if pieces is None:  # not a call of these tools: the text it was
            shown.append(self.show(START + body + (END if closed else "")))
        else:
            calls.extend(pieces)
