"""An asyncio event loop on a virtual clock: timers tested exactly, without real waits."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any


class _ClockSelector(selectors.DefaultSelector):
    """Polls without blocking; where the loop would sleep, moves its clock instead."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualClockLoop | None = None

    def select(self, timeout: float | None = None) -> list:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # nothing scheduled: only another thread can wake it
            return super().select(None)
        assert self.loop is not None
        self.loop.now += timeout  # to the next timer, at once
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """A loop whose `time()` stands still while callbacks run and jumps to the
    next timer when nothing is ready, so waits take no real time and every
    duration is exact (use binary fractions, e.g. 0.125, to keep sums exact)."""

    def __init__(self) -> None:
        self.now = 0.0
        selector = _ClockSelector()
        super().__init__(selector)
        selector.loop = self

    def time(self) -> float:
        return self.now


def run_virtual(coro: Coroutine[Any, Any, Any]) -> Any:
    """Runs `coro` to the end on a fresh virtual-clock loop."""
    loop = VirtualClockLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
