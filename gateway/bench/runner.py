"""Sends a workload: each request at its arrival time, at most `max_concurrency`
in flight (a request due while all are busy waits for one to finish, and its
clock starts when it is sent). `--concurrency N` is an infinite rate with N in
flight: a closed loop of N clients.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from gateway.bench.client import OpenAIClient, Recorder, Result, Tally
from gateway.bench.workload import ENDPOINTS, Request


async def run(
    client: OpenAIClient,
    requests: Sequence[Request],
    arrivals: Sequence[float],
    endpoint: str,
    stream: bool,
    max_concurrency: int | None,
    tally: Tally,
) -> list[Result]:
    """Every request's result, in the order of `requests`."""
    loop = asyncio.get_running_loop()
    path = ENDPOINTS[endpoint]
    slots = asyncio.Semaphore(max_concurrency or len(requests) or 1)
    results: list[Result | None] = [None] * len(requests)
    tasks: set[asyncio.Task[None]] = set()

    async def one(index: int) -> None:
        try:
            recorder = Recorder(stream, tally)
            request = requests[index]
            results[index] = await client.post(path, request.body, recorder, request.priority)
        finally:
            slots.release()

    start = loop.time()
    try:
        for index, due in enumerate(arrivals):
            delay = start + due - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await slots.acquire()
            task = loop.create_task(one(index))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        while tasks:
            await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    answered = [result for result in results if result is not None]
    assert len(answered) == len(requests)
    return answered
