"""Incremental detokenization for the upstreams that tokenize in the gateway.
`IncrementalDetokenizer` (the window scheme of vLLM and TGI, over any decode function)
lives in `gateway.protocol.detokenize`, so the worker SDK's transformers engine uses the
same one.

`StreamDetokenizer` does the same in Rust (`tokenizers`' DecodeStream, which keeps the
window itself): 1.5-2.0 µs a token against this one's 5.3-5.5 µs, measured on the tiny
test tokenizer over 2,440 tokens fed one at a time (process CPU, a loaded 2-core VM);
the upstreams that hold a `ModelTokenizer` use it (`ModelTokenizer.detokenizer`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from functools import partial

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from gateway.protocol.detokenize import REPLACEMENT, IncrementalDetokenizer

__all__ = ["REPLACEMENT", "IncrementalDetokenizer", "StreamDetokenizer"]

log = logging.getLogger("furnace.detokenize")

#: How tokenizers' error for a DecodeStream whose text went back on itself begins: a
#: model's ids that decode to invalid UTF-8 (byte-fallback pieces) can make it.
INVALID_PREFIX = "Invalid prefix encountered"


class StreamDetokenizer:
    """`IncrementalDetokenizer`'s `feed` and `flush` over `tokenizers`' DecodeStream:
    the window is kept in Rust; the ids of a character still incomplete are kept here
    too, so that `flush` gives what decoding the whole answer would (U+FFFD). Several ids
    fed at once give the text they would one at a time, as vLLM's detokenizer steps them.

    `context`: ids the answer follows (the prompt's last ones, `ModelTokenizer.context`),
    decoded before the first id as vLLM primes its DecodeStream with the prompt: a decoder
    that drops the first token's leading space (SentencePiece's Metaspace, Llama-2's Strip)
    then keeps the answer's, as after the prompt it must. Never changed here (shared by a
    request's choices).

    `skip_special`: special tokens decode to nothing (as a request's default); False for
    a tool-call parser that reads its markers where a model's are special tokens (vLLM's
    hermes parser turns `skip_special_tokens` off so, for a request with tools)."""

    __slots__ = ("_held", "_last", "_skip", "_step", "_stream", "_tokenizer")

    def __init__(
        self, tokenizer: Tokenizer, context: list[int] | None = None, skip_special: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special)
        #: `DecodeStream.step` bound to the tokenizer: a token's one call, in C.
        self._step: Callable[[int], str | None] = partial(self._stream.step, tokenizer)
        self._held: list[int] = []  # ids fed since text was last released
        #: the ids of that text (at first the context): what to decode after; replaced,
        #: never changed in place
        self._last: list[int] = context or []

    def feed(self, ids: Sequence[int]) -> str:
        """The text the new ids complete ("" while a character is still incomplete)."""
        if len(ids) == 1:
            return self.feed_one(ids[0])
        if not ids:
            return ""
        batch = list(ids)  # the one copy: kept as the context of what follows
        try:
            text: str | None = self._stream.step(self._tokenizer, batch)
        except Exception as error:  # an id at a time, as vLLM steps them, starts again
            _invalid_prefix(error)
            return self._one_by_one(batch)
        if text is None or REPLACEMENT in text:
            # it ends in an incomplete character (those before it are out), or holds
            # bytes that are no character, where stepped an id at a time the stream may
            # have gone back on its text and started again
            return self._one_by_one(batch)
        if self._held:
            self._held += batch
            batch = self._held
        self._last, self._held = batch, []
        return text

    def feed_one(self, token: int) -> str:
        """`feed` of one id, the engine's usual message: DecodeStream takes it as an
        int (a one-id list costs it twice the time) and no list is copied."""
        try:
            text = self._step(token)
        except Exception as error:
            _invalid_prefix(error)
            text = self._again(token)
        if text is None:
            self._held.append(token)
            return ""
        held = self._held
        if held:  # the last piece of a character
            held.append(token)
            self._last, self._held = held, []
        else:  # the usual token: its own text
            self._last = [token]
        return text

    def _again(self, token: int) -> str | None:
        """`token`'s text from a stream started again, empty, as vLLM's detokenizer
        starts again where tokenizers' stream went back on its own text: what was held
        back (a character's first pieces) is lost, the answer goes on."""
        log.warning("the detokenizer's stream went back on its text: started again")
        self._stream = DecodeStream(skip_special_tokens=self._skip)
        self._step = partial(self._stream.step, self._tokenizer)
        self._held, self._last = [], []
        text: str | None = self._step(token)
        return text

    def _one_by_one(self, batch: list[int]) -> str:
        """`batch`, which ended in an incomplete character, as if fed an id at a time (as
        vLLM's detokenizer steps its DecodeStream): the text of the characters it completed
        before that one, else held back until the end and lost there when the answer ends
        in it. The stream, which took the batch whole, is made again from the released
        text's ids (its window) and steps the held ids and the batch one by one."""
        self._stream = DecodeStream(ids=self._last, skip_special_tokens=self._skip)
        self._step = partial(self._stream.step, self._tokenizer)
        held, self._held = self._held, []
        return "".join(map(self.feed_one, held + batch))

    def flush(self) -> str:
        """The text still held back (an incomplete character decodes as U+FFFD)."""
        if not self._held:
            return ""
        decode = self._tokenizer.decode
        before = decode(self._last, skip_special_tokens=self._skip)
        after = decode(self._last + self._held, skip_special_tokens=self._skip)
        self._last, self._held = [], []
        return after[len(before) :]


def _invalid_prefix(error: Exception) -> None:
    """Raises `error` again unless it is tokenizers' invalid-prefix error, which the
    detokenizer gets over by starting again."""
    if not str(error).startswith(INVALID_PREFIX):
        raise error
