"""Tensor workers: KServe v2 gRPC servers (`inference.GRPCInferenceService`, which Triton,
KServe's model servers and our own tensor worker speak), one grpc.aio channel per worker.

Our tensors (`gateway.protocol.tensors`) become a ModelInfer request with raw little-endian
contents (one bytes field per input: no per-value protobuf cost) and come back from raw or
typed contents, whichever the server sends. A model's metadata is read once and cached per
worker, for the unversioned path and the versions the worker lists only: the version is a
client's string, and a cache keyed by any of them grew without bound (4,000 names of 16 KB
held 64 MB). Health is ServerReady and ModelReady, polled. Every gRPC failure becomes an
`GatewayError` through the one table in `gateway.protocol.status`. Above this module nothing
sees grpc or protobuf; the inference's own types are `gateway.protocol.inference`'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import grpc

from gateway.protocol import errors
from gateway.protocol.inference import InferRequest, InferResult, ModelMetadata, TensorSpec
from gateway.protocol.kserve_v2 import grpc_predict_v2_pb2 as pb
from gateway.protocol.kserve_v2 import grpc_predict_v2_pb2_grpc as pb_grpc
from gateway.protocol.status import error_from_status
from gateway.protocol.tensors import TYPED_CONTENTS, Tensor, check_raw, from_raw, to_raw
from gateway.protocol.tls import WorkerCredentials
from gateway.protocol.types import Embeddings, EmbedRequest, GenerateRequest
from gateway.upstreams.base import CallEnd, ModelDescription, UpstreamCall
from gateway.upstreams.furnace_channel import open_channel


def _from_rpc_error(error: grpc.RpcError) -> errors.GatewayError:
    if isinstance(error, grpc.aio.AioRpcError):
        return error_from_status(error.code(), error.details(), error.trailing_metadata())
    return errors.Unavailable(f"tensor worker call failed: {error}")


def _parameter(value: Any) -> pb.InferParameter:
    if isinstance(value, bool):
        return pb.InferParameter(bool_param=value)
    if isinstance(value, int):
        if value >= 2**63:
            return pb.InferParameter(uint64_param=value)
        return pb.InferParameter(int64_param=value)
    if isinstance(value, float):
        return pb.InferParameter(double_param=value)
    return pb.InferParameter(string_param=str(value))


def _parameters(into: Any, values: Mapping[str, Any]) -> None:
    for key, value in values.items():
        into[key].CopyFrom(_parameter(value))


def _read_parameters(values: Mapping[str, pb.InferParameter]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        choice = value.WhichOneof("parameter_choice")
        if choice is not None:
            out[key] = getattr(value, choice)
    return out


def request_to_proto(request: InferRequest) -> pb.ModelInferRequest:
    message = pb.ModelInferRequest(
        model_name=request.model, model_version=request.version, id=request.id
    )
    _parameters(message.parameters, request.parameters)
    for tensor in request.inputs:
        item = message.inputs.add(name=tensor.name, datatype=tensor.datatype, shape=tensor.shape)
        _parameters(item.parameters, tensor.parameters)
        message.raw_input_contents.append(to_raw(tensor))
    for name in request.outputs:
        message.outputs.add(name=name)
    return message


def result_from_proto(reply: pb.ModelInferResponse) -> InferResult:
    outputs = []
    raw = reply.raw_output_contents
    if raw and len(raw) != len(reply.outputs):
        raise errors.Failed("The tensor worker sent raw contents that do not match its outputs.")
    for i, out in enumerate(reply.outputs):
        shape = tuple(out.shape)
        if raw:
            # checked now, unpacked only if the answer is JSON (binary answers send the bytes)
            data = from_raw(out.datatype, shape, raw[i]) if out.datatype == "BYTES" else []
            if out.datatype != "BYTES":
                check_raw(out.datatype, shape, raw[i])
        else:
            name = TYPED_CONTENTS.get(out.datatype)
            if name is None:
                raise errors.Failed(f"The tensor worker sent {out.datatype} without raw contents.")
            data = list(getattr(out.contents, name))
        outputs.append(
            Tensor(
                out.name,
                out.datatype,
                shape,
                data,
                _read_parameters(out.parameters),
                raw[i] if raw else None,
            )
        )
    return InferResult(
        reply.model_name, reply.model_version, reply.id, outputs, _read_parameters(reply.parameters)
    )


class KServeGrpcUpstream:
    """A tensor worker at one address serving `model`, over one channel made on the loop."""

    def __init__(
        self, address: str, model: str, credentials: WorkerCredentials | None = None
    ) -> None:
        self.address = address
        self.model = model
        self._channel = open_channel(address, credentials)
        self._stub = pb_grpc.GRPCInferenceServiceStub(self._channel)
        self._metadata: dict[str, ModelMetadata] = {}

    async def infer(
        self, request: InferRequest, deadline: float, metadata: tuple[tuple[str, str], ...] = ()
    ) -> InferResult:
        """One ModelInfer with `deadline` seconds as its deadline. An `Unavailable` whose
        `never_started` is true is one the worker never saw (safe to try elsewhere)."""
        was_ready = self._channel.get_state() == grpc.ChannelConnectivity.READY
        try:
            reply = await self._stub.ModelInfer(
                request_to_proto(request), timeout=deadline, metadata=metadata
            )
        except grpc.RpcError as error:
            failure = _from_rpc_error(error)
            code = error.code() if isinstance(error, grpc.aio.AioRpcError) else None
            if code == grpc.StatusCode.UNAVAILABLE and not was_ready:
                failure.never_started = True
            raise failure from None
        return result_from_proto(reply)

    async def model_metadata(self, version: str, deadline: float) -> ModelMetadata:
        """The model's inputs and outputs, read once per version the worker lists (or none)
        and cached; any other version is asked each time and not kept."""
        cached = self._metadata.get(version)
        if cached is not None:
            return cached
        try:
            reply = await self._stub.ModelMetadata(
                pb.ModelMetadataRequest(name=self.model, version=version), timeout=deadline
            )
        except grpc.RpcError as error:
            raise _from_rpc_error(error) from None

        def specs(items: Any) -> tuple[TensorSpec, ...]:
            return tuple(TensorSpec(t.name, t.datatype, tuple(t.shape)) for t in items)

        found = ModelMetadata(
            reply.name,
            tuple(reply.versions),
            reply.platform,
            specs(reply.inputs),
            specs(reply.outputs),
        )
        if not version or version in found.versions:
            self._metadata[version] = found
        return found

    async def ready(self, deadline: float, version: str = "") -> bool:
        """ServerReady and then ModelReady; a `GatewayError` when unreachable."""
        try:
            server = await self._stub.ServerReady(pb.ServerReadyRequest(), timeout=deadline)
            if not server.ready:
                return False
            model = await self._stub.ModelReady(
                pb.ModelReadyRequest(name=self.model, version=version), timeout=deadline
            )
        except grpc.RpcError as error:
            if (
                isinstance(error, grpc.aio.AioRpcError)
                and error.code() == grpc.StatusCode.NOT_FOUND
            ):
                return False
            raise _from_rpc_error(error) from None
        return bool(model.ready)

    # -- what the fleet asks of every upstream -----------------------------------

    def call(
        self,
        request: GenerateRequest,
        timeout: float,
        metadata: tuple[tuple[str, str], ...] = (),
        on_close: Callable[[CallEnd], None] = lambda outcome: None,
    ) -> UpstreamCall:
        raise errors.NotAnLLM(f"The model `{self.model}` is a tensor model.", param="model")

    async def embed(
        self,
        request: EmbedRequest,
        timeout: float,  # noqa: ASYNC109 (the Upstream interface's signature)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> Embeddings:
        raise errors.NotAnLLM(f"The model `{self.model}` is a tensor model.", param="model")

    async def count_tokens(
        self,
        request: GenerateRequest,
        timeout: float,  # noqa: ASYNC109 (the Upstream interface's signature)
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> int:
        raise errors.NotAnLLM(f"The model `{self.model}` is a tensor model.", param="model")

    async def describe(self, deadline: float) -> list[ModelDescription]:
        """The model, when the worker has it ready; no context length for tensors."""
        return [ModelDescription(self.model, 0)] if await self.ready(deadline) else []

    async def watch_health(self, poll_interval: float, deadline: float) -> AsyncIterator[bool]:
        """ServerReady and ModelReady every `poll_interval`, each within `deadline` seconds; a
        `GatewayError` when unreachable."""
        while True:
            yield await self.ready(deadline)
            await asyncio.sleep(poll_interval)

    async def close(self) -> None:
        await self._channel.close()
