"""The gateway's side of the worker protocol: one long-lived grpc.aio channel per
worker, our requests to protobuf, protobuf events back to ours, and every gRPC
failure turned into a `GatewayError` through the one table in `gateway.protocol.status`.

Everything above this module sees only `gateway.protocol.types` and `gateway.protocol.errors`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.protocol import errors, features
from gateway.protocol.convert import (
    embed_request_to_proto,
    embeddings_from_proto,
    event_from_proto,
    request_to_proto,
)
from gateway.protocol.kv_blocks import KvBatch
from gateway.protocol.kv_proto import batch_from_proto
from gateway.protocol.tls import WorkerCredentials
from gateway.protocol.types import Embeddings, EmbedRequest, Event, GenerateRequest, Tokens
from gateway.protocol.v1 import engine_pb2 as pb
from gateway.protocol.v1 import engine_pb2_grpc as pb_grpc
from gateway.upstreams.base import CANCELLED, CallEnd, ModelDescription, StreamBookkeeping
from gateway.upstreams.furnace_channel import from_rpc_error, open_channel
from gateway.upstreams.furnace_multiplex import MultiplexedCall, MultiplexLink

#: The service whose health a worker reports (see gateway.worker.server).
HEALTH_SERVICE = pb.DESCRIPTOR.services_by_name["Engine"].full_name


def _request_id(metadata: tuple[tuple[str, str], ...]) -> str:
    """The request's id, as the edge puts it in a call's metadata ("" without one)."""
    return next((value for key, value in metadata if key == "x-request-id"), "")


class FurnaceGrpcCall(StreamBookkeeping):
    """One Generate call: iterate for our events; `cancel()` stops the worker."""

    __slots__ = ("_call", "_logprobs")

    def __init__(
        self,
        call: grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateEvent],
        worker: str,
        on_close: Callable[[CallEnd], None],
        logprobs: bool = False,
    ) -> None:
        super().__init__(worker, on_close)
        self._call = call
        #: The request asked for logprobs or token ids: read them off the events.
        self._logprobs = logprobs

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        try:
            message = await self._call.read()
        except grpc.RpcError as error:
            failure = from_rpc_error(error)
            self.close(failure)
            raise failure from None
        if message is grpc.aio.EOF:
            self.close()
            raise StopAsyncIteration
        try:
            # grpc's stubs type read() as `object | GenerateEvent` (their EOF type is `object`)
            return event_from_proto(message, self._logprobs)  # type: ignore[arg-type]
        except errors.Failed as failure:
            self.cancel(failure)
            raise

    def cancel(self, outcome: CallEnd = CANCELLED) -> None:
        """Cancels the call (the worker sees CANCELLED and aborts); `outcome`
        is what the owner hears: our own cancellation, or a failure we saw."""
        self._call.cancel()
        self.close(outcome)


class FurnaceGrpcUpstream:
    """A worker at one address, over one channel created on the running loop."""

    def __init__(
        self, address: str, credentials: WorkerCredentials | None = None, multiplex: bool = True
    ) -> None:
        self.address = address
        #: Use GenerateMultiplexed once the worker says it offers it (`describe`).
        self._multiplex = multiplex
        self._offered = False
        self._link: MultiplexLink | None = None
        self._channel = open_channel(address, credentials)
        self._stub = pb_grpc.EngineStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    @property
    def multiplexed(self) -> int:
        """Requests open on the worker's multiplexed call (0 without one)."""
        return 0 if self._link is None else len(self._link)

    def call(
        self,
        request: GenerateRequest,
        timeout: float,
        metadata: tuple[tuple[str, str], ...] = (),
        on_close: Callable[[CallEnd], None] = lambda outcome: None,
    ) -> FurnaceGrpcCall | MultiplexedCall:
        """Starts the request with `timeout` seconds as its deadline: on the worker's
        multiplexed call where it offers one, else as a Generate call of its own."""
        if self._offered:
            link = self._link
            if link is None or link.broken is not None:
                link = self._link = MultiplexLink(self._stub, self.address)
            return link.start(request, timeout, metadata, on_close)
        call = self._stub.Generate(request_to_proto(request), timeout=timeout, metadata=metadata)
        return FurnaceGrpcCall(
            call, self.address, on_close, request.logprobs is not None or request.return_token_ids
        )

    async def embed(
        self,
        request: EmbedRequest,
        timeout: float,  # noqa: ASYNC109 (the gRPC deadline, as the Upstream interface has it)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> Embeddings:
        """One Embed call with `timeout` seconds as its deadline; an answer with
        another count of vectors than inputs is the worker's failure. Conversations (the
        chat form) are refused: `Embed` takes texts and token ids only."""
        if request.chat is not None:  # refused at the edge once the worker has described
            raise errors.Invalid(
                "The model's workers embed texts and token ids only, not conversations.",
                param="messages",
            )
        try:
            reply = await self._stub.Embed(
                embed_request_to_proto(request), timeout=timeout, metadata=metadata
            )
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        if len(reply.embeddings) != len(request.inputs):
            raise errors.Failed(
                f"The engine worker answered {len(reply.embeddings)} embeddings "
                f"for {len(request.inputs)} inputs."
            )
        return embeddings_from_proto(reply)

    async def count_tokens(
        self,
        request: GenerateRequest,
        timeout: float,  # noqa: ASYNC109 (the gRPC deadline, as the Upstream interface has it)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> int:
        """One CountTokens call with `timeout` seconds as its deadline; an engine that
        cannot count refuses naming `model` (`CannotCount`)."""
        try:
            reply = await self._stub.CountTokens(
                request_to_proto(request), timeout=timeout, metadata=metadata
            )
        except grpc.RpcError as error:
            raise errors.CannotCount.of(from_rpc_error(error)) from None
        return int(reply.prompt_tokens)

    async def tokenize(
        self,
        request: GenerateRequest,
        token_strs: bool,
        timeout: float,  # noqa: ASYNC109 (the gRPC deadline, as the Upstream interface has it)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> Tokens:
        """One Tokenize call with `timeout` seconds as its deadline (refusals as
        `count_tokens`'); strings that are not one an id are the worker's failure."""
        proto = pb.TokenizeRequest(prompt=request_to_proto(request), token_strs=token_strs)
        try:
            reply = await self._stub.Tokenize(proto, timeout=timeout, metadata=metadata)
        except grpc.RpcError as error:
            raise errors.CannotCount.of(from_rpc_error(error)) from None
        ids = list(reply.ids)
        if not token_strs:
            return Tokens(ids)
        if len(reply.token_strs) != len(ids):
            raise errors.Failed(
                f"The engine worker answered {len(reply.token_strs)} token strings "
                f"for {len(ids)} tokens."
            )
        return Tokens(ids, list(reply.token_strs))

    async def detokenize(
        self,
        model: str,
        ids: list[int],
        timeout: float,  # noqa: ASYNC109 (the gRPC deadline, as the Upstream interface has it)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> str:
        """One Detokenize call with `timeout` seconds as its deadline."""
        proto = pb.DetokenizeRequest(request_id=_request_id(metadata), model=model, ids=ids)
        try:
            reply = await self._stub.Detokenize(proto, timeout=timeout, metadata=metadata)
        except grpc.RpcError as error:
            raise errors.CannotCount.of(from_rpc_error(error)) from None
        return str(reply.text)

    async def load_adapter(self, name: str, path: str, timeout: float) -> None:  # noqa: ASYNC109
        """Loads the LoRA adapter `name` from `path` on the worker (`LoadAdapter`, the
        gRPC deadline `timeout` seconds; `LoadsAdapters`, whether it multiplexes or not).
        One it holds is loaded. A worker that refuses (UNIMPLEMENTED: its engine takes
        no adapters; FAILED_PRECONDITION: no adapter there, no room; INVALID_ARGUMENT:
        a name or path out of its bounds) is `Failed`, naming the adapter: the
        operator's to fix, not the client's; one unreachable, stopping or too slow is
        `Unavailable`."""
        request = pb.LoadAdapterRequest(name=name, path=path)
        try:
            await self._stub.LoadAdapter(request, timeout=timeout)
        except grpc.RpcError as error:
            failure = from_rpc_error(error)
            reason = failure.message[:512]
            # also an older worker's, which has no such rpc ("Method not found!")
            if isinstance(error, grpc.aio.AioRpcError) and (
                error.code() == grpc.StatusCode.UNIMPLEMENTED
            ):
                reason = f"it takes no adapters: {reason}"
            kind = (
                errors.Unavailable
                if isinstance(failure, errors.Unavailable | errors.Timeout | errors.Busy)
                else errors.Failed
            )
            raise kind(f"The worker could not load the adapter `{name}`: {reason}") from None

    async def describe(self, deadline: float) -> list[ModelDescription]:
        """The models the worker serves (within `deadline` seconds), or a `GatewayError`."""
        try:
            reply = await self._stub.Describe(pb.DescribeRequest(), timeout=deadline)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        self._offered = self._multiplex and reply.multiplex
        capacity = reply.capacity or None
        full = capacity is not None and reply.load >= capacity
        return [
            ModelDescription(
                m.name,
                m.max_context,
                capacity,
                reply.load,
                full,
                # the protocol has no field for a sound or a video, whatever a worker lists
                frozenset(m.features) - features.NOT_CARRIED
                if m.features
                else features.FIRST_VERSION,
            )
            for m in reply.models
        ]

    async def kv_events(self, model: str) -> AsyncIterator[KvBatch]:
        """The worker's KV-cache events (`SubscribeKvEvents`) until the stream ends; an
        `GatewayError` when it breaks (`Invalid` from a worker that publishes none)."""
        call = self._stub.SubscribeKvEvents(pb.KvEventsRequest(model=model))
        try:
            async for message in call:
                yield batch_from_proto(message)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        finally:
            call.cancel()

    async def watch_health(self, poll_interval: float, deadline: float) -> AsyncIterator[bool]:
        """Whether the worker is serving, each time that changes: the health
        Watch stream where the worker has it, else a Check every `poll_interval` of
        at most `deadline` seconds (a worker without the health service counts as
        serving). Ends with an `GatewayError` when the worker cannot be reached."""
        request = health_pb2.HealthCheckRequest(service=HEALTH_SERVICE)
        serving = health_pb2.HealthCheckResponse.SERVING
        try:
            # the health stubs declare HealthStub without its methods
            async for reply in self._health.Watch(request):  # type: ignore[attr-defined]
                yield reply.status == serving
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise from_rpc_error(error) from None
        while True:
            try:
                reply = await self._health.Check(  # type: ignore[attr-defined]
                    request, timeout=deadline
                )
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise from_rpc_error(error) from None
                yield True  # no health service: passive ejection alone judges it
            else:
                yield reply.status == serving
            await asyncio.sleep(poll_interval)

    async def close(self) -> None:
        """Closes the channel, cancelling calls still on it."""
        if self._link is not None:
            await self._link.aclose()
        await self._channel.close()
