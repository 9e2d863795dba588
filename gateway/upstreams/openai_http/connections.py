"""Streamed completions to a plain http:// upstream (the in-cluster case), over the
upstream's own kept-alive HTTP/1.1 connections (`gateway.protocol.http1`: a pool of
asyncio protocols over httptools): `_RawCall` is the call reading one.

Why not httpx: its stack (httpcore, h11, three async generators) cost tens of
microseconds per SSE event, as every event is its own HTTP chunk. Here a network read
of many events is one callback: httptools undoes the chunking in C, `_Stream` cuts the
`data:` lines with one `split`, parses each once with orjson, and queues the events,
merging a choice's pieces that arrived together, so the reader gets fewer, larger
events and one wake-up per read; a reader that falls behind pauses the socket.
Measured against a fast fake engine, 32 streams on 2 loaded cores: tokens/s through
the gateway went from about 0.45 to 0.85 of direct, the added TTFT at 1 stream from
about 1.45 ms to 0.45 ms.

Among other open calls, a call whose every choice has had its first text and whose
data come less than `REST` apart rests its socket for `REST` after each read (reading
paused, then resumed by a timer): an engine sends a token per write, and a read per
token is a system call, a TCP acknowledgement and a turn of the loop each; rested, a
read takes what came in `REST`. 32 streams against the unpaced fake engine, 6 s of
steady load: the gateway's CPU per token 5.5 -> 3.5 us, tokens/s 158k -> 202k, TTFT
p50 between streams already running 2.4-3.0 -> 1.6-2.0 ms. An engine whose steps are
longer than `REST` (vLLM's: milliseconds) sends nothing during a rest, so resting its
streams would merge nothing and cost a timer, a pause and a resume a token, and wake
the loop once more for each: 8 streams paced at 2 ms, 4.1 -> 1.7 system calls and
0.63 -> 0.21 loop wake-ups a token. No choice's first text is rested on (a stream of
tool calls only never rests), and a call alone never rests.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from time import monotonic
from typing import ClassVar

from gateway.protocol import errors
from gateway.protocol.http1 import BAD_RESPONSE, Connection, Pool
from gateway.protocol.types import Event, Reasoning, Text
from gateway.upstreams.base import CANCELLED, HEAD_GRACE, CallEnd, StreamBookkeeping
from gateway.upstreams.openai_http.sse import _Stream
from gateway.upstreams.openai_http.translate import MAX_ERROR_BYTES, error_from_response

#: Reading pauses while more than this many events wait for the reader (with
#: `sse._MERGE_CHARS`: a reader that falls behind holds at most about 1 MiB of a stream).
_PAUSE_AT = 64
#: Seconds a call's socket rests after a read, among other open calls (as the
#: edge's write turns: `gateway.admission.turns.PACE`).
REST = 0.001


class _RawCall(StreamBookkeeping):
    """One streamed call over a pooled connection, the reader of its response
    (`gateway.protocol.http1.Reader`): the request is
    written whole; the response's body goes to `_Stream` as it arrives, and
    `__anext__` hands on what it made. Reading pauses while more than
    `_PAUSE_AT` events wait for the reader. `timeout` is the call's deadline.

    It also pushes (`gateway.admission.pump.Pushing`): once the call has started,
    a listener is told after each read, in the transport's callback, and takes the
    events with `poll`, so no task has to wait on the call."""

    #: Calls whose request went out, not over yet, in this process: a call rests
    #: its socket only among others.
    reading: ClassVar[int] = 0

    # A call's state as it starts, read from the class until the call sets its own:
    # set one by one in `__init__`, they were half the Python it ran.
    _opened = False  # the request was sent (once: a dropped call is not sent again)
    _connection: Connection | None = None
    _status = 0
    _error_size = 0
    _failure: errors.GatewayError | None = None
    _waiter: asyncio.Future[None] | None = None
    _listener: Callable[[], None] | None = None
    _deadline: asyncio.TimerHandle | None = None
    _grace: asyncio.TimerHandle | None = None  # armed by their 200 head
    _accepted = False  # their head said 200 and `HEAD_GRACE` passed
    _paused = False  # reading paused: too much waits for the reader
    _resting = False  # reading paused until the rest's timer
    _read_at = 0.0  # when it last read, or its rest ended (`monotonic`)
    _counted = False  # counted in `reading`

    def __init__(
        self,
        pool: Pool,
        request: bytes,
        stream: _Stream,
        timeout: float,
        worker: str,
        on_close: Callable[[CallEnd], None],
    ) -> None:
        super().__init__(worker, on_close)
        self._pool = pool
        self._request = request
        self._stream = stream
        self._ready = stream.ready
        self._timeout = timeout
        self._error_body: list[bytes] = []
        #: The choices whose first text is still due (a rest never delays one).
        self._untexted = set(range(stream.n))

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        event = self.poll()
        if event is not None:
            return event
        try:
            if not self._opened:
                await self._open()
                return self._stream.started()
            await self._wait()
        except errors.GatewayError as error:
            self._end(error)
            raise
        return self._ready.popleft()

    def poll(self) -> Event | None:
        """The next event ready, or None while there is none; raises the call's
        failure once the events before it are taken, StopAsyncIteration at its end."""
        ready = self._ready
        if ready:
            if self._paused and len(ready) <= 1:
                self._paused = False
                if not self._resting:
                    self._resume()
            return ready.popleft()
        if self._closed:
            raise StopAsyncIteration
        failure = self._failure
        if failure is not None:
            self._end(failure)
            raise failure
        return None

    def listen(self, listener: Callable[[], None] | None) -> bool:
        """Calls `listener` after each read (and when the call fails); None stops."""
        self._listener = listener
        return True

    async def _open(self) -> None:
        """Sends the request; returns at their first event, or `HEAD_GRACE` after
        their head said 200 (a refusal raises)."""
        self._opened = True
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(self._timeout, self._expire)
        try:
            connection = await self._pool.take(min(self._timeout, 5.0))
        except (OSError, TimeoutError) as error:
            raise errors.Unavailable(f"upstream unreachable: {error!r}") from None
        if self._closed:  # cancelled while connecting
            self._pool.drop(connection)
            raise errors.Unavailable("The call was cancelled.")
        self._connection = connection
        connection.send(self._request, self)
        self._counted = True
        _RawCall.reading += 1
        await self._wait(started=True)
        self._disarm_grace()

    async def _wait(self, started: bool = False) -> None:
        """Until an event is ready or the stream is done (`started`: or `HEAD_GRACE`
        passed after their 200 head); raises the call's failure meanwhile."""
        while not (self._ready or self._stream.done or (started and self._accepted)):
            if self._failure is not None:
                raise self._failure
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    def _accept(self) -> None:
        """`HEAD_GRACE` after their 200 head: `Started` need not wait for an event."""
        self._grace = None
        self._accepted = True
        self._wake()

    def _disarm_grace(self) -> None:
        if self._grace is not None:
            self._grace.cancel()
            self._grace = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # -- the connection's callbacks -------------------------------------------------

    def read(self) -> None:
        """After a read: what it brought is parsed, the reader goes on; too much
        waiting pauses reading, and once every choice's first text came, among other
        calls, while the data come less than `REST` apart, the socket rests for `REST`."""
        now = monotonic()
        rest = now - self._read_at < REST
        self._read_at = now
        if self._waiter is not None and (
            self._ready or self._stream.done or self._failure is not None
        ):  # what `_wait` waits for (their head's grace wakes it itself): not a bare head
            self._wake()
        listener = self._listener
        if listener is not None:
            listener()  # takes what it can now: what is left counts towards the pause
        if not rest and not self._ready:  # most reads: no rest due, nothing waits
            return
        if self._paused or self._resting:
            return
        pause = len(self._ready) > _PAUSE_AT
        if not pause and not (
            rest and not self._untexted and _RawCall.reading > 1 and not self._stream.done
        ):
            return
        connection = self._connection
        if connection is None or connection.transport is None:
            return
        connection.transport.pause_reading()
        if pause:
            self._paused = True
        else:
            self._resting = True
            asyncio.get_running_loop().call_later(REST, self._rest_over)

    def _rest_over(self) -> None:
        self._resting = False
        self._read_at = monotonic()  # what waits now came within the rest
        if not self._paused:
            self._resume()

    def _resume(self) -> None:
        connection = self._connection
        if connection is not None and connection.transport is not None:
            connection.transport.resume_reading()

    def _uncount(self) -> None:
        """The call is over, or its connection is no longer its own."""
        if self._counted:
            self._counted = False
            _RawCall.reading -= 1

    def head(self, status: int) -> None:
        self._status = status
        if status == 200 and self._stream.grace:
            self._grace = asyncio.get_running_loop().call_later(HEAD_GRACE, self._accept)

    def body(self, data: bytes) -> None:
        """Parses the body a read brought (the connection joined its pieces)."""
        if self._failure is not None or self._stream.done:
            return
        if self._status != 200:
            if self._error_size < MAX_ERROR_BYTES:
                self._error_body.append(data)
                self._error_size += len(data)
            return
        try:
            self._stream.feed(data)
        except errors.GatewayError as error:
            self.fail(error)  # the events before it go out first
        else:
            untexted = self._untexted
            if untexted:
                for event in self._ready:
                    if type(event) is Text or type(event) is Reasoning:
                        untexted.discard(event.index)
            if self._stream.done:
                self._end(None)  # [DONE]: the call is over; its last events wait to be read

    def broken(self, kind: str, detail: str) -> None:
        if kind == BAD_RESPONSE:  # what came before it was parsed first (`body`)
            self.fail(errors.Failed(f"The upstream sent bad HTTP: {detail}"))
        else:
            self.fail(errors.Unavailable(f"upstream closed the connection: {detail}"))

    def complete(self, connection: Connection) -> None:
        """Their response ended: the connection goes back to the pool if it can."""
        self._connection = None
        self._uncount()
        if self._paused or self._resting:
            if connection.transport is not None:
                connection.transport.resume_reading()
            self._paused = self._resting = False
        self._pool.give_back(connection)
        if self._status != 200:
            body = b"".join(self._error_body)[:MAX_ERROR_BYTES]
            self.fail(error_from_response(self._status, body))
        elif not self._stream.done:
            self.fail(errors.Failed("The upstream ended its stream without [DONE]."))

    def fail(self, error: errors.GatewayError) -> None:
        if self._failure is None and not self._stream.done:
            self._failure = error
            self._drop()

    def _expire(self) -> None:
        self.fail(errors.Timeout(f"upstream did not answer within {self._timeout:g} s"))
        self.read()  # the reader learns it as after a read

    # -- ending -----------------------------------------------------------------------

    def _drop(self) -> None:
        connection, self._connection = self._connection, None
        self._uncount()
        if connection is not None:
            self._pool.drop(connection)

    def _end(self, outcome: CallEnd) -> None:
        self._uncount()  # over: no other call rests on its account
        if self._deadline is not None:
            self._deadline.cancel()
        self._disarm_grace()
        if outcome is not None or not self._stream.done:
            self._drop()  # mid-response: the connection cannot be reused
        self.close(outcome)

    def cancel(self, outcome: CallEnd = CANCELLED) -> None:
        """Drops the connection (the upstream sees the client leave)."""
        self._ready.clear()
        self._end(outcome)
