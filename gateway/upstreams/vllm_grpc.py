"""vLLM's own gRPC server (`python -m vllm.entrypoints.grpc_server`, service
`vllm.grpc.engine.VllmEngine`, its proto from the `smg-grpc-proto` package) as a
worker: stock vLLM, no code of ours in the engine. It takes token ids and returns
token ids, so the gateway does what vLLM's own front end would:

- the chat template and tokenization (`gateway.tokenization`, the model's
  directory named by `tokenizer:`), then one streamed `Generate` per request;
- incremental detokenization, stop strings (`StopMatcher`), the EOS ids from
  `GetModelInfo` as stop token ids; usage from the engine's counts;
- `GetModelInfo` for `describe`, `grpc.health.v1` and `HealthCheck` for health,
  `GetLoads` for the admin view;
- cancellation as the call's cancel plus an `Abort` of its request id.

Every failure, a gRPC status or a finish reason of `abort` or `error`, goes through
the one table below (`_from_rpc_error`, `FINISH_ERRORS`). SGLang's scheduler protocol
(`SglangScheduler`, same package) would be one more module of this shape: its own
proto messages around the same tokenization.

Cost per request beyond our own protocol: encoding the prompt (Rust, ~µs per 100
tokens) and two decodes of a few tokens per streamed chunk, on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto.generated import vllm_engine_pb2 as pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

from gateway.protocol import errors
from gateway.protocol.status import error_from_status
from gateway.protocol.stop import StopMatcher
from gateway.protocol.tls import WorkerCredentials
from gateway.protocol.types import (
    Event,
    Finished,
    FinishReason,
    GenerateRequest,
    Started,
    Text,
)
from gateway.tokenization import IncrementalDetokenizer, ModelTokenizer, load_tokenizer
from gateway.upstreams.base import CANCELLED, CallEnd, ModelDescription, StreamBookkeeping
from gateway.upstreams.furnace_grpc import _CHANNEL_OPTIONS
from gateway.worker.engine import check_context

#: The engine's finish reasons: answers, or errors of the one tree.
FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}
FINISH_ERRORS: dict[str, type[errors.EngineError]] = {
    "abort": errors.Unavailable,  # aborted by the engine (shutdown, preemption)
    "error": errors.Failed,
}
#: vLLM refuses a prompt beyond its context as INVALID_ARGUMENT with these words.
_TOO_LONG = re.compile(r"maximum (model|context) length|longer than the maximum", re.I)
#: Seconds an `Abort` may take; it is best effort (the call's cancel aborts too).
ABORT_TIMEOUT = 2.0
_ABORTS: set[asyncio.Task[None]] = set()


def _from_rpc_error(error: grpc.RpcError) -> errors.EngineError:
    """The one table from vLLM's statuses to our errors: ours, plus its wording of
    a prompt too long for the context."""
    if not isinstance(error, grpc.aio.AioRpcError):
        return errors.Unavailable(f"vLLM worker call failed: {error}")
    code, details = error.code(), error.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT and _TOO_LONG.search(details):
        return errors.TooLong(details)
    return error_from_status(code, details, None)


class VllmGrpcCall(StreamBookkeeping):
    """One request: prepares on the first read (model info, the prompt's ids), then
    turns the engine's token-id chunks into our events."""

    __slots__ = (
        "_call",
        "_deadline",
        "_detok",
        "_eos",
        "_metadata",
        "_pending",
        "_received",
        "_request",
        "_started",
        "_stop",
        "_unreported",
        "_upstream",
        "request_id",
    )

    def __init__(
        self,
        upstream: VllmGrpcUpstream,
        request: GenerateRequest,
        timeout: float,
        metadata: tuple[tuple[str, str], ...],
        on_close: Callable[[CallEnd], None],
    ) -> None:
        super().__init__(upstream.address, on_close)
        self._upstream = upstream
        self._request = request
        self._deadline = time.monotonic() + timeout
        self._metadata = metadata
        #: The engine's id of the request (unique per attempt), for `Abort`.
        self.request_id = f"{request.request_id or 'furnace'}-{uuid.uuid4().hex[:12]}"
        self._call: grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse] | None = None
        self._pending: deque[Event] = deque()
        self._detok = IncrementalDetokenizer(upstream.tokenizer.decode)
        self._stop = StopMatcher(request.stop)
        self._eos: frozenset[int] = frozenset()
        self._received = 0  # completion tokens seen in chunks
        self._unreported = 0  # of those, the ones no `Text` has counted yet
        self._started = False

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        while not self._pending:
            if self._closed:
                raise StopAsyncIteration
            try:
                if self._call is None:
                    self._call = await self._start()
                message = await self._call.read()
            except grpc.RpcError as error:
                failure = _from_rpc_error(error)
                self.close(failure)
                raise failure from None
            except errors.EngineError as failure:
                self.close(failure)
                raise
            if message is grpc.aio.EOF:
                cut = errors.Unavailable("The vLLM worker ended the answer without finishing.")
                self.close(cut)
                raise cut
            try:
                self._take(message)  # type: ignore[arg-type]
            except errors.EngineError as failure:
                self.cancel(failure)
                raise
        return self._pending.popleft()

    async def _start(self) -> grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse]:
        upstream, request = self._upstream, self._request
        info = await upstream.model_info(max(0.001, self._deadline - time.monotonic()))
        self._eos = frozenset(info.eos_token_ids)
        ids = upstream.tokenizer.prompt_ids(request.prompt, request.messages)
        max_tokens = check_context(request, len(ids), info.max_context_length)
        s = request.sampling
        params = pb.SamplingParams(
            max_tokens=max_tokens,
            stop_token_ids=sorted(self._eos),
            top_p=s.top_p or 0.0,  # 0: the engine's default (1.0)
            top_k=s.top_k or 0,
            presence_penalty=s.presence_penalty or 0.0,
            frequency_penalty=s.frequency_penalty or 0.0,
        )
        if s.temperature is not None:
            params.temperature = s.temperature
        if s.seed is not None:
            params.seed = s.seed
        message = pb.GenerateRequest(
            request_id=self.request_id,
            tokenized=pb.TokenizedInput(input_ids=ids),
            sampling_params=params,
            stream=True,
        )
        timeout = self._deadline - time.monotonic()
        if timeout <= 0:
            raise errors.Timeout("The request's deadline passed before it reached the engine.")
        call: grpc.aio.UnaryStreamCall[pb.GenerateRequest, pb.GenerateResponse]
        call = upstream.stub.Generate(message, timeout=timeout, metadata=self._metadata)
        return call

    def _take(self, message: pb.GenerateResponse) -> None:
        """Our events for one message of the engine: deltas, then how it ended."""
        kind = message.WhichOneof("response")
        if kind == "chunk":
            chunk = message.chunk
            if not self._started:
                self._started = True
                self._pending.append(Started(chunk.prompt_tokens))
            self._text(chunk.token_ids)
        elif kind == "complete":
            done = message.complete
            failure = FINISH_ERRORS.get(done.finish_reason)
            if failure is not None or done.finish_reason not in FINISH_REASONS:
                failure = failure or errors.Failed
                raise failure(f"The vLLM worker ended the answer: {done.finish_reason or '?'}")
            if not self._started:  # nothing streamed before: the engine's counts alone
                self._started = True
                self._pending.append(Started(done.prompt_tokens))
                self._text(done.output_ids)
            self._finish(FINISH_REASONS[done.finish_reason], done.completion_tokens)

    def _text(self, token_ids: Iterable[int]) -> None:
        ids = list(token_ids)
        self._received += len(ids)
        self._unreported += len(ids)
        text = self._detok.feed([i for i in ids if i not in self._eos])
        released, stopped = self._stop.feed(text)
        if released:  # the tokens of a held-back character count with the next text
            self._pending.append(Text(released, self._unreported))
            self._unreported = 0
        if stopped:  # a stop string: the answer ends here, the engine stops
            self._abort()
            self._finish(FinishReason.STOP, self._received, flush=False)

    def _finish(self, reason: FinishReason, completion_tokens: int, *, flush: bool = True) -> None:
        if flush:
            released, stopped = self._stop.feed(self._detok.flush())
            rest = released if stopped else released + self._stop.flush()
            if rest:
                self._pending.append(Text(rest, self._unreported))
            if stopped:
                reason = FinishReason.STOP
        self._pending.append(Finished(reason, max(completion_tokens, self._received)))
        self.close()

    def _abort(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._upstream.abort(self.request_id)

    def cancel(self, outcome: CallEnd = CANCELLED) -> None:
        """Cancels the call and aborts the request on the engine; `outcome` is
        what the owner hears: our own cancellation, or a failure we saw."""
        self._abort()
        self.close(outcome)


#: KV-cache use at which a vLLM engine counts as full (it would preempt or queue).
KV_FULL = 0.98


def engine_load(loads: Iterable[pb.SchedulerLoad]) -> tuple[int, bool]:
    """Requests a vLLM engine runs (summed over its data-parallel ranks), and whether it
    is full: requests waiting in its scheduler, or its KV cache all but used up."""
    running = waiting = 0
    full = False
    for load in loads:
        running += load.num_running_reqs
        waiting += load.num_waiting_reqs
        full = full or load.token_usage >= KV_FULL
    return running, full or waiting > 0


class VllmGrpcUpstream:
    """One vLLM gRPC server, over one channel created on the running loop; the
    model's tokenizer is shared by every worker of the model."""

    def __init__(
        self,
        address: str,
        *,
        model: str,
        tokenizer: str,
        credentials: WorkerCredentials | None = None,
    ) -> None:
        self.address = address
        self.model = model
        self.tokenizer: ModelTokenizer = load_tokenizer(tokenizer)
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        else:
            options = _CHANNEL_OPTIONS + credentials.options
            self._channel = grpc.aio.secure_channel(address, credentials.credentials, options)
        self.stub = pb_grpc.VllmEngineStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._info: pb.GetModelInfoResponse | None = None

    def generate(
        self,
        request: GenerateRequest,
        timeout: float,
        metadata: tuple[tuple[str, str], ...] = (),
        on_close: Callable[[CallEnd], None] = lambda outcome: None,
    ) -> VllmGrpcCall:
        """A call that starts on its first read, within `timeout` seconds."""
        return VllmGrpcCall(self, request, timeout, metadata, on_close)

    async def model_info(self, deadline: float) -> pb.GetModelInfoResponse:
        """The engine's GetModelInfo (context length, EOS ids), asked once."""
        if self._info is None:
            try:
                self._info = await self.stub.GetModelInfo(
                    pb.GetModelInfoRequest(), timeout=deadline
                )
            except grpc.RpcError as error:
                raise _from_rpc_error(error) from None
        return self._info

    async def describe(self, deadline: float) -> list[ModelDescription]:
        """The model this worker serves for the gateway (it has no name of its own
        beyond a path), with the engine's context length."""
        info = await self.model_info(deadline)
        try:
            reply = await self.stub.GetLoads(pb.GetLoadsRequest(), timeout=deadline)
        except grpc.RpcError:  # an engine without load reports is served all the same
            return [ModelDescription(self.model, info.max_context_length)]
        running, full = engine_load(reply.loads)
        return [ModelDescription(self.model, info.max_context_length, None, running, full)]

    def abort(self, request_id: str) -> None:
        """Aborts a request on the engine, in the background (best effort)."""

        async def send() -> None:
            abort = pb.AbortRequest(request_ids=[request_id])
            with contextlib.suppress(grpc.RpcError):  # the call's cancel reaches it as well
                await self.stub.Abort(abort, timeout=ABORT_TIMEOUT)

        task = asyncio.get_running_loop().create_task(send())
        _ABORTS.add(task)
        task.add_done_callback(_ABORTS.discard)

    async def watch_health(self, poll_interval: float) -> AsyncIterator[bool]:
        """Serving when both its grpc.health.v1 and its own HealthCheck say so,
        every `poll_interval`; an `EngineError` when it cannot be reached."""
        request = health_pb2.HealthCheckRequest(service="")
        serving = health_pb2.HealthCheckResponse.SERVING
        while True:
            try:
                reply = await self._health.Check(  # type: ignore[attr-defined]
                    request, timeout=poll_interval
                )
                engine = await self.stub.HealthCheck(pb.HealthCheckRequest(), timeout=poll_interval)
            except grpc.RpcError as error:
                raise _from_rpc_error(error) from None
            yield reply.status == serving and engine.healthy
            await asyncio.sleep(poll_interval)

    async def close(self) -> None:
        """Closes the channel, cancelling calls still on it."""
        await self._channel.close()
