"""Waiting for a condition instead of sleeping, bounded by a generous hang guard."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

HANG_GUARD = 30.0  # seconds; only to fail instead of hanging


def wait_until(condition: Callable[[], bool], what: str, timeout: float = HANG_GUARD) -> None:
    """Polls `condition` until true; fails the test after `timeout` seconds."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


async def until(condition: Callable[[], bool], what: str) -> None:
    """`wait_until` on a running event loop: `condition` is looked at by a timer, so the
    loop goes on meanwhile; bounded by the hang guard."""
    loop = asyncio.get_running_loop()
    met: asyncio.Future[None] = loop.create_future()

    def look() -> None:
        if met.done():
            return
        if condition():
            met.set_result(None)
        else:
            loop.call_later(0.005, look)

    look()
    try:
        await asyncio.wait_for(met, HANG_GUARD)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None
