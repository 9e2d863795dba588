"""The polls that the engines of one data-parallel vLLM OpenAI server share.

Each engine of such a server is a worker of its own (`gateway.fleet.data_parallel`),
with an upstream of its own, and each polls the server: `/health` every health interval,
`/v1/models` and `/metrics` at each describe, `/metrics` every `routing.load_interval`
for its load. What those GETs answer is the server's, the same for every engine (a
`/metrics` page holds every engine's samples), so N engines made N GETs of each an
interval. Here the engines of a server make one: a GET of a URL while another engine's
GET of it is out waits for that answer, and one answered less than `FRESH` seconds ago
is taken as it is. The engines' polls keep in step (they join together and wait their
intervals from the same answers), so they meet within milliseconds; polls that drift
apart (one engine's back-off) are each sent, as before.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from time import monotonic

#: A GET's answer: its status and (at most its limit of) its body.
Answer = tuple[int, bytes]

#: Seconds an answer stands for the other engines' polls of the same URL: a tenth of
#: the default load interval, so a load read is never older than that by sharing.
FRESH = 0.1


class _Poll:
    """One GET of a URL, sent for the engine that asked first: its answer, and when it
    came (infinity while it is out)."""

    __slots__ = ("answered_at", "task", "waiters")

    def __init__(self, send: Awaitable[Answer]) -> None:
        self.answered_at = math.inf
        self.waiters = 0  # the engines waiting for it
        self.task = asyncio.ensure_future(send)
        self.task.add_done_callback(self._answered)

    def _answered(self, task: asyncio.Future[Answer]) -> None:
        self.answered_at = monotonic()
        if not task.cancelled():
            task.exception()  # retrieved: the engines that asked raise it, if any still wait

    def stands(self) -> bool:
        """Whether it is out, or answered within `FRESH` seconds."""
        return monotonic() - self.answered_at < FRESH


class SharedPolls:
    """The GETs of one server's engines' polls, each URL's latest (a server's few poll
    URLs: bounded by them)."""

    def __init__(self) -> None:
        self._polls: dict[str, _Poll] = {}

    async def get(self, url: str, send: Callable[[], Awaitable[Answer]]) -> Answer:
        """The answer of a GET of `url` out or just answered for another engine; else
        of `send()`, sent now. An engine whose wait is cancelled leaves the GET to the
        others; the last one cancels it (their workers left, the gateway stops)."""
        poll = self._polls.get(url)
        if poll is None or not poll.stands():
            poll = self._polls[url] = _Poll(send())
        poll.waiters += 1
        try:
            return await asyncio.shield(poll.task)
        finally:
            poll.waiters -= 1
            if not poll.waiters and not poll.task.done():
                poll.task.cancel()
