"""Runs one request against its worker in a task of its own, so the edge can wait
for events with an idle timeout and keep-alive ticks, stop at once when its
client leaves, and write every event that is ready in one send.

Reading in the edge's own task would not do: cancelling a pending gRPC read
cancels the call, so a read cannot be interrupted for a keep-alive. Here the
reader never waits on anything but the worker, and the edge waits on a future
that the reader, a timer or `cancel()` completes. Per event the cost is one list
append and, when the edge is waiting, one future.

The timer outlives the waits: each wait only moves the deadline (a later one
every time, as events keep coming), and the timer, when it fires early for an
earlier deadline, sets itself again for the current one. So a stream costs one
timer every keep-alive interval instead of one per token.

What is ready but not yet taken is bounded (`buffer_chars`, the characters of
its text): past the bound the reader stops reading from the worker's call until
the edge takes a batch, so a client that stops reading pushes back, through
gRPC's HTTP/2 flow control, on the worker (its sends wait) instead of growing
the gateway's memory by the whole answer.
Per event that costs one length addition and one comparison; a pause costs one
future.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Coroutine
from time import perf_counter
from typing import Any, ClassVar

from gateway.protocol import errors
from gateway.protocol.types import Event, Finished, Started, Text
from gateway.upstreams.base import UpstreamCall

log = logging.getLogger("furnace.edge")

#: Events a reader takes back to back (parsed from one read) before it lets the
#: other tasks run, while other requests are being read; and the gap between two
#: events, in seconds, that shows the reader waited (its turn ended).
TURN_EVENTS = 4
QUIET = 0.0001


class EventPump:
    """The events of one request, in batches of what is ready.

    `start` is the fleet's start of the call: it resolves to the `Started`
    event and the stream of the rest, or raises the refusal. The call ends
    with the `Finished` of each of its `choices`.
    """

    #: Pumps whose reader has not ended, in this process: a reader yields only to others.
    reading: ClassVar[int] = 0

    def __init__(
        self,
        start: Coroutine[Any, Any, tuple[Started, UpstreamCall]],
        buffer_chars: int = 1 << 20,
        choices: int = 1,
    ) -> None:
        self._unfinished = choices
        self._loop = asyncio.get_running_loop()
        self._start = start
        self._stream: UpstreamCall | None = None
        self._ready: list[Event] = []
        self.buffered = 0  # characters of text in `_ready`
        self._buffer_chars = buffer_chars
        self._taken: asyncio.Future[None] | None = None  # set when the edge takes a batch
        self._error: errors.EngineError | None = None
        self._ended = False
        self._waiter: asyncio.Future[None] | None = None
        self._last_event = self._loop.time()
        self._texted = False  # whether a batch with text went to the edge yet
        self._wake_at = math.inf  # when the current wait ends without an event
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf  # when `_timer` fires
        self._reading = True
        EventPump.reading += 1
        self._reader = self._loop.create_task(self._read())

    async def _read(self) -> None:
        try:
            first, self._stream = await self._start
            self._ready.append(first)
            self._last_event = self._loop.time()
            self._wake()
            in_turn = 0  # events read back to back, without waiting
            last = perf_counter()
            async for event in self._stream:
                now = perf_counter()
                if now - last > QUIET:  # it waited for this one: a new turn of the loop
                    in_turn = 0
                else:
                    in_turn += 1
                    if in_turn >= TURN_EVENTS and EventPump.reading > 1:
                        # Events parsed from one read, back to back: let the other
                        # streams and new requests run before going on.
                        in_turn = 0
                        await asyncio.sleep(0)
                        now = perf_counter()
                last = now
                if type(event) is Started:
                    failure = errors.Failed("The engine worker started the answer twice.")
                    self._stream.cancel(failure)
                    raise failure
                self._ready.append(event)
                self._last_event = self._loop.time()
                self._wake()
                if type(event) is Text:
                    self.buffered += len(event.text)
                    if self.buffered > self._buffer_chars:
                        # Full: read no more until the edge takes a batch.
                        taken = self._taken = self._loop.create_future()
                        await taken
                elif type(event) is Finished:
                    self._unfinished -= 1
                    if not self._unfinished:
                        self._stream.close()
                        return
            self._error = errors.Failed("The engine worker ended the stream without finishing.")
        except errors.EngineError as error:
            self._error = error
        except Exception:
            log.exception("reading from the engine worker failed")
            self._error = errors.Failed("The gateway failed while reading the worker's answer.")
        finally:
            self._stop_reading()
            self._ended = True
            self._wake()

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            EventPump.reading -= 1

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        fired_for, self._timer, self._timer_at = self._timer_at, None, math.inf
        if self._waiter is None:
            return  # the edge is busy; its next wait sets the timer again
        if fired_for >= self._wake_at:
            self._wake()
        else:  # set for an earlier wait; this one ends later
            self._arm(self._wake_at)

    async def next_batch(self, idle_timeout: float, tick: float | None = None) -> list[Event]:
        """The events ready now, waiting for at least one.

        Returns [] only when `tick` seconds pass without one (time for a
        keep-alive). Raises the stream's error once the events before it are
        returned (or if called again after `Finished`), or `Timeout` after
        `idle_timeout` seconds without an event (and cancels the call).
        """
        while not self._ready and not self._ended:
            now = self._loop.time()
            idle_at = self._last_event + idle_timeout
            if now >= idle_at:
                self.cancel()
                raise errors.Timeout(
                    f"The engine worker sent nothing for {idle_timeout:g} seconds."
                )
            wake_at = self._wake_at = idle_at if tick is None else min(idle_at, now + tick)
            if self._timer_at > wake_at:
                self._arm(wake_at)
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None
            woken_by_tick = not self._ready and not self._ended and self._loop.time() < idle_at
            if tick is not None and woken_by_tick:
                return []
            if self._ready and not self._ended and self._texted:
                # One more turn of the loop lets the reader add what the worker has
                # already sent, so the edge writes it in one send: under load, 1.0 ->
                # ~1.7 tokens per SSE chunk at 1 token per gRPC message (make bench).
                # Not before the first text: the first token goes out at once.
                await asyncio.sleep(0)
        if self._ready:
            batch, self._ready = self._ready, []
            if not self._texted:
                self._texted = any(type(event) is Text for event in batch)
            self.buffered = 0
            taken = self._taken
            if taken is not None and not taken.done():
                self._taken = None
                taken.set_result(None)
            return batch
        raise self._error or errors.Failed("The engine worker's stream is over.")

    @property
    def worker(self) -> str:
        """The address of the worker that took the request, once one did."""
        return self._stream.worker if self._stream is not None else ""

    def cancel(self, reason: errors.EngineError | None = None) -> None:
        """Cancels the worker's call; waiting in `next_batch` then raises `reason`."""
        if not self._ended:
            if self._stream is not None:
                self._stream.cancel()
            self._reader.cancel()
            self._ended = True
            self._error = reason or errors.Unavailable("The request was cancelled.")
        self._wake()

    async def aclose(self) -> None:
        """Cancels the call if still running and waits for the reader to finish.

        Then drops the stream's error: raised through `next_batch`, its traceback
        holds this pump (and the edge's frames), so keeping it would leave the
        whole request (tasks, transport, gRPC call) to the cyclic garbage
        collector, whose pauses stall every stream."""
        self.cancel()
        self._stop_reading()  # a reader cancelled before it ran has no `finally`
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        try:
            await self._reader
        except asyncio.CancelledError:
            if not self._reader.cancelled():
                raise
        finally:
            self._start.close()  # never started if cancelled at once; else a no-op
            self._error = None
