"""A bound on how long one write may wait on a client that stops reading.

uvicorn's httptools protocol makes `send` wait on its flow control while the
socket's buffers are full, so a client that stops reading (but keeps the
connection) would hold its slot, and the worker's call, forever. NGINX bounds
each write with `send_timeout` (60 s); the gateway does the same with
`write_timeout`, and then cancels the worker's call, frees the slot and closes
the connection.

A timeout per write (`asyncio.timeout`) would cost a timer per token; here one
timer per request watches every write: each `send` only notes when it began,
and the timer, when it fires, either finds the current write overdue, finds a
later write (and sets itself for that one's deadline), or finds none (and the
next write sets it again). Per write that is one clock read and two stores.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from gateway.edge.asgi import Message, Send


class WriteTimedOut(Exception):
    """A write waited longer than the write timeout on the client."""


class WriteGuard:
    """`send`, where a write that waits more than `timeout` seconds raises
    `WriteTimedOut` in the task that called it (the request's task)."""

    __slots__ = (
        "_abort",
        "_loop",
        "_send",
        "_since",
        "_task",
        "_timeout",
        "_timer",
        "timed_out",
    )

    def __init__(self, send: Send, timeout: float, abort: Callable[[], None] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task(self._loop)
        assert task is not None
        self._task = task
        self._send = send
        self._timeout = timeout
        #: Drops the connection at once: closing it would wait for the unread bytes.
        self._abort = abort
        self._since = math.inf  # when the write in progress began; inf when none
        self._timer: asyncio.TimerHandle | None = None
        self.timed_out = False

    async def __call__(self, message: Message) -> None:
        since = self._since = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_at(since + self._timeout, self._check)
        try:
            await self._send(message)
        except asyncio.CancelledError:
            if self.timed_out and self._task.uncancel() == 0:
                raise WriteTimedOut(
                    f"The client read nothing for {self._timeout:g} seconds."
                ) from None
            raise
        finally:
            self._since = math.inf

    def _check(self) -> None:
        self._timer = None
        if self._since == math.inf:
            return  # no write waiting; the next one sets the timer again
        due = self._since + self._timeout
        if self._loop.time() >= due:
            self.timed_out = True
            if self._abort is not None:
                self._abort()
            self._task.cancel()
        else:  # a later write than the one the timer was set for
            self._timer = self._loop.call_at(due, self._check)

    def close(self) -> None:
        """Stops watching (the request is over)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
