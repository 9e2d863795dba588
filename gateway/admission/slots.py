"""The concurrency slots every route shares.

There is no queue: a request that finds every slot taken is refused at once, so
clients back off (and a load balancer can try another gateway) instead of
piling up behind a deadline they will miss.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from gateway.protocol.errors import Busy


class Slots:
    """A fixed number of slots; `hold()` takes one for the body of a `with`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_use = 0
        self._idle: asyncio.Event | None = None

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Takes a slot or raises `Busy`; the slot comes back on every exit path."""
        if self.in_use >= self.limit:
            raise Busy(
                f"The server is at its limit of {self.limit} concurrent requests.",
                reason="slots_full",
            )
        self.in_use += 1
        try:
            yield
        finally:
            self.in_use -= 1
            if self.in_use == 0 and self._idle is not None:
                self._idle.set()

    async def wait_idle(self) -> None:
        """Returns once no slot is taken."""
        if self.in_use:
            self._idle = asyncio.Event()
            await self._idle.wait()
