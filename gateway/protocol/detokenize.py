"""Incremental detokenization, as vLLM and TGI do it: decode a short window of
the ids (from `prefix_offset`) twice, with and without the newest ids, and
release the difference. Byte-level tokenizers split multi-byte characters across
tokens; while the window's text ends in U+FFFD (an incomplete character) nothing
is released, so no piece ever holds half a character; a window, not just the new
ids, keeps tokenizers that drop a word's leading space at the start of a decode
(SentencePiece) from losing spaces.

Cost: two decodes of a few tokens per step, whatever the answer's length (the
window moves forward each time text is released). It takes any decode function, so
the gateway (over a `tokenizers` Tokenizer, `gateway.tokenization`) and the worker
SDK (over a transformers tokenizer) share it: both may import the protocol.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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
