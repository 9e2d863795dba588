"""Which available worker takes a request.

`LeastOutstanding` picks the less loaded of two random workers (power of two
choices): nearly as good as scanning all, without every gateway herding onto
the same least-loaded worker. `PrefixAffinity` sends prompts that share a
prefix to the same worker, so its KV cache is reused, by consistent hashing
with bounded loads: a worker already above `load_factor` times the average
passes the request on along the ring.

Both are handed the pool's `Roster` (the same list until a worker changes) and read
from it what they would otherwise count over every worker on every pick (the weights,
the calls in flight, whether the ring is still right): a pick costs the same at 10
workers or 1,000. Any other list (a retry's, less the workers tried) is counted.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import math
import random
from collections.abc import Iterable
from functools import cached_property
from typing import Protocol

from gateway.fleet.worker import Worker
from gateway.protocol.types import GenerateRequest

VIRTUAL_NODES = 64  # ring points per unit of weight


class Roster(list[Worker]):
    """The workers available now, as `ModelPool.available` keeps them between changes
    (never changed in place: a change makes a new one), with `outstanding`, the sum of
    their calls in flight, which the pool keeps up to date as each call starts and ends."""

    def __init__(self, workers: Iterable[Worker]) -> None:
        super().__init__(workers)
        self.members = set(self)
        self.outstanding = sum(w.outstanding for w in self)

    @cached_property
    def by_address(self) -> dict[str, Worker]:
        """Them by address (made once, for the router's holders)."""
        return {w.address: w for w in self}

    @cached_property
    def cum_weights(self) -> list[float] | None:
        """Their weights cumulated for `random.choices` (`cum_weights`: made once, not
        on every pick), or None when they weigh the same."""
        return _cum_weights(self)


def outstanding(workers: list[Worker]) -> int:
    """Their calls in flight: kept by a `Roster`, else counted."""
    if isinstance(workers, Roster):
        return workers.outstanding
    return sum(w.outstanding for w in workers)


def _cum_weights(workers: list[Worker]) -> list[float] | None:
    first = workers[0].weight
    if all(w.weight == first for w in workers):
        return None
    return list(itertools.accumulate(w.weight for w in workers))


class Balancer(Protocol):
    """Picks one of the candidates (never empty) for a request."""

    def pick(self, candidates: list[Worker], request: GenerateRequest) -> Worker:
        """The worker to try."""
        ...


class LeastOutstanding:
    """Power of two choices on outstanding calls per unit of weight."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, candidates: list[Worker], request: GenerateRequest) -> Worker:
        """The less loaded of two weighted random candidates."""
        return self.pick_any(candidates)

    def pick_any(self, candidates: list[Worker]) -> Worker:
        """As `pick`, for a call with no request to look at (a unary call)."""
        if len(candidates) == 1:
            return candidates[0]
        if isinstance(candidates, Roster):
            cum_weights = candidates.cum_weights
        else:
            cum_weights = _cum_weights(candidates)
        if cum_weights is None:
            a, b = self._rng.sample(candidates, 2)
        else:
            a, b = self._rng.choices(candidates, cum_weights=cum_weights, k=2)
        return a if a.outstanding / a.weight <= b.outstanding / b.weight else b


def stable_hash(key: str) -> int:
    """64 bits of `key`, the same in every process (Python's own `hash` of a string is
    salted per process)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


def prefix_key(request: GenerateRequest, chars: int) -> str:
    """The start of the prompt as the worker will see it (roles included)."""
    if request.messages is None:
        return (request.prompt or "")[:chars]
    parts: list[str] = []
    size = 0
    for message in request.messages:
        parts.append(f"{message.role}\x00{message.content}\x00")
        size += len(parts[-1])
        if size >= chars:
            break
    return "".join(parts)[:chars]


class PrefixAffinity:
    """Consistent hashing of the prompt's prefix, with bounded loads."""

    def __init__(self, prefix_chars: int = 256, load_factor: float = 1.25) -> None:
        self.prefix_chars = prefix_chars
        self.load_factor = load_factor
        self._members: tuple[Worker, ...] = ()
        self._roster: Roster | None = None  # the roster the ring was last checked for
        self._points: list[int] = []
        self._owners: list[Worker] = []

    def _ring(self, candidates: list[Worker]) -> None:
        if candidates is self._roster:
            return
        self._roster = candidates if isinstance(candidates, Roster) else None
        members = tuple(candidates)
        if members == self._members:
            return
        ring = sorted(
            (stable_hash(f"{w.address}#{i}"), w)
            for w in members
            for i in range(max(1, round(VIRTUAL_NODES * w.weight)))
        )
        self._members = members
        self._points = [point for point, _ in ring]
        self._owners = [owner for _, owner in ring]

    def pick(self, candidates: list[Worker], request: GenerateRequest) -> Worker:
        """The prefix's worker on the ring, or the next one under the load bound."""
        if len(candidates) == 1:
            return candidates[0]
        self._ring(candidates)
        total = outstanding(candidates) + 1
        bound = math.ceil(self.load_factor * total / len(candidates))
        start = bisect.bisect(self._points, stable_hash(prefix_key(request, self.prefix_chars)))
        n = len(self._owners)
        for i in range(n):
            owner = self._owners[(start + i) % n]
            if owner.outstanding + 1 <= bound:
                return owner
        return min(candidates, key=lambda w: w.outstanding)
