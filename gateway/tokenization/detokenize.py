"""Incremental detokenization, as vLLM and TGI do it: decode a short window of
the ids (from `prefix_offset`) twice, with and without the newest ids, and
release the difference. Byte-level tokenizers split multi-byte characters across
tokens; while the window's text ends in U+FFFD (an incomplete character) nothing
is released, so no piece ever holds half a character.

Cost: two decodes of a few tokens per step, whatever the answer's length (the
window moves forward each time text is released).

`StreamDetokenizer` does the same in Rust (`tokenizers`' DecodeStream, which keeps the
window itself): 1.5-2.0 µs a token against this one's 5.3-5.5 µs, measured on the tiny
test tokenizer over 2,440 tokens fed one at a time (process CPU, a loaded 2-core VM);
the upstreams that hold a `ModelTokenizer` use it (`ModelTokenizer.detokenizer`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

#: What byte-level decoders produce for an incomplete UTF-8 sequence.
REPLACEMENT = "\ufffd"

Decode = Callable[[Sequence[int]], str]


class IncrementalDetokenizer:
    """Feed ids as they come (`feed`); `flush` what is held back once the answer ended."""

    __slots__ = ("_decode", "_ids", "_prefix_offset", "_read_offset")

    def __init__(self, decode: Decode) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def feed(self, ids: Sequence[int]) -> str:
        """The text the new ids complete ("" while a character is still incomplete)."""
        if not ids:
            return ""
        self._ids.extend(ids)
        return self._release(final=False)

    def flush(self) -> str:
        """The text still held back (an incomplete character decodes as U+FFFD, as
        decoding the whole answer at once would)."""
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        ids = self._ids
        prefix = self._decode(ids[self._prefix_offset : self._read_offset])
        text = self._decode(ids[self._prefix_offset :])
        if len(text) <= len(prefix) or (text.endswith(REPLACEMENT) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(ids)
        return text[len(prefix) :]


class StreamDetokenizer:
    """`IncrementalDetokenizer`'s `feed` and `flush` over `tokenizers`' DecodeStream:
    the window is kept in Rust; the ids of a character still incomplete are kept here
    too, so that `flush` gives what decoding the whole answer would (U+FFFD)."""

    __slots__ = ("_held", "_last", "_stream", "_tokenizer")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self._held: list[int] = []  # ids fed since text was last released
        self._last: list[int] = []  # the ids of that text: the context to decode after

    def feed(self, ids: Sequence[int]) -> str:
        """The text the new ids complete ("" while a character is still incomplete)."""
        if not ids:
            return ""
        batch = list(ids)
        text: str | None = self._stream.step(self._tokenizer, batch)
        if text is None:
            self._held += batch
            return ""
        self._last, self._held = self._held + batch, []
        return text

    def flush(self) -> str:
        """The text still held back (an incomplete character decodes as U+FFFD)."""
        if not self._held:
            return ""
        decode = self._tokenizer.decode
        before = decode(self._last, skip_special_tokens=True)
        after = decode(self._last + self._held, skip_special_tokens=True)
        self._last, self._held = [], []
        return after[len(before) :]
