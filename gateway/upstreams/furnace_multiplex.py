"""The gateway's side of `GenerateMultiplexed`: every request to a worker on one
call, for workers that offer it (`DescribeResponse.multiplex`).

Why: grpc.aio costs ~80-130 µs of CPU per message received and a few hundred
to start a call. On one call, a request is a `MultiplexStart` in the next
message out (starts, cancellations and credit that arrive together go as one),
and one message in carries the events of every request the worker stepped.

`MultiplexLink` owns the call: a writer task sends what is queued, a reader
task hands each event to its request's `MultiplexedCall`, an iterator like the
per-request `FurnaceGrpcCall` that also pushes (the event pump's `Pushing`: the
reader calls the pump, which polls, so no task per request waits on the call),
with the same outcomes: its end arrives in-band
(`MultiplexEnd`, Generate's status through the same table), and when the link
breaks every request on it fails `Unavailable` (retryable before its first
event, as a broken per-request call is), and the break counts once against the
worker, not once per request (one request reports it; the others end
`SHARED_FAILURE`). What goes out is bounded: the starts ready together go in
messages of `MESSAGE_BYTES` (a start too big for any message is refused, as a
400 naming its prompt, before it is sent), so no client's request can make a
message pass gRPC's cap and break the call for everyone on it. Each request returns flow-control
credit as it is read (`gateway.protocol.multiplex`), so a slow client holds
back only its own request.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from gateway.protocol import errors
from gateway.protocol.convert import event_from_proto, request_to_proto
from gateway.protocol.multiplex import CREDIT_STEP, WINDOW, error_of, units
from gateway.protocol.types import Event, GenerateRequest
from gateway.protocol.v1 import engine_pb2 as pb
from gateway.protocol.v1 import engine_pb2_grpc as pb_grpc
from gateway.upstreams.base import CANCELLED, SHARED_FAILURE, CallEnd, StreamBookkeeping
from gateway.upstreams.furnace_channel import from_rpc_error

log = logging.getLogger("furnace.upstream")

#: The largest `timeout_ms` (uint32): about 49 days.
_MAX_TIMEOUT_MS = 2**32 - 1
#: The most bytes of starts one `MultiplexRequest` carries: the starts ready together
#: go in messages of up to this much (any one start on its own), far under gRPC's
#: message cap (64 MiB here and on our workers). 56 starts of 4 MB once went as one
#: message of 224 MB: the call broke, and every request on it with the call.
MESSAGE_BYTES = 8 * 1024 * 1024
#: The largest start: the message cap less room for the cancels and credits that go
#: with it. A larger one is refused before it is sent (a 400 naming its prompt).
MAX_START_BYTES = 60 * 1024 * 1024


class MultiplexedCall(StreamBookkeeping):
    """One request on a worker's multiplexed call: iterate for our events;
    `cancel()` stops it on the worker."""

    __slots__ = (
        "_broken",
        "_counted",
        "_events",
        "_id",
        "_link",
        "_listener",
        "_logprobs",
        "_outstanding",
        "_waiter",
    )

    def __init__(
        self,
        link: MultiplexLink,
        stream_id: int,
        on_close: Callable[[CallEnd], None],
        logprobs: bool,
    ) -> None:
        super().__init__(link.address, on_close)
        self._link = link
        self._id = stream_id
        self._logprobs = logprobs
        #: What the reader handed over: GenerateEvents, then a MultiplexEnd.
        self._events: deque[pb.GenerateEvent | pb.MultiplexEnd] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._listener: Callable[[], None] | None = None  # see `listen`
        self._broken: errors.GatewayError | None = None  # the link broke
        self._counted = True  # whether `_broken` is this request's to report
        self._outstanding = 0  # units received and not yet credited back

    def push(self, item: pb.GenerateEvent | pb.MultiplexEnd) -> None:
        """From the link's reader: the next event, or the end. A worker may send an
        event only while less than a window is outstanding; one that sends past it
        fails the request (what it sent is bounded by the window, not by its will)."""
        if type(item) is pb.GenerateEvent:
            if self._outstanding >= WINDOW:
                self.cancel_on_worker()
                self.fail(errors.Failed("The engine worker sent past its flow-control window."))
                return
            self._outstanding += units(item)
        self._events.append(item)
        self._ready()

    def fail(self, failure: errors.GatewayError, counted: bool = True) -> None:
        """From the link: it broke (or this request could not start); what is queued
        is still read first. Not `counted`: its owner hears `SHARED_FAILURE`, so the
        link's failure counts once against the worker, not once per request on it."""
        self._broken = failure
        self._counted = counted
        self._ready()

    def _ready(self) -> None:
        listener = self._listener
        if listener is not None:
            listener()
            return
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def listen(self, listener: Callable[[], None] | None) -> bool:
        """Calls `listener` (in the link's reader) whenever events may be ready
        (None: stop); the event pump's way of reading without a task of its own."""
        self._listener = listener
        return True

    def poll(self) -> Event | None:
        """The next event ready, or None while there is none; raises the request's
        error, or StopAsyncIteration at its end. Credit goes back when every event held
        has been taken and they add up to `CREDIT_STEP`: counted once, as they arrive."""
        events = self._events
        if not events:
            if self._broken is not None:
                self.close(self._broken if self._counted else SHARED_FAILURE)
                raise self._broken
            return None
        item = events.popleft()
        if type(item) is pb.MultiplexEnd:
            failure = error_of(item)
            self.close(failure)
            if failure is not None:
                raise failure
            raise StopAsyncIteration
        try:
            event = event_from_proto(item, self._logprobs)  # type: ignore[arg-type]
        except errors.Failed as failure:
            self.cancel(failure)
            raise
        if not events and self._outstanding >= CREDIT_STEP:
            self._link.credit(self._id, self._outstanding)
            self._outstanding = 0
        return event

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        while (event := self.poll()) is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return event

    def cancel_on_worker(self) -> None:
        """Stops the request on the worker (once); nothing more comes for it."""
        self._link.cancel(self._id)

    def cancel(self, outcome: CallEnd = CANCELLED) -> None:
        """Stops the request on the worker; `outcome` is what the owner hears."""
        self.cancel_on_worker()
        self.close(outcome)


class MultiplexLink:
    """One GenerateMultiplexed call to a worker and the requests on it."""

    def __init__(self, stub: pb_grpc.EngineStub, address: str) -> None:
        self.address = address
        self._call: grpc.aio.StreamStreamCall[pb.MultiplexRequest, pb.MultiplexResponse] = (
            stub.GenerateMultiplexed()
        )
        self._calls: dict[int, MultiplexedCall] = {}
        self._next_id = 1
        #: What the writer sends next: starts not yet written (a request cancelled
        #: before its start went out just leaves), then cancels and credits.
        self._starts: dict[int, tuple[pb.MultiplexStart, int]] = {}  # and its size
        self._cancels: list[int] = []
        self._credits: list[pb.MultiplexCredit] = []
        self._wake: asyncio.Future[None] | None = None
        #: Why the link is over; None while it serves.
        self.broken: errors.GatewayError | None = None
        loop = asyncio.get_running_loop()
        self._writer = loop.create_task(self._write())
        self._reader = loop.create_task(self._read())

    def __len__(self) -> int:
        """Requests open on the link."""
        return len(self._calls)

    def start(
        self,
        request: GenerateRequest,
        timeout: float,
        metadata: tuple[tuple[str, str], ...],
        on_close: Callable[[CallEnd], None],
    ) -> MultiplexedCall:
        """Starts a request with `timeout` seconds as its deadline on the worker."""
        stream_id = self._next_id
        self._next_id += 1
        call = MultiplexedCall(
            self, stream_id, on_close, request.logprobs is not None or request.return_token_ids
        )
        start = pb.MultiplexStart(
            stream=stream_id,
            request=request_to_proto(request),
            timeout_ms=min(max(1, round(timeout * 1000)), _MAX_TIMEOUT_MS),
            metadata=dict(metadata),
        )
        size = start.ByteSize()
        if size > MAX_START_BYTES:  # it would break the call, and every request on it
            param = "messages" if request.messages is not None else "prompt"
            call.fail(
                errors.Invalid(
                    f"Invalid '{param}': the request is {size} bytes for the engine worker, "
                    f"more than the {MAX_START_BYTES} it takes.",
                    param=param,
                )
            )
            return call
        self._calls[stream_id] = call
        self._starts[stream_id] = (start, size)
        self._poke()
        return call

    def cancel(self, stream_id: int) -> None:
        """Stops a request (once; a request already over is left alone)."""
        if (
            self._calls.pop(stream_id, None) is not None
            and self.broken is None
            and self._starts.pop(stream_id, None) is None  # else it never went out
        ):
            self._cancels.append(stream_id)
            self._poke()

    def credit(self, stream_id: int, taken: int) -> None:
        """Returns `taken` units of a request's window."""
        if stream_id in self._calls and self.broken is None:
            self._credits.append(pb.MultiplexCredit(stream=stream_id, units=taken))
            self._poke()

    def _poke(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _write(self) -> None:
        loop = asyncio.get_running_loop()
        write = self._call.write
        try:
            while True:
                if not (self._starts or self._cancels or self._credits):
                    self._wake = loop.create_future()
                    await self._wake
                    continue
                outgoing = pb.MultiplexRequest(
                    starts=self._next_starts(), cancels=self._cancels, credits=self._credits
                )
                self._cancels, self._credits = [], []
                await write(outgoing)
        except grpc.RpcError as error:  # the reader sees the call's status too
            self._break(from_rpc_error(error))
        except asyncio.InvalidStateError:  # written to after the call ended
            self._break(errors.Unavailable("The engine worker's multiplexed call ended."))

    def _next_starts(self) -> list[pb.MultiplexStart]:
        """Takes the starts for the next message: the oldest first, up to
        `MESSAGE_BYTES` together (at least one)."""
        starts: list[pb.MultiplexStart] = []
        size, queued = 0, self._starts
        for start, bytes_ in queued.values():
            size += bytes_
            if starts and size > MESSAGE_BYTES:
                break
            starts.append(start)
        for start in starts:
            del queued[start.stream]
        return starts

    async def _read(self) -> None:
        read, calls, eof = self._call.read, self._calls, grpc.aio.EOF
        failure: errors.GatewayError
        try:
            while (response := await read()) is not eof:
                for event in response.events:  # type: ignore[attr-defined]
                    call = calls.get(event.stream)
                    if call is None:  # cancelled: its last events still come
                        continue
                    if event.WhichOneof("body") == "event":
                        call.push(event.event)
                    else:
                        del calls[event.stream]
                        call.push(event.end)
            failure = errors.Unavailable("The engine worker ended the multiplexed call.")
        except grpc.RpcError as error:
            failure = from_rpc_error(error)
        except Exception:  # a bug of ours: fail the requests rather than hang them
            log.exception("reading the multiplexed call of %s failed", self.address)
            failure = errors.Failed("The gateway failed while reading the worker's answers.")
        self._break(failure)

    def _break(self, failure: errors.GatewayError) -> None:
        """Ends the link: every request on it fails with `failure`."""
        if self.broken is not None:
            return
        self.broken = failure
        self._call.cancel()
        self._writer.cancel()
        calls, self._calls = self._calls, {}
        for i, call in enumerate(calls.values()):
            call.fail(failure, counted=i == 0)

    async def aclose(self) -> None:
        """Ends the call and waits for its tasks."""
        self._break(errors.Unavailable("The gateway closed the engine worker's channel."))
        tasks: list[asyncio.Task[Any]] = [self._writer, self._reader]
        await asyncio.gather(*tasks, return_exceptions=True)
