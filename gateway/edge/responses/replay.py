"""A streamed background response's events, kept so that its client, and any client
that comes back (`GET /v1/responses/{id}?stream=true&starting_after=N`), reads them
from where it left: the SSE blocks the encoder writes, one a sequence number.

The run writes into its `EventLog` whether or not anyone reads (its client going away
stops nothing); followers read from a sequence number on, waking when a block comes,
with a keep-alive comment while none does. Bounds: at most `LOG_BYTES` of a run's
events are kept (the oldest dropped past it: a resume from before them is refused),
and an ended run's log stays `KEPT_AFTER` seconds, with at most `ENDED_BYTES` of
ended logs a process (the oldest dropped first), so finished streams cost bounded
memory however many a team makes. The log lives in the process that runs the
response; with `redis_url` a copy in Redis serves other replicas' resumes
(shared_events.py), without it their GET names the limit.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator
from itertools import islice

#: The most bytes of events kept for one run (its oldest dropped past it).
LOG_BYTES = 1024 * 1024
#: Seconds an ended run's events stay readable.
KEPT_AFTER = 300.0
#: The most bytes of ended runs' events a process keeps (the oldest dropped past it).
ENDED_BYTES = 64 * 1024 * 1024
#: The comment written while no event comes, as the generation route's streams write it.
KEEPALIVE = b": keep-alive\n\n"


class Dropped(Exception):
    """The events asked for are no longer kept."""


class EventLog:
    """One run's events, numbered from 0 (`first` is the oldest kept)."""

    def __init__(self, limit: int = LOG_BYTES) -> None:
        self.limit = limit
        self.events: deque[bytes] = deque()
        self.first = 0
        self.size = 0
        self.ended = False
        self._rest = b""  # a block not yet whole
        self._skip_created = True  # the run's own `response.created`: the log has ours
        self._changed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def next_seq(self) -> int:
        return self.first + len(self.events)

    def append(self, block: bytes) -> None:
        """One whole event, the next in sequence."""
        self.events.append(block)
        self.size += len(block)
        while self.size > self.limit and len(self.events) > 1:
            self.size -= len(self.events.popleft())
            self.first += 1
        self._wake()

    def feed(self, body: bytes) -> None:
        """What the run's encoder wrote: whole blocks kept, keep-alives dropped, and its
        `response.created` too (the log opens with the `queued` one)."""
        blocks = (self._rest + body).split(b"\n\n")
        self._rest = blocks.pop()
        for block in blocks:
            if not block.startswith(b"event: "):
                continue  # a keep-alive comment
            if self._skip_created:
                self._skip_created = False
                if block.startswith(b"event: response.created\n"):
                    continue
            self.append(block + b"\n\n")

    def end(self) -> None:
        self.ended = True
        self._wake()

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.get_running_loop().create_future()
        changed.set_result(None)

    async def follow(
        self, after: int, keepalive: float, gone: asyncio.Future[None] | None = None
    ) -> AsyncIterator[bytes]:
        """The events after sequence number `after` (-1: all) as they come, joined where
        several wait, until the run ends or `gone` is done; `Dropped` when the first of
        them is no longer kept."""
        seq = after + 1
        if seq < self.first:
            raise Dropped
        while True:
            if seq < self.first:  # a reader slower than the log's bound: cut off
                return
            if seq < self.next_seq:
                chunk = b"".join(islice(self.events, seq - self.first, None))
                seq = self.next_seq
                yield chunk
                continue
            if self.ended:
                return
            waits: set[asyncio.Future[None]] = {self._changed}
            if gone is not None:
                waits.add(gone)
            done, _ = await asyncio.wait(
                waits, timeout=keepalive, return_when=asyncio.FIRST_COMPLETED
            )
            if gone is not None and gone.done():
                return
            if not done:
                yield KEEPALIVE


class EndedLogs:
    """The ended runs' logs, by response id, each for `KEPT_AFTER` seconds, at most
    `ENDED_BYTES` in all."""

    def __init__(self) -> None:
        self.logs: OrderedDict[str, tuple[float, str, EventLog]] = OrderedDict()
        self.size = 0

    def add(self, response_id: str, team: str, log: EventLog) -> None:
        self.logs[response_id] = (time.monotonic() + KEPT_AFTER, team, log)
        self.size += log.size
        self._trim()

    def get(self, response_id: str) -> tuple[str, EventLog] | None:
        self._trim()
        found = self.logs.get(response_id)
        return None if found is None else (found[1], found[2])

    def _trim(self) -> None:
        now = time.monotonic()
        while self.logs:
            until, _, log = next(iter(self.logs.values()))
            if until > now and self.size <= ENDED_BYTES:
                return
            self.size -= log.size
            self.logs.popitem(last=False)
