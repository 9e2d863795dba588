"""The concurrency slots every route shares.

By default there is no queue: a request that finds every slot taken is refused
at once, so clients back off (and a load balancer can try another gateway)
instead of piling up behind a deadline they will miss. With `queue` configured
(queue.py), a slot that comes back goes to the head of the queue.
"""

from __future__ import annotations

import asyncio
import math
from typing import Protocol

from gateway.protocol.errors import Busy, Refusal


def low_cap(limit: int, headroom: float) -> int:
    """The slots in use below which a request of a priority below 0 may take one: all but
    the `headroom` share of `limit` (`low_priority_headroom`), at least one."""
    return math.ceil(limit * (1 - headroom))


class Waiters(Protocol):
    """What the slots need of the queue (queue.py) that waits for them, declared here so
    that the queue depends on the slots and not both ways."""

    def dispatch(self) -> None:
        """Gives the slots free now to the waiters first in line."""

    def waiting(self, model: str | None = None) -> int:
        """Requests waiting (for `model`, or all)."""

    def refuse_all(self, error: Refusal) -> None:
        """Ends every wait with `error`."""


class Slots:
    """A fixed number of slots; `hold()` takes one for the body of a `with`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0
        self._idle: asyncio.Event | None = None
        #: The requests waiting for a slot, when a queue is configured.
        self.queue: Waiters | None = None

    def hold(self) -> Slots:
        """Takes a slot or raises `Busy`, on entering the `with`; the slot comes back
        on every exit path. (The slots are their own context manager, a plain one: a
        hold keeps no state of its own, so a request makes no object for it.)"""
        return self

    def __enter__(self) -> None:
        if self.in_use >= self.limit:
            raise Busy(
                f"The server is at its limit of {self.limit} concurrent requests.",
                reason="slots_full",
            )
        self.in_use += 1

    def __exit__(self, *exc: object) -> None:
        self.release()

    def release(self) -> None:
        """Gives a slot back: to the queue's head if one waits."""
        self.in_use -= 1
        if self.queue is not None:
            self.queue.dispatch()
        if self.in_use == 0 and self._idle is not None:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Returns once no slot is taken."""
        if self.in_use:
            self._idle = asyncio.Event()
            await self._idle.wait()
