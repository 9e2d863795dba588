"""The write turns of one event loop, shared by every stream of the process: a paced
stream waits for the next turn, and one timer ends it for all of them, `TURN_STREAMS`
streams in each turn of the loop.

A write to a socket is the largest cost per token (a system call that runs the
loopback's TCP stack), and every turn of the loop that writes for many streams is a turn
that a new request's next step waits behind. Paced, the streams write larger batches,
once every `PACE`, `TURN_STREAMS` in each turn of the loop; the turns of the loop are
short, and a new request's steps (its first text is never paced) go between them. The
cost: up to `PACE` more between two of a busy stream's writes; one timer, and one future
per stream per turn, as the turn of the loop it replaces cost, and a callback per
`TURN_STREAMS` streams. The event pump (pump.py) decides when a stream is paced.
"""

from __future__ import annotations

import asyncio
import weakref

#: While other requests are open, a stream that has sent its first text writes what
#: came since its last write once per this many seconds, in the same turn of the loop
#: as every other such stream.
PACE = 0.001
#: Streams that write in one turn of the loop, in a write turn.
TURN_STREAMS = 1


class WriteTurns:
    """The write turns of one event loop (see the module's docstring)."""

    __slots__ = ("_loop", "_waiting")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._waiting: list[asyncio.Future[None]] = []

    def next(self) -> asyncio.Future[None]:
        """A future done at the next turn."""
        waiter: asyncio.Future[None] = self._loop.create_future()
        self.add(waiter)
        return waiter

    def add(self, waiter: asyncio.Future[None]) -> None:
        """Sets `waiter`'s result at the next turn (unless it is done by then)."""
        if not self._waiting:
            self._loop.call_later(PACE, self._end)
        self._waiting.append(waiter)

    def _end(self) -> None:
        waiting, self._waiting = self._waiting, []
        self._release(waiting, 0)

    def _release(self, waiting: list[asyncio.Future[None]], start: int) -> None:
        """Lets `TURN_STREAMS` of the turn's streams write, the next ones in the next
        turn of the loop: between them the loop reads its sockets and runs what that
        woke, so a new request's next step waits for one stream's write, not for all."""
        end = start + TURN_STREAMS
        for waiter in waiting[start:end]:
            if not waiter.done():  # not cancelled with its request
                waiter.set_result(None)
        if end < len(waiting):
            self._loop.call_soon(self._release, waiting, end)


_TURNS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, WriteTurns] = (
    weakref.WeakKeyDictionary()
)


def write_turns(loop: asyncio.AbstractEventLoop) -> WriteTurns:
    """The loop's write turns (made on first use)."""
    turns = _TURNS.get(loop)
    if turns is None:
        turns = _TURNS[loop] = WriteTurns(loop)
    return turns
