"""A bounded wait for a slot, by priority and weighted share (off by default).

Without a queue a request that finds every slot taken is refused at once. With
one (`queue: {max_wait, max_depth}`), it waits instead, at most `max_wait`
seconds, among at most `max_depth` others of its model. A slot that comes back
goes straight to the head of the queue, ordered by

  (priority, higher first; the team's weighted virtual time; arrival)

where a team's virtual time advances by 1/weight per request queued (start-time
fair queuing), so within a priority teams get the freed slots in proportion to
their weights, and a lone team is served in arrival order. A waiter older than
its `max_starvation` is served next whatever its priority: low priorities wait
longer, never for ever. Nothing running is pre-empted.

A request may take a slot only while fewer than its `cap` are taken: a priority
below 0 (a batch line's) leaves the last `low_priority_headroom` of the slots to
the others (admit.py sets its cap), so it waits, even with slots free, while
they are in use, and a burst of interactive requests finds them free.

A request whose expected wait, (waiters ahead + 1) x the mean time a slot is
held / slots, is past `max_wait` is refused at once (503, `queue_wait`), not
after waiting; one that waits out `max_wait` gets 503 `queue_timeout`; a full
queue gives `queue_full`. A waiter whose client goes away leaves at once, and a
drain refuses every waiter. What left is taken out of the heap lazily, and the
heap is rebuilt once more than half of it has left (60,000 waiters gone had
stayed: 26 MiB, and 0.7 ms for each new arrival's count of those ahead).

Cost: a heap push and pop per queued request (O(log depth)) and an O(depth)
count of those ahead at arrival; a request that finds a free slot and nobody
waiting pays one comparison more than without a queue.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from gateway.admission.slots import Slots
from gateway.protocol import errors

#: Upper bounds (seconds) of the wait-time histogram.
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Upper bounds of the waits as shares of their queue's `max_wait`: exact near the
#: bound whatever `max_wait` is (a quantile of the seconds never passes 60), and one
#: alert threshold for models whose queues differ.
WAIT_RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
#: Weight of the newest sample in the mean time a slot is held.
_EWMA = 0.2


@dataclass(frozen=True)
class QueueSettings:
    """One model's queue: how long and how many may wait, and the starvation bound."""

    max_wait: float
    max_depth: int
    max_starvation: float


@dataclass(order=True)
class _Waiter:
    key: tuple[int, float, int]
    model: str = field(compare=False)
    #: The priority its metrics are counted under (`Queue.hold`'s `label`).
    label: int = field(compare=False)
    arrived: float = field(compare=False)
    settings: QueueSettings = field(compare=False)
    future: asyncio.Future[None] = field(compare=False)
    #: It takes a slot only while fewer than this many are in use.
    cap: int = field(default=0, compare=False)
    gone: bool = field(default=False, compare=False)


class WaitHistogram:
    """Cumulative-ready counts of waits for one (model, priority), in `bounds`."""

    def __init__(self, bounds: tuple[float, ...] = WAIT_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.total = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.total += 1
        self.sum += value
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                break


class Queue:
    """The waiters for the gateway's slots; `hold()` is `Slots.hold` with a wait."""

    def __init__(self, slots: Slots, clock: Callable[[], float] = time.monotonic) -> None:
        self.slots = slots
        self.clock = clock
        slots.queue = self
        self._heap: list[_Waiter] = []
        #: The waiters in arrival order (the starvation bound looks at the first).
        self._arrivals: dict[int, _Waiter] = {}
        self._seq = itertools.count()
        #: Each share's (team's) virtual finish time, and the clock of the last served.
        self._finish: dict[str, float] = {}
        self._virtual = 0.0
        #: The mean seconds a slot taken through the queue is held (None: not known yet).
        self.hold_seconds: float | None = None
        self.depth: Counter[tuple[str, int]] = Counter()
        self.admitted: Counter[tuple[str, int, str]] = Counter()
        self.refused: Counter[tuple[str, int, str]] = Counter()
        self.waits: dict[tuple[str, int], WaitHistogram] = {}
        #: The same waits, each over its queue's `max_wait`.
        self.wait_ratios: dict[tuple[str, int], WaitHistogram] = {}

    def waiting(self, model: str | None = None) -> int:
        """Requests waiting (for `model`, or all)."""
        if model is None:
            return len(self._arrivals)
        return sum(n for (m, _), n in self.depth.items() if m == model)

    @asynccontextmanager
    async def hold(
        self,
        model: str,
        settings: QueueSettings,
        priority: int = 0,
        share: str = "",
        weight: float = 1.0,
        gone: asyncio.Future[None] | None = None,
        label: int | None = None,
        cap: int | None = None,
    ) -> AsyncIterator[None]:
        """Holds a slot for the body of an `async with`, waiting for one if need be;
        raises `Busy` when it cannot be had within `max_wait`, `Draining` when a
        drain empties the queue. `priority` orders the wait; the metrics count it
        under `label` (default: the priority itself), so that a priority a client
        asks does not become a label of its own: the caller passes its team's
        configured priority. It takes a slot only while fewer than `cap` are in use
        (None: the limit)."""
        label = priority if label is None else label
        cap = self.slots.limit if cap is None else cap
        start = self.clock()
        if self.slots.in_use < cap and not self._arrivals:
            self.slots.in_use += 1
            how = "immediate"
        else:
            await self._wait(model, settings, priority, label, share, weight, gone, start, cap)
            how = "queued"
        self.admitted[model, label, how] += 1
        taken = self.clock()
        try:
            yield
        finally:
            held = self.clock() - taken
            mean = self.hold_seconds
            self.hold_seconds = held if mean is None else mean + _EWMA * (held - mean)
            self.slots.release()

    def _refuse(self, model: str, label: int, reason: str, message: str) -> errors.Busy:
        self.refused[model, label, reason] += 1
        return errors.Busy(message, reason=reason)

    async def _wait(
        self,
        model: str,
        settings: QueueSettings,
        priority: int,
        label: int,
        share: str,
        weight: float,
        gone: asyncio.Future[None] | None,
        start: float,
        cap: int,
    ) -> None:
        if self.waiting(model) >= settings.max_depth:
            raise self._refuse(
                model, label, "queue_full",
                f"The server is at its limit of {self.slots.limit} concurrent requests "
                f"and {settings.max_depth} waiting.",
            )  # fmt: skip
        tag = max(self._virtual, self._finish.get(share, 0.0))
        key = (-priority, tag, next(self._seq))
        if self.hold_seconds is not None:
            ahead = sum(1 for w in self._heap if not w.gone and w.key < key)
            expected = (ahead + 1) * self.hold_seconds / self.slots.limit
            if expected > settings.max_wait:
                raise self._refuse(
                    model, label, "queue_wait",
                    f"The server is at its limit of {self.slots.limit} concurrent requests; "
                    f"the expected wait ({expected:.1f}s) is longer than {settings.max_wait:g}s.",
                )  # fmt: skip
        self._finish[share] = tag + 1.0 / weight
        waiter = _Waiter(
            key, model, label, start, settings, asyncio.get_running_loop().create_future(), cap
        )
        heapq.heappush(self._heap, waiter)
        self._arrivals[key[2]] = waiter
        self.depth[model, label] += 1
        if self.slots.in_use < cap:  # a slot free, held back from those waiting by their caps
            self.dispatch()
        try:
            waits: set[asyncio.Future[None]] = {waiter.future}
            if gone is not None:
                waits.add(gone)
            await asyncio.wait(waits, timeout=settings.max_wait, return_when="FIRST_COMPLETED")
        except BaseException:  # cancelled: the slot it may have been handed goes back
            if waiter.gone and waiter.future.done() and waiter.future.exception() is None:
                self.slots.release()
            self._leave(waiter)
            raise
        if waiter.future.done() and waiter.future.exception() is None:
            self._observe(waiter)
            if gone is None or not gone.done():
                return
            self.slots.release()  # handed a slot as the client left: give it back
            raise self._refuse(model, label, "client_gone", "The client went away.")
        self._leave(waiter)
        if waiter.future.done():
            self._observe(waiter)
            raise waiter.future.exception()  # type: ignore[misc]
        if gone is not None and gone.done():
            raise self._refuse(model, label, "client_gone", "The client went away.")
        self._observe(waiter)
        raise self._refuse(
            model, label, "queue_timeout",
            f"No slot came free within {settings.max_wait:g}s.",
        )  # fmt: skip

    def _observe(self, waiter: _Waiter) -> None:
        key = (waiter.model, waiter.label)
        histogram = self.waits.get(key)
        if histogram is None:
            histogram = self.waits[key] = WaitHistogram()
            self.wait_ratios[key] = WaitHistogram(WAIT_RATIO_BUCKETS)
        waited = self.clock() - waiter.arrived
        histogram.observe(waited)
        self.wait_ratios[key].observe(waited / waiter.settings.max_wait)

    def _leave(self, waiter: _Waiter) -> None:
        """Takes a waiter out (lazily from the heap, at once from the counts)."""
        if waiter.gone:
            return
        waiter.gone = True
        del self._arrivals[waiter.key[2]]
        self.depth[waiter.model, waiter.label] -= 1
        if not self.depth[waiter.model, waiter.label]:
            del self.depth[waiter.model, waiter.label]
        heap = self._heap
        while heap and heap[0].gone:
            heapq.heappop(heap)
        if len(heap) > 2 * len(self._arrivals) + 16:
            # Most of the heap has left (cancelled, timed out, gone): rebuild it
            # from those still waiting, so the ones that left are not kept.
            self._heap = [w for w in heap if not w.gone]
            heapq.heapify(self._heap)

    def dispatch(self) -> None:
        """Hands free slots to the waiters at the head (called as a slot comes back)."""
        while self._arrivals and self.slots.in_use < self.slots.limit:
            oldest = next(iter(self._arrivals.values()))
            starved = self.clock() - oldest.arrived > oldest.settings.max_starvation
            if starved and self.slots.in_use < oldest.cap:
                waiter = oldest
            else:
                while self._heap[0].gone:
                    heapq.heappop(self._heap)
                waiter = self._heap[0]
                if self.slots.in_use >= waiter.cap:  # those behind it rank no higher
                    break
            waiter.gone = True
            del self._arrivals[waiter.key[2]]
            self.depth[waiter.model, waiter.label] -= 1
            if not self.depth[waiter.model, waiter.label]:
                del self.depth[waiter.model, waiter.label]
            self._virtual = max(self._virtual, waiter.key[1])
            self.slots.in_use += 1
            waiter.future.set_result(None)
        while self._heap and self._heap[0].gone:
            heapq.heappop(self._heap)

    def refuse_all(self, error: errors.Refusal) -> None:
        """Ends every wait with `error` (a drain)."""
        for waiter in list(self._arrivals.values()):
            waiter.gone = True
            self.depth[waiter.model, waiter.label] -= 1
            self.refused[waiter.model, waiter.label, error.reason or "draining"] += 1
            waiter.future.set_exception(error)
        self._arrivals.clear()
        self._heap.clear()
        self.depth.clear()
