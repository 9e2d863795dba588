"""The worker's side of `GenerateMultiplexed`: many requests on one call.

Each request started on the call runs as its own task through the same answer
as `Generate` (`Answer`: its events, refusals and failures raised as
`GatewayError`); their events go into one outbox, and one writer sends whatever
the outbox holds as one `MultiplexResponse` whenever the call can take a
message. Requests stepped together by an engine land in one message, so the
call costs one gRPC message a step instead of one a request a step.

Per request: a deadline (`timeout_ms`), cancellation by the gateway (the task is
cancelled, which closes the engine's generators, as a cancelled `Generate`
does), and a flow-control window (`gateway.protocol.multiplex.WINDOW`): past it
the request's task waits for credit, so a request whose client stops reading
stops its engine, and the outbox never holds more than a window a request.
Ending the call ends every request on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import grpc

from gateway.protocol import errors
from gateway.protocol.multiplex import DONE, WINDOW, end_of, end_with, units
from gateway.protocol.v1 import engine_pb2 as pb

log = logging.getLogger("furnace.worker")

#: One request's answer (its start: the request, deadline and metadata), as
#: `Generate` sends it; refusals and failures raised as `GatewayError`.
Answer = Callable[[pb.MultiplexStart], AsyncGenerator[pb.GenerateEvent, None]]

#: Units (encoded bytes of events, logprobs included) one response carries at most
#: before the rest goes in the next: far under the 64 MiB the gateway takes.
MAX_RESPONSE_UNITS = 8 * 1024 * 1024


class _Stream:
    """One request on the call: its task and its window."""

    __slots__ = ("credited", "room", "sent", "task")

    def __init__(self) -> None:
        self.sent = 0  # units sent
        self.credited = 0  # units the gateway has returned
        self.room: asyncio.Future[None] | None = None  # set when credit arrives
        self.task: asyncio.Task[None] | None = None


class Multiplexer:
    """Serves one GenerateMultiplexed call (`serve`); `close_when_idle` ends it
    once its open requests have (a stopping worker: new ones are the answer's to
    refuse)."""

    def __init__(self, answer: Answer, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self._answer = answer
        self._context = context
        self._streams: dict[int, _Stream] = {}
        self._outbox: list[pb.MultiplexEvent] = []
        self._outbox_units = 0
        self._full: deque[list[pb.MultiplexEvent]] = deque()  # outboxes past the size cap
        self._wake: asyncio.Future[None] | None = None
        self._reading = True  # the gateway may still start requests
        self._closing = False  # end the call once no request is open

    def close_when_idle(self) -> None:
        """Ends the call as soon as no request is open on it."""
        self._closing = True
        self._poke()

    # -- the outbox ---------------------------------------------------------------

    def _emit(self, event: pb.MultiplexEvent, size: int) -> None:
        if self._outbox_units + size > MAX_RESPONSE_UNITS and self._outbox:
            self._full.append(self._outbox)
            self._outbox, self._outbox_units = [], 0
        self._outbox.append(event)
        self._outbox_units += size
        self._poke()

    def _poke(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def write_all(self) -> None:
        """Sends what the outbox holds, a message at a time, until the gateway
        has closed its side and every request has ended."""
        loop = asyncio.get_running_loop()
        write = self._context.write
        while True:
            if self._full:
                batch = self._full.popleft()
            elif self._outbox:
                batch, self._outbox, self._outbox_units = self._outbox, [], 0
            elif not self._streams and (self._closing or not self._reading):
                return
            else:
                self._wake = loop.create_future()
                await self._wake
                self._wake = None
                continue
            await write(pb.MultiplexResponse(events=batch))

    # -- what the gateway sends ---------------------------------------------------

    async def read_all(self, requests: AsyncIterator[pb.MultiplexRequest]) -> None:
        """Starts, cancels and credits requests as the gateway asks, until it
        closes its side; a start that reuses an open id is `Invalid`."""
        try:
            async for message in requests:
                for start in message.starts:
                    self._start(start)
                for stream_id in message.cancels:
                    stream = self._streams.pop(stream_id, None)
                    if stream is not None and stream.task is not None:
                        stream.task.cancel()
                for credit in message.credits:
                    stream = self._streams.get(credit.stream)
                    if stream is not None:
                        stream.credited += credit.units
                        room = stream.room
                        if room is not None and not room.done():
                            room.set_result(None)
        finally:
            self._reading = False
            self._poke()

    def _start(self, start: pb.MultiplexStart) -> None:
        stream_id = start.stream
        if not stream_id or stream_id in self._streams:
            raise errors.Invalid(f"Stream id {stream_id} is 0 or already open on this call.")
        stream = self._streams[stream_id] = _Stream()
        deadline = asyncio.timeout(start.timeout_ms / 1000 if start.timeout_ms else None)
        stream.task = asyncio.get_running_loop().create_task(
            self._run(stream_id, stream, start, deadline)
        )

    # -- one request --------------------------------------------------------------

    async def _run(
        self,
        stream_id: int,
        stream: _Stream,
        start: pb.MultiplexStart,
        deadline: asyncio.Timeout,
    ) -> None:
        """Sends one request's events, then its end; nothing when cancelled."""
        end = DONE
        try:
            async with deadline, contextlib.aclosing(self._answer(start)) as events:
                async for event in events:
                    size = units(event)
                    self._emit(pb.MultiplexEvent(stream=stream_id, event=event), size)
                    stream.sent += size
                    while stream.sent - stream.credited >= WINDOW:
                        stream.room = asyncio.get_running_loop().create_future()
                        await stream.room
        except errors.GatewayError as error:
            end = end_of(error)
        except TimeoutError:
            if not deadline.expired():
                log.exception("engine failed on request %s", start.request.request_id)
                end = end_with(grpc.StatusCode.INTERNAL, "The engine failed.")
            else:
                end = end_with(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
        except asyncio.CancelledError:
            log.debug("request %s cancelled", start.request.request_id)
            raise
        except Exception:
            log.exception("engine failed on request %s", start.request.request_id)
            end = end_with(grpc.StatusCode.INTERNAL, "The engine failed.")
        if self._streams.pop(stream_id, None) is not None:
            self._emit(pb.MultiplexEvent(stream=stream_id, end=end), 1)

    async def aclose(self) -> None:
        """Stops every request still running (the call ended) and waits until they have."""
        tasks = [s.task for s in self._streams.values() if s.task is not None]
        self._streams.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def serve(self, requests: AsyncIterator[pb.MultiplexRequest]) -> None:
        """Serves the call until the gateway ends it, or it closes when idle."""
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self.read_all(requests))
        writer = loop.create_task(self.write_all())
        try:
            await asyncio.wait((reader, writer), return_when=asyncio.FIRST_COMPLETED)
            if reader.done():
                reader.result()  # a start that broke the call's rules raises here
            await writer  # the open requests finish, then the call ends
        except errors.Invalid as error:
            await self._context.abort(grpc.StatusCode.INVALID_ARGUMENT, error.message)
        finally:
            reader.cancel()
            writer.cancel()
            await self.aclose()
            await asyncio.gather(reader, writer, return_exceptions=True)


async def serve(
    answer: Answer,
    requests: AsyncIterator[pb.MultiplexRequest],
    context: grpc.aio.ServicerContext[Any, Any],
) -> None:
    """Serves one GenerateMultiplexed call with `answer` for each request on it."""
    await Multiplexer(answer, context).serve(requests)
