"""Stop strings over a stream of text pieces, in linear time.

A stop string may straddle two pieces, so the text that could be the start of
one is held back until the next piece settles it. What is released never holds
a stop string; the stop string itself is never released; the answer ends at
the first place a stop string is complete.

The strings are matched with one Aho-Corasick automaton: each character moves
it one state (amortized), and its state is the longest end of the text so far
that begins a stop string, which is exactly what must be held back. So the cost
is linear in the text and in the stop strings' total length, whatever they are
(a hostile request cannot make a worker's event loop quadratic).
"""

from __future__ import annotations


class _Automaton:
    """The trie of the stop strings with failure links (Aho-Corasick)."""

    __slots__ = ("depth", "fail", "goto", "match")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        #: The length of the longest stop string ending at each state (0: none).
        self.match = [0]
        for stop in stops:
            state = 0
            for ch in stop:
                nxt = self.goto[state].get(ch)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto.append({})
                    self.depth.append(self.depth[state] + 1)
                    self.match.append(0)
                    self.goto[state][ch] = nxt
                state = nxt
            self.match[state] = len(stop)
        self.fail = [0] * len(self.goto)
        frontier = list(self.goto[0].values())
        while frontier:  # breadth first: a state's failure is shallower than it
            following = []
            for state in frontier:
                for ch, nxt in self.goto[state].items():
                    self.fail[nxt] = self.step(self.fail[state], ch) if state else 0
                    self.match[nxt] = max(self.match[nxt], self.match[self.fail[nxt]])
                    following.append(nxt)
            frontier = following

    def step(self, state: int, ch: str) -> int:
        """The state after `ch`."""
        goto, fail = self.goto, self.fail
        while state and ch not in goto[state]:
            state = fail[state]
        return goto[state].get(ch, 0)


class StopMatcher:
    """Feeds text through; says when a stop string appeared (released with the text
    before it where `include`: vLLM's `include_stop_str_in_output`)."""

    __slots__ = ("_automaton", "_held", "_include", "_state", "end", "matched")

    def __init__(self, stops: tuple[str, ...], include: bool = False) -> None:
        stops = tuple(filter(None, stops))  # the empty strings dropped
        self._automaton = _Automaton(stops) if stops else None
        self._include = include
        self._state = 0
        self._held = ""
        #: The stop string that matched ("" until one does).
        self.matched = ""
        #: The characters of the last text fed up to the matched stop string's end: where
        #: in that piece the answer was complete (vLLM counts the tokens up to there).
        self.end = 0

    @property
    def active(self) -> bool:
        """Whether there is a stop string to match."""
        return self._automaton is not None

    def feed(self, text: str) -> tuple[str, bool]:
        """The text safe to release, and whether a stop string matched."""
        automaton = self._automaton
        if automaton is None:
            return text, False
        step, match = automaton.step, automaton.match
        state = self._state
        for i, ch in enumerate(text):
            state = step(state, ch)
            if match[state]:
                seen = self._held + text[: i + 1]
                self._held, self._state, self.end = "", 0, i + 1
                self.matched = seen[len(seen) - match[state] :]
                return (seen if self._include else seen[: len(seen) - match[state]]), True
        self._state = state
        seen = self._held + text
        keep = automaton.depth[state]
        self._held = seen[len(seen) - keep :] if keep else ""
        return seen[: len(seen) - keep], False

    def flush(self) -> str:
        """The held-back text, once the answer ended without a stop."""
        held, self._held, self._state = self._held, "", 0
        return held
