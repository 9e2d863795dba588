"""What every tool-call parser shares: the pieces it returns, the bounds it keeps,
a scanner that finds where a JSON value ends in a growing buffer, and the check
that turns a parsed object into a call (or leaves it text).

A parser reads one choice's detokenized text as it streams and splits it into
text to show and tool-call pieces. It never shows half of a call: a call is
released whole once its JSON is complete and checks out (its name is one of the
request's tools, its arguments a JSON object), as its first piece (id and name,
no arguments) then its arguments as compact JSON text in pieces. A call that
does not check out (unknown function, JSON that does not parse) is shown as the
text it was, as vLLM's parsers return it as content. What a parser holds back is
bounded: at most a marker's length while text may begin one, plus one call's
JSON, which may not pass `MAX_CALL_CHARS` (an error, not memory growth).
"""

from __future__ import annotations

import abc
import json
import re
import secrets
from typing import Any, NamedTuple

from gateway.protocol import errors
from gateway.protocol.types import Tool

#: The most characters one call's JSON may take before it closes.
MAX_CALL_CHARS = 1 << 20
#: The most characters of arguments in one piece.
ARGUMENTS_PIECE = 64
#: The most whitespace held after a call, waiting to see whether text follows it.
MAX_WHITESPACE = 256


class CallPiece(NamedTuple):
    """A piece of tool call `call_index`: its first piece has the id and the name
    (and no arguments), the next ones more of the arguments' JSON text."""

    call_index: int
    id: str
    name: str
    arguments: str


class Parsed(NamedTuple):
    """What one `feed` or `finish` releases: text to show, then call pieces
    (within one feed, text that came after a call is shown ahead of it)."""

    text: str
    calls: tuple[CallPiece, ...] = ()


def new_call_id() -> str:
    """A call id as OpenAI writes them: "call_" and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


def compact(value: Any) -> str:
    """JSON text without spaces, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def too_long() -> errors.Failed:
    return errors.Failed(f"The model's tool call passed {MAX_CALL_CHARS} characters.")


def overlap(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (what must be
    held back while text may begin a marker)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


_IN_STRING = re.compile(r'["\\]')
_OUTSIDE = re.compile(r'["\[\]{}]')


class JsonEnd:
    """Finds where the JSON object or array that starts the text it is fed ends,
    fed piece by piece: each character is looked at once. It does not
    validate; `json.loads` does that once the value closed."""

    __slots__ = ("_depth", "_escape", "_in_string")

    def __init__(self) -> None:
        self._depth = 0
        self._in_string = False
        self._escape = False

    def feed(self, piece: str) -> int | None:
        """The index in `piece` just past the value's end; None while it is open."""
        pos = 0
        while pos < len(piece):
            if self._escape:
                self._escape = False
                pos += 1
                continue
            if self._in_string:
                found = _IN_STRING.search(piece, pos)
                if found is None:
                    return None
                pos = found.end()
                if found.group() == "\\":
                    self._escape = True
                else:
                    self._in_string = False
                continue
            found = _OUTSIDE.search(piece, pos)
            if found is None:
                return None
            pos = found.end()
            ch = found.group()
            if ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth <= 0:
                    return pos
        return None


class CallText:
    """One call's JSON text as it streams in, kept as pieces (joined once, when it
    closed, so a long call costs linear time), bounded by `MAX_CALL_CHARS`."""

    __slots__ = ("_pieces", "_size", "end")

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._size = 0
        self.end = JsonEnd()

    def add(self, piece: str) -> None:
        self._size += len(piece)
        if self._size > MAX_CALL_CHARS:
            raise too_long()
        self._pieces.append(piece)

    def take(self, last: str = "") -> str:
        """The whole text, with `last` after it; empties it."""
        self._pieces.append(last)
        text = "".join(self._pieces)
        self._pieces, self._size = [], 0
        return text

    def feed(self, piece: str) -> tuple[str, str] | None:
        """The value's whole text and what follows it in `piece`, once it closed;
        None while it is open (the piece is kept)."""
        end = self.end.feed(piece)
        if end is None:
            self.add(piece)
            return None
        return self.take(piece[:end]), piece[end:]


def parse_object(text: str) -> dict[str, Any] | None:
    """`text` as a JSON object; None when it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class ToolCallParser(abc.ABC):
    """One choice's text in, text and call pieces out. `feed` the text as it
    streams, then `finish` once the answer ended; `called` says whether any
    call was released (the choice's finish reason is then `tool_calls`).
    With `single` (`parallel_tool_calls` false) calls after the first are
    dropped, as vLLM's server drops them."""

    def __init__(self, tools: tuple[Tool, ...], *, single: bool = False) -> None:
        self._tools = {tool.name: tool for tool in tools}
        self._single = single
        self._calls = 0
        self._whitespace = ""

    @property
    def called(self) -> bool:
        return self._calls > 0

    @abc.abstractmethod
    def feed(self, text: str) -> Parsed:
        """What `text` (the next piece of the answer) releases."""

    @abc.abstractmethod
    def finish(self) -> Parsed:
        """What is still held once the answer ended."""

    def show(self, text: str) -> str:
        """Text to show of `text`. After a call, whitespace alone (the newlines a
        template writes between calls) waits for text that is not whitespace,
        and is dropped when another call or the end comes first."""
        if not self._calls or not text:
            return text
        self._whitespace += text
        if self._whitespace.isspace() and len(self._whitespace) <= MAX_WHITESPACE:
            return ""
        text, self._whitespace = self._whitespace, ""
        return text

    def call(self, obj: dict[str, Any] | None, keys: tuple[str, ...]) -> list[CallPiece] | None:
        """The pieces of a call written as `obj`: a known function's `name` and
        its arguments under the first of `keys` present (an object; absent: no
        arguments); None when `obj` is not such a call."""
        if obj is None or not isinstance(obj.get("name"), str) or obj["name"] not in self._tools:
            return None
        arguments: Any = {}
        for key in keys:
            if key in obj:
                arguments = obj[key]
                break
        if not isinstance(arguments, dict):
            return None
        return self.pieces(obj["name"], compact(arguments))

    def pieces(self, name: str, arguments: str) -> list[CallPiece]:
        """A new call's pieces: id and name first, then the arguments' text
        (none for a call past the first of a `single` parser)."""
        if self._single and self._calls:
            return []
        index = self._calls
        self._calls += 1
        self._whitespace = ""
        out = [CallPiece(index, new_call_id(), name, "")]
        for start in range(0, len(arguments), ARGUMENTS_PIECE):
            out.append(CallPiece(index, "", "", arguments[start : start + ARGUMENTS_PIECE]))
        return out
