"""A raw gRPC worker whose behaviour each request scripts, for the fault tests.

It implements the protocol directly (not through our worker SDK), so tests
can make it answer any gRPC status, before or after the first event, hang, or
stream slowly. The script is the prompt (or the last chat message), as JSON:

    {"status": "UNAVAILABLE"}                     refuse before Started
    {"status": "INVALID_ARGUMENT", "param": "x"}  ... naming a parameter
    {"texts": 2, "status": "INTERNAL"}            fail after Started and 2 Texts
    {"hang": "before"}                            never start
    {"texts": 1, "hang": "after"}                 start, send 1 Text, then hang
    {"texts": 5, "delay": 0.05}                   5 Texts, 50 ms apart, then finish
    {"texts": 1, "end": "eof"}                    end the stream without Finished
    {"status": "INTERNAL", "message": "..."}      fail with that status message
    {"texts": 1, "reason": 99}                    finish with that raw reason value
    {"texts": 1, "restart": true}                 send a second Started mid-stream
    {"texts": 1, "unknown": true}                 send an event of no known kind
    {"huge": 67108865}                            first send one Text that many bytes long

It offers `GenerateMultiplexed` too (through the worker SDK's multiplexer, with
the same scripts: a status becomes the request's in-band end), so a gateway
with `multiplex_workers` on reaches it that way, and with it off by Generate.

It records, by request id, the calls it saw, their metadata, time left and
max_tokens, and the calls that were cancelled.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import NoReturn

import grpc

from gateway.protocol.status import error_from_status
from gateway.protocol.v1 import engine_pb2 as pb
from gateway.protocol.v1 import engine_pb2_grpc as pb_grpc
from gateway.worker import multiplex

SCRIPTED_MODEL = "scripted"


def script(**behaviour: object) -> str:
    """The prompt that scripts a request."""
    return json.dumps(behaviour)


class ScriptedWorker(pb_grpc.EngineServicer):
    """The servicer; start it with `start()` on a loopback port."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.cancelled: list[str] = []
        self.metadata: dict[str, dict[str, str]] = {}
        self.deadlines: dict[str, float | None] = {}
        self.max_tokens: dict[str, int | None] = {}  # the max_tokens each call was sent
        #: By request id: the rpc that carried it (Generate or GenerateMultiplexed).
        self.rpcs: dict[str, str] = {}
        self.multiplexed_calls = 0  # GenerateMultiplexed calls opened
        self.active = 0
        self.server: grpc.aio.Server | None = None
        self.address = ""

    async def start(self) -> None:
        """Serves on 127.0.0.1 with a free port."""
        self.server = grpc.aio.server(options=(("grpc.so_reuseport", 0),))
        pb_grpc.add_EngineServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{port}"
        await self.server.start()

    async def stop(self) -> None:
        """Stops at once."""
        assert self.server is not None
        await self.server.stop(0)

    async def GenerateMultiplexed(
        self,
        requests: AsyncIterator[pb.MultiplexRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        self.multiplexed_calls += 1
        await multiplex.serve(self._started, requests, context)

    def _started(self, start: pb.MultiplexStart) -> AsyncGenerator[pb.GenerateEvent, None]:
        self.rpcs[start.request.request_id] = "GenerateMultiplexed"
        return self.Generate(start.request, _StreamContext(start))  # type: ignore[arg-type]

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[pb.GenerateEvent, None]:
        rid = request.request_id
        self.rpcs.setdefault(rid, "Generate")
        self.calls.append(rid)
        self.metadata[rid] = {k: v for k, v in context.invocation_metadata()}
        self.deadlines[rid] = context.time_remaining()
        sampling = request.sampling
        self.max_tokens[rid] = sampling.max_tokens if sampling.HasField("max_tokens") else None
        if request.WhichOneof("prompt") == "chat":
            text = request.chat.messages[-1].content
        else:
            text = request.text
        try:
            plan = json.loads(text)
        except ValueError:
            plan = {"texts": 3}
        self.active += 1
        try:
            async for event in self._play(plan, context):
                yield event
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        finally:
            self.active -= 1

    async def _play(
        self, plan: dict, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateEvent]:
        texts = int(plan.get("texts", 0))
        status = plan.get("status")
        if plan.get("hang") == "before":
            await asyncio.sleep(3600)
        if status and not texts and not plan.get("started"):
            await self._abort(context, status, plan.get("param"), plan.get("message"))
        if plan.get("huge"):
            yield pb.GenerateEvent(text=pb.Text(text="x" * int(plan["huge"]), tokens=1))
        yield pb.GenerateEvent(started=pb.Started(prompt_tokens=7))
        for i in range(texts):
            if plan.get("delay"):
                await asyncio.sleep(float(plan["delay"]))
            yield pb.GenerateEvent(text=pb.Text(text=f"t{i} ", tokens=1))
        if plan.get("restart"):
            yield pb.GenerateEvent(started=pb.Started(prompt_tokens=7))
        if plan.get("unknown"):
            yield pb.GenerateEvent()  # no member of the `event` oneof set
        if status:
            await self._abort(context, status, plan.get("param"), plan.get("message"))
        if plan.get("hang") == "after":
            await asyncio.sleep(3600)
        if plan.get("end") == "eof":
            return
        yield pb.GenerateEvent(
            finished=pb.Finished(
                reason=int(plan.get("reason", pb.FINISH_REASON_STOP)),  # type: ignore[arg-type]
                completion_tokens=texts,
            )
        )

    async def _abort(
        self,
        context: grpc.aio.ServicerContext,
        status: str,
        param: object,
        message: object = None,
    ) -> None:
        if param:
            context.set_trailing_metadata((("furnace-param", str(param)),))
        await context.abort(grpc.StatusCode[status], str(message or f"scripted {status}"))

    async def Describe(
        self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DescribeResponse:
        return pb.DescribeResponse(
            models=[pb.ModelInfo(name=SCRIPTED_MODEL, max_context=100)],
            capacity=64,
            load=self.active,
            multiplex=True,
        )


class _StreamContext:
    """What the scripts need of a call's context, for one request on a
    multiplexed call: its metadata and deadline from its start; an abort
    raises the status as our error, which the multiplexer sends in-band."""

    def __init__(self, start: pb.MultiplexStart) -> None:
        self._start = start
        self._trailing: dict[str, str] = {}

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return tuple(self._start.metadata.items())

    def time_remaining(self) -> float | None:
        return self._start.timeout_ms / 1000 if self._start.timeout_ms else None

    def set_trailing_metadata(self, trailing: tuple[tuple[str, str], ...]) -> None:
        self._trailing = dict(trailing)

    async def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise error_from_status(code, details, self._trailing)
