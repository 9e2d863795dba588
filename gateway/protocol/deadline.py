"""The clock of one request: the point in time its whole answer must be done by,
handed down to the fleet (retries stop when it passes) and to the worker (as
the gRPC deadline)."""

from __future__ import annotations

import time


class Deadline:
    """A point in time a whole answer must be done by."""

    __slots__ = ("at",)

    def __init__(self, seconds: float) -> None:
        self.at = time.monotonic() + seconds

    def remaining(self) -> float:
        """Seconds left, never below zero."""
        return max(0.0, self.at - time.monotonic())
