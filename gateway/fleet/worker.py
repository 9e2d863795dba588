"""One worker as the fleet sees it: its calls in flight, its health, and passive
ejection when it keeps failing.

Only transport failures count against a worker (unreachable, internal errors,
deadlines): a client's mistake (a bad parameter, a prompt too long) says
nothing about the worker, and a full worker is busy, not broken. A call that
carries many requests (the multiplexed one) counts once when it breaks: its
other requests end `SHARED_FAILURE`, which counts for nothing here, so one
broken call cannot eject a worker by the number of requests it carried.

A worker tells its `watcher` (its pool) when one of the `WATCHED` fields takes a
new value, wherever it is set (health checks, discovery, ejection, each call): the
pool keeps who is available, their calls in flight and what they serve between
changes, instead of a loop over the fleet on every request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.protocol import errors
from gateway.upstreams.base import CANCELLED, CallEnd, Upstream

log = logging.getLogger("furnace.fleet")

#: Errors that count against a worker.
TRANSPORT_FAILURES = (errors.Unavailable, errors.Failed, errors.Timeout)

#: What `Worker.available` reads, its calls in flight and what it serves.
WATCHED = frozenset({"serving", "leaving", "misfit", "ejected_until", "outstanding", "features"})


@dataclass(frozen=True)
class EjectionPolicy:
    """When a worker leaves the rotation after failures, and for how long."""

    after_failures: int = 3
    base: float = 1.0
    longest: float = 60.0


@dataclass(eq=False)
class Worker:
    """A worker of one model."""

    address: str
    upstream: Upstream
    policy: EjectionPolicy
    weight: float = 1.0
    #: Calls in flight through this gateway.
    outstanding: int = 0
    #: From the health service; None until it has answered.
    serving: bool | None = None
    #: Removed from discovery; finishing its calls, taking no new ones.
    leaving: bool = False
    #: Why it does not fit where the config puts it, from its describe (`fit`: it serves
    #: another model, has no KV connector, is an engine its server does not run); None:
    #: it fits, or has not said.
    misfit: str | None = None
    #: Requests it says it can run at once (Describe); None: it does not say.
    capacity: int | None = None
    #: Its own count of the requests it runs, every client's (Describe, refreshed every
    #: health interval), and whether it says it is full.
    reported_load: int = 0
    full: bool = False
    #: What it serves beyond plain generation (Describe); None until described.
    features: frozenset[str] | None = None
    #: The LoRA adapters it serves (its `/models` beside its model, or loaded there by
    #: this gateway: `adapters.AdapterPool`).
    adapters: frozenset[str] = frozenset()
    consecutive_failures: int = 0
    #: Ejections in a row (the back-off grows with them); 0 once it succeeds.
    ejection_streak: int = 0
    #: Every ejection since start, for metrics.
    ejections_total: int = 0
    ejected_until: float = 0.0
    #: Called with (worker, field, old value) when a `WATCHED` field changes; declared
    #: last, so that `__init__` (and `dataclasses.replace`) sets the others unwatched.
    watcher: Callable[[Worker, str, object], None] | None = field(default=None, repr=False)

    def __setattr__(self, name: str, value: object) -> None:
        watcher = self.watcher
        if watcher is None or name not in WATCHED:
            object.__setattr__(self, name, value)
            return
        old = getattr(self, name)
        object.__setattr__(self, name, value)
        if old != value:
            watcher(self, name, old)

    def count_call(self, step: int) -> None:
        """One call more in flight (`step` 1) or fewer (-1): as `__setattr__` does for
        any watched field, without its look-ups, as every call starts and ends here."""
        old = self.outstanding
        object.__setattr__(self, "outstanding", old + step)
        watcher = self.watcher
        if watcher is not None:
            watcher(self, "outstanding", old)

    def available(self, now: float) -> bool:
        """Whether it may take a new request now (unknown health counts as serving)."""
        return (
            self.serving is not False
            and not self.leaving
            and self.misfit is None
            and now >= self.ejected_until
        )

    @property
    def state(self) -> str:
        """One word for operators and metrics."""
        if self.misfit is not None:
            return self.misfit
        if self.leaving:
            return "leaving"
        if time.monotonic() < self.ejected_until:
            return "ejected"
        if self.serving is False:
            return "not_serving"
        return "healthy" if self.serving else "unknown"

    def release(self, outcome: CallEnd) -> None:
        """Called once when one of its calls ends, however it ends."""
        self.count_call(-1)
        if outcome is None:  # each write runs `__setattr__`: only those that change
            if self.consecutive_failures:
                self.consecutive_failures = 0
            if self.ejection_streak:
                self.ejection_streak = 0
        elif outcome is not CANCELLED and isinstance(outcome, TRANSPORT_FAILURES):
            self.record_failure()

    def record_failure(self) -> None:
        """A transport failure; enough in a row eject the worker for a while."""
        self.consecutive_failures += 1
        if self.consecutive_failures < self.policy.after_failures:
            return
        self.consecutive_failures = 0
        self.ejection_streak += 1
        self.ejections_total += 1
        seconds = min(self.policy.longest, self.policy.base * 2 ** (self.ejection_streak - 1))
        self.ejected_until = time.monotonic() + seconds
        log.warning(
            "worker %s ejected for %g s: %d calls failed in a row",
            self.address,
            seconds,
            self.policy.after_failures,
        )
