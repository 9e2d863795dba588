"""Stop strings over a stream of text pieces.

A stop string may straddle two pieces, so the text that could be the start of
one is held back until the next piece settles it. What is released never holds
a stop string; the stop string itself is never released.
"""

from __future__ import annotations


class StopMatcher:
    """Feeds text through; says when a stop string appeared."""

    __slots__ = ("_held", "_hold", "_stops")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """The text safe to release, and whether a stop string matched."""
        if not self._stops:
            return text, False
        text = self._held + text
        cut = min((i for i in (text.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self._held = ""
            return text[:cut], True
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """The held-back text, once the answer ended without a stop."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, text: str) -> int:
        """The length of the longest end of `text` that begins a stop string."""
        for n in range(min(self._hold, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0
