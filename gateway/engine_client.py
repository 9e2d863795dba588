"""The gateway's side of the worker protocol: one long-lived grpc.aio channel per
worker, our requests to protobuf, protobuf events back to ours, and every gRPC
failure turned into an `EngineError` through the one table in `grpc_errors`.

Everything above this module sees only `gateway.types` and `gateway.errors`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway import errors
from gateway._proto import engine_pb2 as pb
from gateway._proto import engine_pb2_grpc as pb_grpc
from gateway.grpc_errors import error_from_status
from gateway.grpc_tls import WorkerCredentials
from gateway.types import Event, Finished, FinishReason, GenerateRequest, Started, Text
from gateway.worker_client import CANCELLED, ModelDescription, Outcome, StreamBookkeeping

_FINISH_REASONS = {
    pb.FINISH_REASON_STOP: FinishReason.STOP,
    pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
}

# Loopback and in-cluster links: keep connections warm, allow big prompts.
_CHANNEL_OPTIONS = (
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 5_000),
)


#: The service whose health a worker reports (see gateway.worker.server).
HEALTH_SERVICE = pb.DESCRIPTOR.services_by_name["Engine"].full_name


def to_proto(request: GenerateRequest) -> pb.GenerateRequest:
    """Our request as the protocol's message."""
    s = request.sampling
    sampling = pb.SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        seed=s.seed,
        max_tokens=s.max_tokens,
    )
    message = pb.GenerateRequest(
        request_id=request.request_id,
        model=request.model,
        sampling=sampling,
        stop=request.stop,
    )
    if request.messages is not None:
        message.chat.messages.extend(
            pb.ChatMessage(role=m.role, content=m.content) for m in request.messages
        )
    else:
        message.text = request.prompt or ""
    return message


def _from_rpc_error(error: grpc.RpcError) -> errors.EngineError:
    if isinstance(error, grpc.aio.AioRpcError):
        return error_from_status(error.code(), error.details(), error.trailing_metadata())
    return errors.Unavailable(f"engine worker call failed: {error}")


class EngineStream(StreamBookkeeping):
    """One Generate call: iterate for our events; `cancel()` stops the worker."""

    __slots__ = ("_call",)

    def __init__(
        self, call: grpc.aio.UnaryStreamCall, worker: str, on_close: Callable[[Outcome], None]
    ) -> None:
        super().__init__(worker, on_close)
        self._call = call

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        try:
            message = await self._call.read()
        except grpc.RpcError as error:
            failure = _from_rpc_error(error)
            self.close(failure)
            raise failure from None
        if message is grpc.aio.EOF:
            self.close()
            raise StopAsyncIteration
        kind = message.WhichOneof("event")
        if kind == "text":
            text = message.text
            return Text(text.text, text.tokens)
        if kind == "started":
            return Started(message.started.prompt_tokens)
        if kind == "finished":
            finished = message.finished
            reason = _FINISH_REASONS.get(finished.reason, FinishReason.STOP)
            return Finished(reason, finished.completion_tokens)
        failure = errors.Failed(f"engine worker sent an unknown event {kind!r}")
        self.cancel(failure)
        raise failure

    def cancel(self, outcome: Outcome = CANCELLED) -> None:
        """Cancels the call (the worker sees CANCELLED and aborts); `outcome`
        is what the owner hears: our own cancellation, or a failure we saw."""
        self._call.cancel()
        self.close(outcome)


class EngineClient:
    """A worker at one address, over one channel created on the running loop."""

    def __init__(self, address: str, credentials: WorkerCredentials | None = None) -> None:
        self.address = address
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        else:  # TLS, mutual when the credentials hold a client certificate
            options = _CHANNEL_OPTIONS + credentials.options
            self._channel = grpc.aio.secure_channel(address, credentials.credentials, options)
        self._stub = pb_grpc.EngineStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate(
        self,
        request: GenerateRequest,
        timeout: float,
        metadata: tuple[tuple[str, str], ...] = (),
        on_close: Callable[[Outcome], None] = lambda outcome: None,
    ) -> EngineStream:
        """Starts a Generate call with `timeout` seconds as its gRPC deadline."""
        call = self._stub.Generate(to_proto(request), timeout=timeout, metadata=metadata)
        return EngineStream(call, self.address, on_close)

    async def describe(self, deadline: float) -> list[ModelDescription]:
        """The models the worker serves (within `deadline` seconds), or an `EngineError`."""
        try:
            reply = await self._stub.Describe(pb.DescribeRequest(), timeout=deadline)
        except grpc.RpcError as error:
            raise _from_rpc_error(error) from None
        return [ModelDescription(m.name, m.max_context) for m in reply.models]

    async def watch_health(self, poll_interval: float) -> AsyncIterator[bool]:
        """Whether the worker is serving, each time that changes: the health
        Watch stream where the worker has it, else a Check every `poll_interval`
        (a worker without the health service counts as serving). Ends with an
        `EngineError` when the worker cannot be reached."""
        request = health_pb2.HealthCheckRequest(service=HEALTH_SERVICE)
        serving = health_pb2.HealthCheckResponse.SERVING
        try:
            async for reply in self._health.Watch(request):
                yield reply.status == serving
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise _from_rpc_error(error) from None
        while True:
            try:
                reply = await self._health.Check(request, timeout=poll_interval)
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise _from_rpc_error(error) from None
                yield True  # no health service: passive ejection alone judges it
            else:
                yield reply.status == serving
            await asyncio.sleep(poll_interval)

    async def close(self) -> None:
        """Closes the channel, cancelling calls still on it."""
        await self._channel.close()
