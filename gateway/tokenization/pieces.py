"""A rendered chat's ids for routing, encoded piece by piece, reusing the pieces
recent prompts had (`ModelTokenizer.routing_ids`).

Why: kv_aware routing hashes a chat's blocks from its ids where the engines name
blocks by ids (vLLM's HTTP servers), and a conversation's next turn renders as its
last turn plus a little. Encoding all of it again cost about 1 µs of gateway CPU a
token (3 ms for a 3,500-token chat with the routing benchmark's tokenizer), nearly all
in the tokenizer's Rust encode (its pre-tokenizer's regex and allocations); rendering
the template cost about 1 %.

Why the ids are the same: `tokenizers` first cuts a text at its added tokens (a
template's `<|im_start|>`, `<|end|>`, ...), then normalizes, pre-tokenizes and encodes
each piece between them on its own. Cut at the same places, the text gives the same
ids piece by piece: each added token's id, each piece's ids, the pieces kept by their
text (a system prompt's document, the earlier turns) so that only new pieces are
encoded, in one batch call. The cut is the tokenizer's own where its added tokens are
matched on the raw text (`normalized` false; the others it matches inside the pieces
itself), leftmost longest as `tokenizers` matches them, without taking whitespace or
a word boundary around them (`lstrip`, `rstrip`, `single_word`); and where the
tokenizer truncates and pads nothing and cuts no piece differently for where it
starts (a `Metaspace` that prepends only at the text's start does): a probe at load
encodes a text both ways. A tokenizer that fails any of this is not `usable` and its
prompts are encoded whole.

Bounds: at most `MAX_TOKENS` token ids kept (least recently used dropped first), no
piece over `MAX_PIECE` of them, a text of more than `MAX_CUTS` added tokens encoded
whole; thread-safe (prompts are encoded off the event loop).
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from collections.abc import Sequence

from tokenizers import Tokenizer

#: Token ids kept over all pieces (about 40 bytes each as Python ints in tuples).
MAX_TOKENS = 1 << 18
#: A piece of more ids than this is encoded every time, not kept.
MAX_PIECE = 1 << 15
#: A text cut in more pieces than this is encoded whole: piece by piece, 100,000
#: pieces took 1.7 s against 0.5 s whole, most of it holding the GIL.
MAX_CUTS = 1024


class PieceCache:
    """One tokenizer's pieces of recent prompts and their ids; `ids` of a text."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        added = tokenizer.get_added_tokens_decoder()
        raw = {t.content: i for i, t in added.items() if not t.normalized and t.content}
        whitespace = any(
            t.lstrip or t.rstrip or t.single_word for t in added.values() if not t.normalized
        )
        #: Each added token matched on the raw text, by its text.
        self._added = raw
        # longest first at each position: leftmost longest, as tokenizers' matcher
        ordered = sorted(raw, key=len, reverse=True)
        self._split = re.compile("(" + "|".join(map(re.escape, ordered)) + ")") if raw else None
        self._pieces: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._kept = 0
        self._lock = threading.Lock()
        self.usable = (
            self._split is not None
            and not whitespace
            and tokenizer.truncation is None
            and tokenizer.padding is None
            and self._probe(ordered[:4])
        )

    def _probe(self, tokens: list[str]) -> bool:
        """Whether a text with `tokens` between pieces encodes the same both ways."""
        text = "".join(f"a b{t} c\n d é{t}" for t in tokens) + " 1"
        same = list(self._encode([text])[0]) == self.ids(text)
        self.clear()
        return same

    def clear(self) -> None:
        with self._lock:
            self._pieces.clear()
            self._kept = 0

    def _encode(self, texts: Sequence[str]) -> list[tuple[int, ...]]:
        # the batch call releases the GIL (ModelTokenizer.encode says why)
        batch = self._tokenizer.encode_batch_fast(list(texts), add_special_tokens=False)
        return [tuple(e.ids) for e in batch]

    def ids(self, text: str) -> list[int]:
        """The ids of `text` (added tokens as text, no special tokens added), as
        the tokenizer's encode of the whole text makes them when `usable`."""
        assert self._split is not None
        parts = self._split.split(text, MAX_CUTS + 1)  # piece, added token, ..., piece
        if len(parts) > 2 * MAX_CUTS + 1:
            return self._tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
        found: dict[str, tuple[int, ...]] = {}
        missing: dict[str, None] = {}  # in order, each once
        with self._lock:
            for piece in parts[0::2]:
                if piece in found or piece in missing or not piece:
                    continue
                ids = self._pieces.get(piece)
                if ids is None:
                    missing[piece] = None
                else:
                    self._pieces.move_to_end(piece)
                    found[piece] = ids
        if missing:
            encoded = dict(zip(missing, self._encode(list(missing)), strict=True))
            found.update(encoded)
            self._keep(encoded)
        out: list[int] = []
        added = self._added
        for i, part in enumerate(parts):
            if i % 2:
                out.append(added[part])
            elif part:
                out += found[part]
        return out

    def _keep(self, encoded: dict[str, tuple[int, ...]]) -> None:
        with self._lock:
            for piece, ids in encoded.items():
                if len(ids) <= MAX_PIECE and piece not in self._pieces:
                    self._pieces[piece] = ids
                    self._kept += len(ids)
            while self._kept > MAX_TOKENS:
                _, dropped = self._pieces.popitem(last=False)
                self._kept -= len(dropped)
