"""The gRPC Engine service over any `Engine`.

The engine's generator runs in a task of its own and fills a buffer; the RPC
sends what the buffer holds as one `Text` whenever the stream can take a
message, so an engine that runs ahead of the network costs one message per
send, not one per token. Cancellation of the call (by the client or its
deadline) cancels that task, which closes the engine's generator.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from gateway.protocol import errors
from gateway.protocol.convert import event_to_proto, request_from_proto
from gateway.protocol.status import status_from_error
from gateway.protocol.stop import StopMatcher
from gateway.protocol.types import Event, Finished, FinishReason, Started, Text
from gateway.protocol.v1 import engine_pb2 as pb
from gateway.protocol.v1 import engine_pb2_grpc as pb_grpc
from gateway.worker.engine import Engine

log = logging.getLogger("furnace.worker")

#: Text an engine may run ahead of the RPC, in characters (also the largest `Text`).
READ_AHEAD_CHARS = 64 * 1024


class _ReadAhead:
    """Runs an engine's generator in a task; hands out what is ready as lists.

    It reads ahead at most `READ_AHEAD_CHARS` of text: past that it waits for the
    RPC to take a batch, so a gateway that stops reading (HTTP/2 flow control
    holds the RPC's sends) stops the engine too, and no message grows past it."""

    def __init__(self, events: AsyncIterator[Event]) -> None:
        self._events = events
        self._ready: list[Event] = []
        self._buffered = 0  # characters of text in `_ready`
        self._error: BaseException | None = None
        self._ended = False
        self._waiter: asyncio.Future[None] | None = None
        self._room: asyncio.Future[None] | None = None
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            async for event in self._events:
                self._ready.append(event)
                waiter = self._waiter
                if waiter is not None and not waiter.done():
                    waiter.set_result(None)
                if isinstance(event, Text):
                    self._buffered += len(event.text)
                    if self._buffered >= READ_AHEAD_CHARS:
                        self._room = asyncio.get_running_loop().create_future()
                        await self._room
        except Exception as error:
            self._error = error
        finally:
            self._ended = True
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)

    async def batch(self) -> list[Event]:
        """The events ready now (at least one), [] at the end; raises the engine's error."""
        while not self._ready and not self._ended:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
            self._waiter = None
        if self._ready:
            batch, self._ready, self._buffered = self._ready, [], 0
            room = self._room
            if room is not None and not room.done():
                room.set_result(None)
            return batch
        if self._error is not None:
            raise self._error
        return []

    async def aclose(self) -> None:
        """Stops the engine (its generator is closed) and waits until it has."""
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self._events.aclose()  # type: ignore[attr-defined]


class EngineService(pb_grpc.EngineServicer):
    """Serves one engine over the worker protocol."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.active = 0

    async def Generate(
        self,
        request: pb.GenerateRequest,
        context: grpc.aio.ServicerContext[pb.GenerateRequest, pb.GenerateEvent],
    ) -> AsyncIterator[pb.GenerateEvent]:
        """One answer; see engine.proto for the contract."""
        engine = self.engine
        if request.model and request.model != engine.model:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"This worker does not serve `{request.model}`."
            )
        if self.active >= engine.capacity:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "The worker is full.")
        self.active += 1
        events = _ReadAhead(engine.generate(request_from_proto(request)))
        try:
            async for message in self._messages(events, StopMatcher(tuple(request.stop))):
                yield message
        except errors.EngineError as error:
            code, trailing = status_from_error(error)
            context.set_trailing_metadata(trailing)
            await context.abort(code, error.message)
        except asyncio.CancelledError:
            log.debug("request %s cancelled", request.request_id)
            raise
        except Exception:
            log.exception("engine failed on request %s", request.request_id)
            await context.abort(grpc.StatusCode.INTERNAL, "The engine failed.")
        finally:
            self.active -= 1
            await events.aclose()

    async def _messages(
        self, events: _ReadAhead, stop: StopMatcher
    ) -> AsyncIterator[pb.GenerateEvent]:
        started = False
        tokens = 0  # generated so far
        unsent = 0  # of those, not yet in a sent Text
        while batch := await events.batch():
            pieces: list[str] = []
            finished: Finished | None = None
            for event in batch:
                if isinstance(event, Text):
                    tokens += event.tokens
                    unsent += event.tokens
                    released, stopped = stop.feed(event.text)
                    pieces.append(released)
                    if stopped:
                        finished = Finished(FinishReason.STOP, tokens)
                        break
                elif isinstance(event, Started) and not started:
                    started = True
                    yield event_to_proto(event)
                elif isinstance(event, Finished):
                    pieces.append(stop.flush())
                    finished = event
                    break
                else:
                    raise errors.Failed(f"The engine sent {type(event).__name__} out of order.")
            text = "".join(pieces)
            if text:
                yield event_to_proto(Text(text, unsent))
                unsent = 0
            if finished is not None:
                yield event_to_proto(finished)
                return
            if not started:
                raise errors.Failed("The engine did not start the answer with Started.")
        raise errors.Failed("The engine ended the answer without Finished.")

    async def Describe(
        self,
        request: pb.DescribeRequest,
        context: grpc.aio.ServicerContext[pb.DescribeRequest, pb.DescribeResponse],
    ) -> pb.DescribeResponse:
        """The engine's model, capacity and load (by the engine's count where it keeps one)."""
        engine = self.engine
        load = engine.load()
        return pb.DescribeResponse(
            models=[pb.ModelInfo(name=engine.model, max_context=engine.max_context)],
            capacity=engine.capacity,
            load=self.active if load is None else load,
        )
