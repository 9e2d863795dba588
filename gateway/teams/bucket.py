"""A per-minute limit as a leaky bucket: usage drains at `limit` per minute.

This is how OpenAI describes its own limits ("resets" = back to full), and it
needs no windows: a team may spend its whole minute at once, then one more
request (or token) each `60 / limit` seconds. Charges made after the fact (the
tokens of an answer) may push usage past the limit; the team then waits until
it drains back. The Redis store keeps the same two numbers per bucket, with the
same arithmetic in Lua, so local and shared limits read alike.
"""

from __future__ import annotations

import math


class Bucket:
    """Usage of one per-minute limit: `used` as of `at` (monotonic seconds)."""

    __slots__ = ("at", "limit", "rate", "used")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.rate = limit / 60.0  # drained per second
        self.used = 0.0
        self.at = 0.0

    def level(self, now: float) -> float:
        """Usage left at `now`, once drained."""
        return max(0.0, self.used - (now - self.at) * self.rate)

    def set(self, used: float, now: float) -> None:
        """Usage as another store (Redis) measured it just now."""
        self.used = max(0.0, used)
        self.at = now

    def charge(self, amount: float, now: float) -> None:
        """Adds `amount` (a refund when negative) to the usage."""
        self.set(self.level(now) + amount, now)

    def wait(self, cost: float, now: float) -> float:
        """Seconds until `cost` more fits under the limit (0: it fits now)."""
        return max(0.0, (self.level(now) + cost - self.limit) / self.rate)

    def remaining(self, now: float) -> int:
        """Whole units still free now."""
        return max(0, math.floor(self.limit - self.level(now)))

    def reset(self, now: float) -> float:
        """Seconds until the bucket is empty again."""
        return self.level(now) / self.rate
