"""Waiting for a condition instead of sleeping, bounded by a generous hang guard."""

from __future__ import annotations

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
