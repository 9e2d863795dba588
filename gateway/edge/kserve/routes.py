"""The KServe v2 (Open Inference Protocol) REST routes for `kind: tensor` models.

`POST /v2/models/{m}[/versions/{v}]/infer` reads JSON tensors, checks them (datatype, shape
against data length, value types and ranges, and against the model's metadata: unknown or
missing inputs, datatypes, shapes) and answers 400 before any worker is called; then it goes
the way of an LLM request: the key's allow-list, the drain, the team's limits and a slot, the
fleet's balancing and ejection, `request_timeout` as the worker's deadline, a client that
leaves cancels the worker's call, one record in the metrics and the access log, and with
`tracing` a SERVER span for the request and a CLIENT span for the worker call, whose
`traceparent` travels to the worker as gRPC metadata. `GET /v2/models/{m}[/versions/{v}]`
(the metadata, which may cost a worker call: the version is the client's) is admitted and
counted the same way, and so is `GET /v2/models/{m}/versions/{v}/ready`, which asks for that
version's metadata (a worker that does not serve it makes it a 404, as for infer). Errors are
`{"error": "..."}` with the status of the one error table (`edge/errors.py`). No grpc here:
the upstream converts. Cost: the tensors are Python lists (see protocol/tensors.py).
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.routing import Route

from gateway import __version__
from gateway.admission.admit import tensor_pool
from gateway.edge.asgi import Receive, Scope, Send, send_json
from gateway.edge.errors import APIError, from_error
from gateway.edge.openai.body import parse_json, read_body
from gateway.edge.request import Exchange, Parts, RequestRoute
from gateway.fleet.inference import infer, model_metadata
from gateway.protocol import errors
from gateway.protocol.deadline import Deadline
from gateway.protocol.errors import Outcome
from gateway.protocol.inference import InferRequest, ModelMetadata
from gateway.protocol.tensors import Tensor, tensor_from_binary, tensor_from_json, to_raw
from gateway.teams import team_of

#: The CLIENT span's name for a worker call: the gRPC method it is.
MODEL_INFER = "inference.GRPCInferenceService/ModelInfer"


async def _send(send: Send, status: int, body: Any, request_id: bytes = b"") -> int:
    """Sends a JSON answer; returns the body's length in bytes."""
    headers = [(b"x-request-id", request_id)] if request_id else []
    data = orjson.dumps(body)
    await send_json(send, status, data, headers)
    return len(data)


class _Tensors(Exchange):
    """A tensor request, with its body bytes read and written, for the metrics."""

    __slots__ = ("received", "sent")

    def __init__(self, *args: Any) -> None:  # the frame's (`Exchange`)
        super().__init__(*args)
        self.received = 0
        self.sent = 0


def _invalid(message: str) -> errors.Invalid:
    return errors.Invalid(message)


def _shape_fits(shape: tuple[int, ...], declared: tuple[int, ...]) -> bool:
    if not declared:
        return True
    return len(shape) == len(declared) and all(
        d in (-1, s) for s, d in zip(shape, declared, strict=True)
    )


HEADER_LENGTH = b"inference-header-content-length"


def _split(scope: Scope, body: bytes) -> tuple[Any, bytes]:
    """The JSON part of the body and the binary part after it (the binary tensor extension:
    `Inference-Header-Content-Length` says where the JSON ends)."""
    length = next((v for k, v in scope["headers"] if k == HEADER_LENGTH), None)
    if length is None:
        if not body:
            raise _invalid("The request body is empty; expected a JSON object.")
        return parse_json(body), b""
    try:
        size = int(length)
    except ValueError:
        raise _invalid("Inference-Header-Content-Length is not a number.") from None
    if not 0 < size <= len(body):
        raise _invalid("Inference-Header-Content-Length is not within the body.")
    return parse_json(body[:size]), body[size:]


def _binary_size(raw: Any) -> int | None:
    parameters = raw.get("parameters") if isinstance(raw, dict) else None
    size = parameters.get("binary_data_size") if isinstance(parameters, dict) else None
    if size is None:
        return None
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise _invalid("binary_data_size: expected a non-negative integer")
    return size


def _inputs(raw_inputs: list[Any], binary: bytes) -> list[Tensor]:
    inputs = []
    offset = 0
    for i, raw in enumerate(raw_inputs):
        size = _binary_size(raw)
        if size is None:
            inputs.append(tensor_from_json(raw, f"inputs[{i}]"))
            continue
        if offset + size > len(binary):
            raise _invalid(f"inputs[{i}]: binary_data_size passes the end of the body")
        inputs.append(tensor_from_binary(raw, binary[offset : offset + size], f"inputs[{i}]"))
        offset += size
    if offset != len(binary):
        raise _invalid("The body holds binary data no input claims.")
    return inputs


def _parse(body: Any, model: str, version: str, binary: bytes = b"") -> InferRequest:
    if not isinstance(body, dict):
        raise _invalid("The request body must be a JSON object.")
    raw_inputs = body.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise _invalid("inputs: expected a non-empty list of tensors")
    inputs = _inputs(raw_inputs, binary)
    raw_outputs = body.get("outputs") or []
    if not isinstance(raw_outputs, list) or not all(
        isinstance(o, dict) and isinstance(o.get("name"), str) for o in raw_outputs
    ):
        raise _invalid("outputs: expected a list of objects with a name")
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise _invalid("parameters: expected an object")
    request_id = body.get("id", "")
    if not isinstance(request_id, str):
        raise _invalid("id: expected a string")
    names = [t.name for t in inputs]
    if len(set(names)) != len(names):
        raise _invalid("inputs: a name appears twice")
    return InferRequest(
        model, version, inputs, [o["name"] for o in raw_outputs], request_id, parameters
    )


def _check_against(request: InferRequest, meta: ModelMetadata) -> None:
    """The request against the model's declared inputs and outputs."""
    model = request.model
    names = {t.name for t in request.inputs}
    declared = {t.name: t for t in meta.inputs}
    for tensor in request.inputs:
        spec = declared.get(tensor.name)
        if spec is None:
            raise _invalid(f"inputs: the model `{model}` has no input `{tensor.name}`")
        if spec.datatype != tensor.datatype:
            raise _invalid(f"inputs: `{tensor.name}` is {spec.datatype}, got {tensor.datatype}")
        if not _shape_fits(tensor.shape, spec.shape):
            raise _invalid(
                f"inputs: `{tensor.name}` has shape {list(tensor.shape)}, "
                f"the model takes {list(spec.shape)}"
            )
    missing = [name for name in declared if name not in names]
    if missing:
        raise _invalid(f"inputs: missing {', '.join(missing)}")
    outputs = {t.name for t in meta.outputs}
    for name in request.outputs:
        if outputs and name not in outputs:
            raise _invalid(f"outputs: the model `{model}` has no output `{name}`")


def _binary_outputs(body: dict[str, Any]) -> bool | set[str]:
    """Which outputs go back as binary data: all (`binary_data_output`), those asked for with
    `binary_data: true`, or none."""
    parameters = body.get("parameters") or {}
    if parameters.get("binary_data_output") is True:
        return True
    return {
        o["name"]
        for o in body.get("outputs") or []
        if isinstance(o.get("parameters"), dict) and o["parameters"].get("binary_data") is True
    }


def _model_and_version(scope: Scope) -> tuple[str, str]:
    """The path's model and version."""
    params = scope.get("path_params", {})
    return params.get("model", ""), params.get("version", "")


class KServeRoutes:
    """The /v2 routes over the gateway's parts."""

    def __init__(self, parts: Parts, *, is_ready: Any) -> None:
        self.config = parts.config
        self.fleet = parts.fleet
        self.is_ready = is_ready
        self.infer = InferRoute(parts)
        self.metadata = MetadataRoute(parts)
        self.version_ready = VersionReadyRoute(parts)

    def routes(self) -> list[Route]:
        model = "/v2/models/{model}"
        versioned = "/v2/models/{model}/versions/{version}"
        out = [
            Route("/v2/health/live", self._asgi(self.live), methods=["GET"]),
            Route("/v2/health/ready", self._asgi(self.ready), methods=["GET"]),
            Route("/v2", self._asgi(self.server), methods=["GET"]),
        ]
        ready: dict[str, Any] = {model: self._asgi(self.model_ready), versioned: self.version_ready}
        for path in (model, versioned):
            out += [
                Route(path, self.metadata, methods=["GET"]),
                Route(path + "/ready", ready[path], methods=["GET"]),
                Route(path + "/infer", self.infer, methods=["POST"]),
            ]
        return out

    def _asgi(self, handler: Any) -> _Endpoint:
        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            try:
                status, body = await handler(scope)
            except errors.GatewayError as error:
                api = from_error(error, self.config.retry_after)
                status, body = api.status, {"error": api.message}
            await _send(send, status, body)

        return _Endpoint(app)

    # -- health and metadata ----------------------------------------------------

    async def live(self, scope: Scope) -> tuple[int, Any]:
        return 200, {"live": True}

    async def ready(self, scope: Scope) -> tuple[int, Any]:
        ready = bool(self.is_ready())
        return (200 if ready else 503), {"ready": ready}

    async def server(self, scope: Scope) -> tuple[int, Any]:
        return 200, {"name": "furnace-gateway", "version": __version__, "extensions": []}

    async def model_ready(self, scope: Scope) -> tuple[int, Any]:
        """`GET /v2/models/{m}/ready`: a healthy worker (`VersionReadyRoute` for a version)."""
        pool = tensor_pool(self.fleet, team_of(scope), _model_and_version(scope)[0])
        ready = bool(pool.available(set()))
        return (200 if ready else 503), {"name": pool.name, "ready": ready}


class _TensorRoute(RequestRoute[_Tensors]):
    """A /v2 route in the edge's request frame (request.py); its own: refusals as
    `{"error": "..."}` without Retry-After, and each request's body bytes in and out
    in the tensor metrics."""

    exchange = _Tensors

    async def _refuse(self, ex: _Tensors, error: APIError) -> None:
        record = ex.record
        record.status, record.outcome, record.reason = error.status, error.outcome, error.reason
        request_id = record.request_id.encode("latin-1")
        ex.sent = await _send(ex.send, error.status, {"error": error.message}, request_id)

    def _finished(self, ex: _Tensors) -> None:
        if ex.record.model:
            self.telemetry.metrics.tensor_bytes(ex.record.model, ex.received, ex.sent)


class MetadataRoute(_TensorRoute):
    """`GET /v2/models/{m}[/versions/{v}]`: the model's metadata, read from a worker (cached
    by the upstream for the versions the worker lists), admitted and counted like any call:
    the version is the client's choice, so an uncached one costs a worker call."""

    async def serve(self, ex: _Tensors) -> None:
        name, version = _model_and_version(ex.scope)
        self.admission.draining(ex.ctx)
        pool = self.admission.visibility(ex.ctx, name, "tensor")
        async with self.admission.admit(ex.ctx):  # one request and no tokens to its team
            meta = await model_metadata(pool, version)
        ex.record.status, ex.record.outcome = 200, Outcome.COMPLETED
        request_id = ex.record.request_id.encode("latin-1")
        ex.sent = await _send(ex.send, 200, meta.to_json(), request_id)


class VersionReadyRoute(_TensorRoute):
    """`GET /v2/models/{m}/versions/{v}/ready`: a healthy worker that serves the version.
    The version is checked as the metadata route reads it (a version the worker lists is
    cached; another is asked of the worker, whose refusal is a 404), so it is admitted and
    counted as that route is."""

    async def serve(self, ex: _Tensors) -> None:
        name, version = _model_and_version(ex.scope)
        self.admission.draining(ex.ctx)
        pool = self.admission.visibility(ex.ctx, name, "tensor")
        if not pool.available(set()):
            raise pool.no_worker()
        async with self.admission.admit(ex.ctx):
            await model_metadata(pool, version)
        ex.record.status, ex.record.outcome = 200, Outcome.COMPLETED
        request_id = ex.record.request_id.encode("latin-1")
        ex.sent = await _send(ex.send, 200, {"name": pool.name, "ready": True}, request_id)


class InferRoute(_TensorRoute):
    """`POST .../infer`."""

    async def serve(self, ex: _Tensors) -> None:
        """Reads and checks the tensors against the model before any worker, admits the
        request, calls a worker (the drain or the client's leaving cancels it) and answers
        in JSON or with the binary tensor extension."""
        scope, send, record, ctx = ex.scope, ex.send, ex.record, ex.ctx
        name, version = _model_and_version(scope)
        meter = self.admission.before_body(ctx)
        raw_body = await read_body(scope, ex.receive, self.config.max_body_bytes, meter)
        ex.received = len(raw_body)
        body, binary = _split(scope, raw_body)
        pool = self.admission.visibility(ctx, name, "tensor")
        # the tensors themselves, before any worker
        request = _parse(body, pool.name, version, binary)
        binary_outputs = _binary_outputs(body)
        ex.watch_client()
        # one request and no tokens to a team's limits (an infer generates none)
        async with self.admission.admit(ctx):
            # within the team's limits: a version not cached costs a worker call
            _check_against(request, await model_metadata(pool, version))
            with self.tracing.engine_call(pool.name, ex.metadata, MODEL_INFER) as (_, metadata):
                deadline = Deadline(self.config.request_timeout)
                work = infer(self.fleet, pool, request, deadline, metadata)
                result = await self.admission.unary(ctx, work, None, "The inference")
        request_id = record.request_id.encode("latin-1")
        answer = result.to_json()
        if not binary_outputs:
            data = orjson.dumps(answer)
            # 200 once all is encoded: a failure before it is a 500, not a broken answer
            record.status, record.outcome = 200, Outcome.COMPLETED
            await send_json(send, 200, data, [(b"x-request-id", request_id)])
            ex.sent = len(data)
            return
        blobs = []
        for tensor, out in zip(result.outputs, answer["outputs"], strict=True):
            if binary_outputs is True or tensor.name in binary_outputs:
                blob = to_raw(tensor)
                del out["data"]
                out["parameters"] = {**out.get("parameters", {}), "binary_data_size": len(blob)}
                blobs.append(blob)
        header = orjson.dumps(answer)
        headers = [
            (b"content-type", b"application/octet-stream"),
            (HEADER_LENGTH, str(len(header)).encode()),
            (b"x-request-id", request_id),
        ]
        payload = header + b"".join(blobs)
        record.status, record.outcome = 200, Outcome.COMPLETED
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        ex.sent = len(payload)
        await send({"type": "http.response.body", "body": payload})


class _Endpoint:
    """A raw ASGI endpoint (Starlette calls functions and methods with a Request)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)
