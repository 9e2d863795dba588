"""Runs one request against its worker apart from the edge's writing, so the edge
can wait for events with an idle timeout and keep-alive ticks, stop at once when
its client leaves, and write every event that is ready in one send.

The start (the fleet picking a worker and waiting for its `Started`) runs in the
edge's own task, inside its first `next_batch`: the edge has nothing else to do
meanwhile, and a task of its own would begin a turn of the loop later, then hand
the first events over in one more. Under 32 busy streams a turn of the loop takes
about a millisecond, so each hand-over is a millisecond on the time to first token.
`cancel()` during the start cancels that wait (the task is uncancelled, and the
edge sees the reason, as a write guard's timeout does).

After the start, the events come one of two ways:

- A call that pushes (`Pushing`: the raw HTTP upstream parses each network read in
  the transport's callback, as the furnace multiplex and vLLM's gRPC streams read on
  the loop do each message) gets a listener: the events of a read go to the edge in
  that same callback, without a task in between. Per read that is one call.
- Any other call (a grpc.aio stream) is read by a task of its own. Reading in the edge's task
  would not do: cancelling a pending gRPC read cancels the call, so a read cannot
  be interrupted for a keep-alive. That reader never waits on anything but the
  worker, and the edge waits on a future that the reader, a timer or `cancel()`
  completes. Per event the cost is one list append and, when the edge is waiting,
  one future.

The timer outlives the waits: each wait only moves the deadline (a later one
every time, as events keep coming), and the timer, when it fires early for an
earlier deadline, sets itself again for the current one. So a stream costs one
timer every keep-alive interval instead of one per token.

What is ready but not yet taken is bounded (`buffer_chars`, its `event_size`:
text, logprobs and tool-call arguments, not text alone): past the bound the pump
takes no more from the worker's call until the edge takes a batch, so a client
that stops reading pushes back on the worker (through gRPC's HTTP/2 flow control,
or the upstream connection's paused reading) instead of growing the gateway's
memory by the whole answer.
Per event that costs one length addition and one comparison; a pause costs one
future.

A stream may ask for its tokens in chunks of at least `interval` (vLLM's per-request
`stream_interval`): the first text still goes at once, then what comes is held until each
choice with tokens ready has that many, or anything but tokens comes (an end, an error), or the
buffer is full, or a keep-alive tick falls due; a batch taken so is ordered by choice, so
each choice's tokens make one chunk. At the default of 1 this costs one comparison an
event.

A pump's life is one `Phase` (new → starting → streaming ⇄ full → ended → closed),
each phase only ever moving to a later one but for streaming and full, which alternate
as the buffer fills and the edge takes it. How the events come is the call's own kind:
a pushing call is kept as the one the pump listens to, a reader task otherwise. When a
stream is paced, it waits for the loop's next write turn, which turns.py keeps for every
stream of the process: the event that ends the edge's wait puts its waiter in the turn
(`_arrived`), so the edge wakes once per write, at the turn, rather than once for the
event and again for the turn (each wake resumes the request's whole chain of coroutines).
A stream is paced only while its events come faster than the turns (`_hot`): behind an
engine that takes longer than a turn for each token the turn would merge nothing, and a
timer that wakes the idle loop costs more than the write it delays.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
from collections.abc import Callable, Coroutine
from time import perf_counter
from typing import Any, ClassVar, Protocol, cast

from gateway.admission.turns import PACE, write_turns
from gateway.protocol import errors
from gateway.protocol.sizes import event_size
from gateway.protocol.types import Event, Finished, Reasoning, Started, Text, ToolCallDelta
from gateway.upstreams.base import UpstreamCall

log = logging.getLogger("furnace.admission")

#: Events a reader takes back to back (parsed from one read) before it lets the
#: other tasks run, while other requests are being read; and the gap between two
#: events, in seconds, that shows the reader waited (its turn ended).
TURN_EVENTS = 4
QUIET = 0.0001


class Phase(enum.IntEnum):
    """Where a pump is in its life; each phase only ever moves to a later one, but
    STREAMING and FULL alternate."""

    NEW = 0  # the start has not run
    STARTING = 1  # the start runs, in the task of the first `next_batch`
    STREAMING = 2  # started: a reader task or the pushing call brings the events
    FULL = 3  # past `buffer_chars`: the call keeps its events until the edge takes a batch
    ENDED = 4  # no more events: the last `Finished`, an error, or `cancel()` (during the
    # start too: `cancel()` then cancels the start's task, which takes that back)
    CLOSED = 5  # `aclose()` ran


class Pushing(Protocol):
    """A worker call that says when it has events, so no task need wait on it."""

    def listen(self, listener: Callable[[], None] | None) -> bool:
        """Calls `listener` whenever events may be ready or the call ended (None: stop);
        False where this call cannot push after all (it is read by a task then)."""

    def poll(self) -> Event | None:
        """The next event ready, or None while there is none; raises the call's
        error, or StopAsyncIteration at its end, as `__anext__` would."""


class Draining(Protocol):
    """A pushing call that can also hand over a run of plain texts in one call."""

    def drain(self, ready: list[Event], room: int) -> int:
        """Appends to `ready` the `Text`s (no logprobs) it has ready, until their
        characters pass `room` or another event is next (`poll` gives that); their
        characters."""


class EventPump:
    """The events of one request, in batches of what is ready.

    `start` is the fleet's start of the call: it resolves to the `Started`
    event and the call that brings the rest, or raises the refusal; it runs in the
    task of the first `next_batch`. The call ends with the `Finished` of each of
    its `choices`.
    """

    #: Pumps whose reader task has not ended, in this process: a reader yields only to
    #: others.
    reading: ClassVar[int] = 0
    #: Pumps not closed yet, in this process: a stream is paced only among others.
    live: ClassVar[int] = 0

    # A new pump's state, as class attributes: a pump sets on itself only what it
    # changes (every request makes one, and most of these keep their first value).
    phase = Phase.NEW
    _starting: asyncio.Task[Any] | None = None  # the task running the start, meanwhile
    _call: UpstreamCall | None = None
    _pushing: Pushing | None = None  # the call, when it pushes: no reader task
    #: A pushing call's `Draining.drain`, where it has one.
    _drain: Callable[[list[Event], int], int] | None = None
    _reader: asyncio.Task[None] | None = None
    buffered = 0  # `event_size` of what `_ready` holds
    _taken: asyncio.Future[None] | None = None  # set when the edge takes a batch
    _error: errors.GatewayError | None = None
    _waiter: asyncio.Future[None] | None = None
    _texted = False  # whether a batch with text went to the edge yet
    _wake_at = math.inf  # when the current wait ends without an event
    _timer: asyncio.TimerHandle | None = None
    _timer_at = math.inf  # when `_timer` fires
    _idle_timeout = math.inf  # the current wait's (the first one bounds the start)
    _reading = False  # counted in `EventPump.reading`
    _paced = False  # the edge's waiter waits for the next write turn
    _waiting_since = 0.0  # when the edge's current wait began
    _tick: float | None = None  # the current wait's keep-alive tick
    #: The edge's writer for events pushed while it waits (see `_deliver`): takes a
    #: batch and says whether it wrote it; None: the edge's task is woken instead.
    sink: Callable[[list[Event]], bool] | None = None
    #: The fewest tokens of a choice the edge is given at once after its first text
    #: (vLLM's `stream_interval`; see the module's docstring).
    interval = 1

    def __init__(
        self,
        start: Coroutine[Any, Any, tuple[Started, UpstreamCall]],
        buffer_chars: int = 1 << 20,
        choices: int = 1,
    ) -> None:
        self._unfinished = choices
        self._loop = asyncio.get_running_loop()
        self._start = start
        self._ready: list[Event] = []
        self._buffer_chars = buffer_chars
        self._last_event = self._loop.time()
        EventPump.live += 1

    async def _begin(self, idle_timeout: float) -> None:
        """Runs the start in this task, for at most `idle_timeout` seconds, then has
        the rest of the call read."""
        self.phase = Phase.STARTING
        self._idle_timeout = idle_timeout
        idle_at = self._wake_at = self._last_event + idle_timeout
        self._arm(idle_at)  # past it, `_on_timer` cancels the start
        task = self._starting = asyncio.current_task(self._loop)
        assert task is not None
        try:
            first, call = await self._start
        except asyncio.CancelledError:
            if not self._uncancel(task) or task.cancelling():
                raise  # not (only) ours: the task itself is being cancelled
            return  # `cancel()` ended the pump with its reason
        except errors.GatewayError as error:
            self._uncancel(task)
            self._end(error)
            return
        except Exception:
            self._uncancel(task)
            log.exception("starting the engine worker's call failed")
            self._end(errors.Failed("The gateway failed while starting the worker's call."))
            return
        finally:
            self._starting = None
        self._call = call
        if self._uncancel(task):  # cancelled as it returned: the call is to stop
            call.cancel()
            return
        self.phase = Phase.STREAMING
        self._ready.append(first)
        self._last_event = self._loop.time()
        listen = getattr(call, "listen", None)  # `Pushing` (isinstance: ~3-6 us)
        if listen is not None and listen(self._pushed):
            self._pushing = cast(Pushing, call)
            self._drain = getattr(call, "drain", None)
            self._pushed()  # what came with the first event
        else:
            self._reading = True
            EventPump.reading += 1
            self._reader = self._loop.create_task(self._read(call))

    def _uncancel(self, task: asyncio.Task[Any]) -> bool:
        """Takes back the cancellation `cancel()` asked of the start's task (which the
        start turned into its own error, or had not seen yet); whether it had. Only
        `cancel()` ends a pump while it starts, and it cancels the start's task then."""
        if self.phase >= Phase.ENDED:
            task.uncancel()
            return True
        return False

    def _accept(self, event: Event) -> bool:
        """Takes one event of the call; True once it was the last `Finished`."""
        kind = type(event)
        if kind is Started:
            failure = errors.Failed("The engine worker started the answer twice.")
            assert self._call is not None
            self._call.cancel(failure)
            raise failure
        self._ready.append(event)
        self._last_event = self._loop.time()
        if kind is Text or kind is ToolCallDelta or kind is Reasoning:
            self.buffered += event_size(event)  # logprobs and arguments count too
        elif kind is Finished:
            self._unfinished -= 1
            if not self._unfinished:
                assert self._call is not None
                self._call.close()
                return True
        return False

    def _pushed(self) -> None:
        """The pushing call's listener: takes what it has ready, up to the bound."""
        pushing = self._pushing
        if self.phase >= Phase.ENDED or pushing is None:
            return
        poll, ready, limit = pushing.poll, self._ready, self._buffer_chars
        drain = self._drain
        took = False
        try:
            while True:
                if self.buffered > limit:
                    self.phase = Phase.FULL  # the rest waits in the call (which stops reading)
                    break
                if drain is not None:
                    added = drain(ready, limit - self.buffered)
                    if added:
                        took = True
                        self.buffered += added
                        if self.buffered > limit:
                            continue
                event = poll()
                if event is None:
                    break
                took = True
                if type(event) is Text and not event.logprobs:  # `_accept`'s usual event
                    ready.append(event)
                    self.buffered += len(event.text)
                elif self._accept(event):
                    self._end(None)
                    return
            now = self._loop.time()
            if took:  # one callback: the time of its last event is that of each
                self._last_event = now
            if ready:
                self._deliver(now)
        except StopAsyncIteration:
            self._end(errors.Failed("The engine worker ended the stream without finishing."))
        except errors.GatewayError as error:
            self._end(error)
        except Exception:
            self._broke()

    def _deliver(self, now: float) -> None:
        """Pushed events are ready (at `now`, the loop's time): while the edge waits for
        them, its `sink` writes them here, in the callback that brought them, and the
        edge's task sleeps on (waking the task and its chain of coroutines cost a paced
        token a fifth of its CPU over HTTP); else, or when the sink cannot, the edge is
        woken (`_arrived`). Not while paced (`_hot`: the write turns merge those) nor
        full."""
        sink, waiter = self.sink, self._waiter
        if waiter is None:  # the edge is busy: it takes them when it next waits
            return
        if self.interval > 1 and not self._due():
            return
        if (
            sink is not None
            and not waiter.done()
            and not self._paced
            and self.phase is Phase.STREAMING
            and now - self._waiting_since >= PACE  # not `_hot()`
            and sink(self._ready)
        ):
            self._ready = []
            self.buffered = 0
            self._texted = True  # a sink writes texts alone
            # the wait goes on as if the edge had written and waited again
            self._waiting_since = now
            idle_at = self._last_event + self._idle_timeout
            self._wake_at = idle_at if self._tick is None else min(idle_at, now + self._tick)
            return
        self._arrived()

    async def _read(self, call: UpstreamCall) -> None:
        """The reader task of a call that does not push."""
        try:
            in_turn = 0  # events read back to back, without waiting
            last = perf_counter()
            async for event in call:
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
                if self._accept(event):
                    self._end(None)
                    return
                self._arrived()
                if self.buffered > self._buffer_chars:
                    # Full: read no more until the edge takes a batch (which it now may,
                    # were its events held for an `interval`).
                    self.phase = Phase.FULL
                    if self.interval > 1:
                        self._arrived()
                    taken = self._taken = self._loop.create_future()
                    await taken
            failure: errors.GatewayError = errors.Failed(
                "The engine worker ended the stream without finishing."
            )
        except errors.GatewayError as error:
            failure = error
        except Exception:
            failure = self._broke()
        finally:
            self._stop_reading()
        self._end(failure)

    def _broke(self) -> errors.GatewayError:
        """Reading the call failed in the gateway itself (a bug): logged, the pump
        ended, and the call stopped, so that the worker hears it rather than
        generating on to the deadline."""
        log.exception("reading from the engine worker failed")
        failure = errors.Failed("The gateway failed while reading the worker's answer.")
        self._end(failure)  # first: the call's end wakes a pushing call's listener
        if self._call is not None:
            self._call.cancel(failure)
        return failure

    def _end(self, error: errors.GatewayError | None) -> None:
        """No more events: `error` (if any) comes after those ready."""
        if self.phase < Phase.ENDED:
            self._error = error
            self.phase = Phase.ENDED
        self._wake()

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            EventPump.reading -= 1

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _arrived(self) -> None:
        """An event is ready: the waiting edge wakes at once, or, when its stream is
        paced (it wrote its first text, other streams are open), at the next write
        turn, and then writes at once: one wake of the edge per write, not two."""
        waiter = self._waiter
        if waiter is None or waiter.done() or self._paced:
            return
        if self.interval > 1 and not self._due():
            return
        if self._texted and EventPump.live > 1 and self._hot():
            self._paced = True
            write_turns(self._loop).add(waiter)
        else:
            waiter.set_result(None)

    def _hot(self) -> bool:
        """Whether this event came within `PACE` of the edge's wait: the worker sends
        faster than a write turn, so waiting for the turn merges writes. After a longer
        wait (an engine's step per token) the turn would merge nothing and only cost a
        wake-up of the loop, which on a VM is most of a paced token's CPU."""
        return self._loop.time() - self._waiting_since < PACE

    def _due(self) -> bool:
        """Whether what is ready goes to the edge now, for a stream asking `interval`
        tokens at once: before its first text, at an end or once full, when an event
        other than tokens is ready, or when each choice with tokens ready has
        `interval` of them (an engine steps a request's choices together)."""
        if not self._texted or self.phase is not Phase.STREAMING:
            return True
        held: dict[int, int] = {}
        for event in self._ready:
            kind = type(event)
            if kind is not Text and kind is not Reasoning and kind is not ToolCallDelta:
                return True
            piece = cast(Text | Reasoning | ToolCallDelta, event)
            held[piece.index] = held.get(piece.index, 0) + piece.tokens
        return min(held.values(), default=0) >= self.interval

    def _arm(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self._loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        fired_for, self._timer, self._timer_at = self._timer_at, None, math.inf
        starting = self._starting is not None
        if self._waiter is None and not starting:
            return  # the edge is busy; its next wait sets the timer again
        if fired_for < self._wake_at:  # set for an earlier wait; this one ends later
            self._arm(self._wake_at)
        elif starting:
            seconds = self._idle_timeout
            self.cancel(errors.Timeout(f"The engine worker sent nothing for {seconds:g} seconds."))
        else:
            self._wake()

    async def start(self, idle_timeout: float) -> None:
        """Starts the call now, if `next_batch` has not: returns once it has started or
        failed (its failure is `next_batch`'s to raise). What the edge needs only for the
        answer is then built while the engine works on the request, not before its call
        is written."""
        if self.phase is Phase.NEW:
            await self._begin(idle_timeout)

    async def next_batch(self, idle_timeout: float, tick: float | None = None) -> list[Event]:
        """The events ready now, waiting for at least one.

        Returns [] only when `tick` seconds pass without one (time for a
        keep-alive). Raises the call's error once the events before it are
        returned (or if called again after `Finished`), or `Timeout` after
        `idle_timeout` seconds without an event (and cancels the call).
        """
        if self.phase is Phase.NEW:
            await self._begin(idle_timeout)
        while not (self._ready and (self.interval == 1 or self._due())):
            if self.phase >= Phase.ENDED:
                break
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
            self._waiting_since = now
            self._idle_timeout, self._tick = idle_timeout, tick
            try:
                await waiter
            finally:
                self._waiter = None
                paced, self._paced = self._paced, False
            idle_at = self._last_event + idle_timeout  # later, if a sink wrote meanwhile
            woken_by_tick = (
                not (self._ready and (self.interval == 1 or self._due()))
                and self.phase < Phase.ENDED
                and self._loop.time() < idle_at
            )
            if tick is not None and woken_by_tick:
                if self._ready:  # tokens held for `interval`: they go instead of a comment
                    break
                return []
            hot = self._texted and not paced and self._hot()
            if hot and self._ready and self.phase < Phase.ENDED:
                # Not before the first text: the first token goes out at once; nor
                # after a wait longer than a turn (`_hot`). Else, among other streams,
                # the next write turn (turns.py; `_arrived` mostly has the waiter woken
                # at it already); alone, one more turn of the loop lets the reader add
                # what the worker has already sent, so the edge writes it in one send
                # (1 token per gRPC message: 1.0 -> ~1.7 tokens per SSE chunk, make
                # bench).
                if EventPump.live > 1:
                    await write_turns(self._loop).next()
                else:
                    await asyncio.sleep(0)
        if self._ready:
            batch, self._ready = self._ready, []
            if self.interval > 1 and self._texted:  # each choice's tokens in one chunk
                batch.sort(key=_choice)
            if not self._texted:
                kinds = set(map(type, batch))
                self._texted = Text in kinds or Reasoning in kinds
            self.buffered = 0
            taken = self._taken
            if taken is not None and not taken.done():
                self._taken = None
                taken.set_result(None)
            if self.phase is Phase.FULL:
                self.phase = Phase.STREAMING
                self._pushed()  # what a pushing call kept while the pump was full
            return batch
        raise self._error or errors.Failed("The engine worker's stream is over.")

    @property
    def worker(self) -> str:
        """The address of the worker that took the request, once one did."""
        return self._call.worker if self._call is not None else ""

    def cancel(self, reason: errors.GatewayError | None = None) -> None:
        """Cancels the worker's call; waiting in `next_batch` then raises `reason`."""
        if self.phase < Phase.ENDED:
            self.phase = Phase.ENDED
            self._error = reason or errors.Unavailable("The request was cancelled.")
            if self._call is not None:
                self._call.cancel()
            if self._reader is not None:
                self._reader.cancel()
            if self._starting is not None:
                self._starting.cancel()
        self._wake()

    async def aclose(self) -> None:
        """Cancels the call if still running and waits for its reader to finish.

        Then drops the stream's error: raised through `next_batch`, its traceback
        holds this pump (and the edge's frames), so keeping it would leave the
        whole request (tasks, transport, gRPC call) to the cyclic garbage
        collector, whose pauses stall every stream. A pushing call lets go of
        its listener, which holds this pump, for the same reason."""
        self.cancel()
        self._stop_reading()  # a reader cancelled before it ran has no `finally`
        if self.phase is not Phase.CLOSED:
            self.phase = Phase.CLOSED
            EventPump.live -= 1
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._pushing is not None:
            self._pushing.listen(None)
        reader = self._reader
        try:
            if reader is not None:
                await reader
        except asyncio.CancelledError:
            if reader is None or not reader.cancelled():
                raise
        finally:
            self._start.close()  # never started if cancelled at once; else a no-op
            self._error = None


def _choice(event: Event) -> int:
    """The choice an event is of, `Started` first (a batch sorted by it keeps each
    choice's order)."""
    return -1 if type(event) is Started else cast(Text, event).index
