"""The KServe v2 gRPC inference service over a tensor engine: what Triton and KServe's model
servers answer, so the gateway's `kserve-grpc` upstream (and any v2 client) reaches it.

Tensors travel raw both ways (`raw_input_contents` in; typed `contents` in are packed raw;
`raw_output_contents` out): the engine gets each input as (datatype, shape, raw bytes) and
decodes them its own way (numpy views for onnxruntime, `struct` for the demo), so this module
needs no numpy. BYTES elements are 4-byte little-endian length prefixes. A bad request is
INVALID_ARGUMENT, an unknown model NOT_FOUND, and so is a version but the one it serves
("1"; none named: that one). TLS as the LLM worker's (`--tls-cert`,
`--tls-key`, `--tls-client-ca`; the files are reloaded when they change).
"""

from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.protocol import errors
from gateway.protocol.grpc_options import MESSAGE_OPTIONS
from gateway.protocol.kserve_v2 import grpc_predict_v2_pb2 as pb
from gateway.protocol.kserve_v2 import grpc_predict_v2_pb2_grpc as pb_grpc
from gateway.protocol.tensors import TYPED_CONTENTS, Tensor, to_raw
from gateway.protocol.tls import ServerTLS, server_credentials
from gateway.worker.tensor.engine import RawTensor, TensorEngine

#: The one version of the engine's model.
VERSION = "1"


class _Invalid(Exception):
    pass


class TensorServicer(pb_grpc.GRPCInferenceServiceServicer):
    """One engine's model over the v2 gRPC service."""

    def __init__(self, engine: TensorEngine) -> None:
        self.engine = engine

    def _check_model(self, name: str, version: str = "") -> bool:
        return name == self.engine.name and version in ("", VERSION)

    async def ServerLive(self, request: Any, context: Any) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Any) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=True)

    async def ServerMetadata(self, request: Any, context: Any) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(name="furnace-tensor-worker", version="1")

    async def ModelReady(self, request: Any, context: Any) -> pb.ModelReadyResponse:
        if not self._check_model(request.name, request.version):
            await context.abort(grpc.StatusCode.NOT_FOUND, _no_model(request.name, request.version))
        return pb.ModelReadyResponse(ready=True)

    async def ModelMetadata(self, request: Any, context: Any) -> pb.ModelMetadataResponse:
        if not self._check_model(request.name, request.version):
            await context.abort(grpc.StatusCode.NOT_FOUND, _no_model(request.name, request.version))
        engine = self.engine

        def specs(items: Any) -> list[pb.ModelMetadataResponse.TensorMetadata]:
            return [
                pb.ModelMetadataResponse.TensorMetadata(
                    name=t.name, datatype=t.datatype, shape=t.shape
                )
                for t in items
            ]

        return pb.ModelMetadataResponse(
            name=engine.name,
            versions=[VERSION],
            platform=engine.platform,
            inputs=specs(engine.inputs),
            outputs=specs(engine.outputs),
        )

    async def ModelInfer(self, request: Any, context: Any) -> pb.ModelInferResponse:
        if not self._check_model(request.model_name, request.model_version):
            name, version = request.model_name, request.model_version
            await context.abort(grpc.StatusCode.NOT_FOUND, _no_model(name, version))
        declared = {t.name: t.datatype for t in self.engine.outputs}
        try:
            inputs = self._inputs(request)
            asked = [o.name for o in request.outputs]
            for name in asked:
                if name not in declared:
                    raise _Invalid(f"no output {name}")
        except _Invalid as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        try:
            results = await self.engine.infer(inputs, asked)
        except errors.Invalid as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error.message)
        except Exception as error:  # the runtime's own errors: a shape it refuses, say
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the model refused: {error}")
        reply = pb.ModelInferResponse(
            model_name=self.engine.name, model_version=VERSION, id=request.id
        )
        for name, (datatype, shape, raw) in results:
            reply.outputs.add(name=name, datatype=datatype, shape=shape)
            reply.raw_output_contents.append(raw)
        return reply

    def _inputs(self, request: Any) -> dict[str, RawTensor]:
        raw = request.raw_input_contents
        if raw and len(raw) != len(request.inputs):
            raise _Invalid("raw_input_contents do not match the inputs")
        out: dict[str, RawTensor] = {}
        for i, tensor in enumerate(request.inputs):
            shape = tuple(tensor.shape)
            if raw:
                out[tensor.name] = (tensor.datatype, shape, raw[i])
                continue
            field = TYPED_CONTENTS.get(tensor.datatype)
            if field is None:
                raise _Invalid(f"{tensor.datatype} needs raw contents")
            values = list(getattr(tensor.contents, field))
            try:
                packed = to_raw(Tensor(tensor.name, tensor.datatype, shape, values))
            except Exception:
                raise _Invalid(f"{tensor.name}: contents do not fit {tensor.datatype}") from None
            out[tensor.name] = (tensor.datatype, shape, packed)
        return out


def _no_model(name: str, version: str) -> str:
    return f"no model {name} version {version}" if version else f"no model {name}"


async def start_tensor_server(
    engine: TensorEngine,
    host: str,
    port: int,
    tls: ServerTLS | None = None,
    servicer: TensorServicer | None = None,
) -> tuple[grpc.aio.Server, int]:
    """A started server on `host:port` (port 0: a free one); returns it and its port. With
    `tls`, TLS (mutual with a client CA) whose files are reloaded when they change, as the
    LLM worker's; `servicer` replaces the plain one over `engine` (tests record calls)."""
    server = grpc.aio.server(options=MESSAGE_OPTIONS)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer or TensorServicer(engine), server)
    # the standard health service too, for Kubernetes' gRPC probes (the chart's pools)
    checks = health.aio.HealthServicer()
    for service in ("", pb.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name):
        await checks.set(service, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    listen = f"{host}:{port}"
    if tls is None:
        bound = server.add_insecure_port(listen)
    else:
        bound = server.add_secure_port(listen, server_credentials(tls))
    if bound == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    return server, bound


async def serve_tensor_worker(
    engine: TensorEngine,
    host: str,
    port: int,
    tls: ServerTLS | None = None,
    drain_timeout: float = 5.0,
) -> None:
    """The tensor worker until SIGTERM or SIGINT; calls in flight get `drain_timeout`
    seconds (`worker --drain-timeout`)."""
    import asyncio
    import signal

    server, _ = await start_tensor_server(engine, host, port, tls)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop(drain_timeout)
