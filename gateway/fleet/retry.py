"""Retries: the one loop that tries a call again on another worker, for streamed and
unary calls alike (`with_retries`), and the retry budget that bounds them.

The loop retries what its caller's rule accepts while attempts (`retry_attempts`), the
deadline, workers not yet tried and the budget last, with tenacity's jittered
exponential back-off between tries (none for unary calls: the next try goes to another
worker). Most requests need no retry, so tenacity's `AsyncRetrying` is built only when
the first try failed and is retried: one per request costs about 0.1 ms and 31 objects
in reference cycles for the collector (`python benchmarks/bench_retry.py`).

The budget, like Envoy's and Finagle's: over a sliding window, retries may reach
`ratio` times the requests, plus a small floor so a quiet gateway can retry; a sick
fleet is not hit twice as hard by the gateway's own retries.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from tenacity import AsyncRetrying, stop_after_attempt, wait_none, wait_random_exponential

from gateway.protocol import errors
from gateway.protocol.deadline import Deadline

if TYPE_CHECKING:
    from gateway.fleet import Fleet
    from gateway.fleet.pool import ModelPool
    from gateway.fleet.worker import Worker

log = logging.getLogger("furnace.fleet")

T = TypeVar("T")

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
        buckets = self._buckets
        if buckets and buckets[-1][0] == now:
            return buckets[-1]  # this second's: none expired since it was made
        while buckets and buckets[0][0] <= now - self.window:
            buckets.popleft()
        buckets.append([now, 0, 0])
        return buckets[-1]

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


async def with_retries(
    fleet: Fleet,
    pool: ModelPool,
    deadline: Deadline,
    attempt: Callable[[set[Worker]], Awaitable[T]],
    retry: Callable[[errors.GatewayError], bool],
    backoff: float,
) -> T:
    """`attempt` (on a worker of `pool` not in `tried`, which it adds) until it returns, or
    fails with an error `retry` refuses, or attempts, time, workers or the budget run out;
    the last error is raised. `backoff` seconds scale the jittered waits (0: none)."""
    fleet.budget.record_request()
    tried: set[Worker] = set()
    attempts = fleet.config.retry_attempts

    def again(error: BaseException | None, tries: int) -> bool:
        go = (
            isinstance(error, errors.GatewayError)
            and tries < attempts
            and retry(error)
            and deadline.remaining() > 0
            and bool(pool.available(tried))
            and fleet.budget.try_spend()
        )
        if go:
            pool.retries_total += 1
            log.info("model %s: retrying after %s", pool.name, type(error).__name__)
        return go

    try:
        return await attempt(tried)
    except errors.GatewayError as error:
        if not again(error, 1):
            raise
    if backoff > 0:
        await asyncio.sleep(random.uniform(0, backoff))
    retrying = AsyncRetrying(
        stop=stop_after_attempt(attempts - 1),
        wait=wait_random_exponential(multiplier=backoff, max=backoff * 16)
        if backoff > 0
        else wait_none(),
        retry=lambda state: again(
            state.outcome.exception() if state.outcome else None, 1 + state.attempt_number
        ),
        reraise=True,
    )
    async for trying in retrying:
        with trying:
            return await attempt(tried)
    raise AssertionError("unreachable: tenacity re-raises the last error")
