"""What tenacity costs a request that needs no retry, to decide whether the fleet's retry
loop (`gateway.fleet.retry.with_retries`) may build its `AsyncRetrying` on every request.

Run: `.venv/bin/python -m benchmarks.bench_retry [--requests N]` (a few seconds).

Two loops around one try that succeeds at once: `plain` awaits it; `tenacity` builds an
`AsyncRetrying` with the fleet's stop and wait and runs the try in it. Each figure is
the time per request and the objects left in reference cycles per request (what the
cycle collector must find later), with the collector off during the run.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
from collections.abc import Awaitable, Callable

from tenacity import AsyncRetrying, stop_after_attempt, wait_random_exponential


async def _try() -> int:
    return 1


async def plain() -> int:
    return await _try()


async def tenacity() -> int:
    retrying = AsyncRetrying(
        stop=stop_after_attempt(3),
        wait=wait_random_exponential(multiplier=0.05, max=0.8),
        retry=lambda state: False,
        reraise=True,
    )
    async for attempt in retrying:
        with attempt:
            return await _try()
    raise AssertionError("unreachable")


async def measure(loop: Callable[[], Awaitable[int]], requests: int) -> tuple[float, float]:
    """Microseconds and cyclic objects per request."""
    gc.collect()
    gc.disable()
    try:
        start = time.perf_counter()
        for _ in range(requests):
            await loop()
        elapsed = time.perf_counter() - start
    finally:
        garbage = gc.collect()
        gc.enable()
    return elapsed / requests * 1e6, garbage / requests


async def main(requests: int) -> None:
    for loop in (plain, tenacity, plain, tenacity):  # twice: the second round is warm
        us, cyclic = await measure(loop, requests)
        print(f"{loop.__name__:>9}: {us:7.1f} us per request, {cyclic:4.1f} objects in cycles")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20_000)
    asyncio.run(main(parser.parse_args().requests))
