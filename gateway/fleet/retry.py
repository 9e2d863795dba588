"""The retry budget: retries stay a bounded fraction of requests, so a sick fleet
is not hit twice as hard by the gateway's own retries.

Like Envoy's and Finagle's budgets: over a sliding window, retries may reach
`ratio` times the requests, plus a small floor so a quiet gateway can retry.
"""

from __future__ import annotations

import time
from collections import deque

WINDOW_SECONDS = 10
MIN_RETRIES_PER_WINDOW = 3


class RetryBudget:
    """Counts requests and retries in one-second buckets over the window."""

    def __init__(self, ratio: float, window: int = WINDOW_SECONDS) -> None:
        self.ratio = ratio
        self.window = window
        self._buckets: deque[list[int]] = deque()  # [second, requests, retries]

    def _bucket(self) -> list[int]:
        now = int(time.monotonic())
        while self._buckets and self._buckets[0][0] <= now - self.window:
            self._buckets.popleft()
        if not self._buckets or self._buckets[-1][0] != now:
            self._buckets.append([now, 0, 0])
        return self._buckets[-1]

    def record_request(self) -> None:
        """A request arrived (its first try)."""
        self._bucket()[1] += 1

    def try_spend(self) -> bool:
        """Takes one retry from the budget, if it has one."""
        bucket = self._bucket()
        requests = sum(b[1] for b in self._buckets)
        retries = sum(b[2] for b in self._buckets)
        if retries >= MIN_RETRIES_PER_WINDOW + self.ratio * requests:
            return False
        bucket[2] += 1
        return True
