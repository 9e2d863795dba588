"""Every row of the error table, before and after the worker's first event,
streamed and not, against the scripted gRPC worker, reached both ways: on its
multiplexed call, and by a Generate call per request."""

from collections.abc import Iterator

import pytest

from gateway.config import ModelConfig
from gateway.edge.errors import ERROR_TABLE, from_error
from gateway.protocol import errors
from gateway.protocol.status import ERROR_TO_STATUS, error_from_status, status_from_error
from tests.support.requests import sse_events
from tests.support.scripted_worker import script
from tests.support.servers import Gateway, ServerLoop, Workers, make_config, start_gateway


@pytest.fixture(scope="module", params=["GenerateMultiplexed", "Generate"])
def rpc(request: pytest.FixtureRequest) -> str:
    """How the gateway reaches the worker in this module's run."""
    return request.param


@pytest.fixture(scope="module")
def gateway(rpc: str, server_loop: ServerLoop, workers: Workers) -> Iterator[Gateway]:
    """This module's own gateway, for the way of reaching workers under test."""
    config = make_config(workers, multiplex_workers=rpc == "GenerateMultiplexed")
    gw = start_gateway(server_loop, config)
    yield gw
    gw.stop()


def test_the_worker_is_reached_as_configured(client, workers, rpc):
    response = client.post("/v1/completions", json={"model": "scripted", "prompt": script(texts=1)})
    assert response.status_code == 200
    assert workers.scripted.rpcs[response.headers["x-request-id"]] == rpc


TABLE = [
    # (gRPC status, HTTP status, type, code)
    ("INVALID_ARGUMENT", 400, "invalid_request_error", None),
    ("FAILED_PRECONDITION", 400, "invalid_request_error", None),
    ("UNIMPLEMENTED", 400, "invalid_request_error", None),
    ("OUT_OF_RANGE", 400, "invalid_request_error", "context_length_exceeded"),
    ("NOT_FOUND", 404, "invalid_request_error", "model_not_found"),
    ("RESOURCE_EXHAUSTED", 503, "server_error", "server_busy"),
    ("UNAVAILABLE", 503, "server_error", "engine_unavailable"),
    ("ABORTED", 503, "server_error", "engine_unavailable"),
    ("CANCELLED", 503, "server_error", "engine_unavailable"),
    ("DEADLINE_EXCEEDED", 504, "server_error", "timeout"),
    ("UNAUTHENTICATED", 502, "server_error", "engine_auth_failed"),
    ("PERMISSION_DENIED", 502, "server_error", "engine_auth_failed"),
    ("INTERNAL", 500, "server_error", "engine_error"),
    ("UNKNOWN", 500, "server_error", "engine_error"),
    ("DATA_LOSS", 500, "server_error", "engine_error"),
]


def check_error(response, status, type_, code):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == type_
    assert error["code"] == code
    assert error["message"]
    if status == 503:
        assert response.headers["retry-after"] == "1"
    else:
        assert "retry-after" not in response.headers


@pytest.mark.parametrize(("grpc_status", "status", "type_", "code"), TABLE)
@pytest.mark.parametrize("stream", [False, True])
def test_refusal_before_the_first_event(client, grpc_status, status, type_, code, stream):
    prompt = script(status=grpc_status)
    response = client.post(
        "/v1/completions", json={"model": "scripted", "prompt": prompt, "stream": stream}
    )
    check_error(response, status, type_, code)


@pytest.mark.parametrize(("grpc_status", "status", "type_", "code"), TABLE)
def test_failure_after_the_first_event_not_streamed(client, grpc_status, status, type_, code):
    prompt = script(texts=2, status=grpc_status)
    response = client.post("/v1/completions", json={"model": "scripted", "prompt": prompt})
    check_error(response, status, type_, code)


@pytest.mark.parametrize(("grpc_status", "status", "type_", "code"), TABLE)
def test_failure_after_the_first_event_streamed(client, grpc_status, status, type_, code):
    messages = [{"role": "user", "content": script(texts=2, status=grpc_status)}]
    response = client.post(
        "/v1/chat/completions", json={"model": "scripted", "messages": messages, "stream": True}
    )
    assert response.status_code == 200
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert (error["type"], error["code"]) == (type_, code)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-2])
    assert text == "t0 t1 "  # what came before the failure was delivered


def test_invalid_argument_names_the_workers_parameter(client):
    prompt = script(status="INVALID_ARGUMENT", param="top_k")
    for stream in (False, True):
        response = client.post(
            "/v1/completions", json={"model": "scripted", "prompt": prompt, "stream": stream}
        )
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "top_k"


def test_stream_that_ends_without_finishing(client):
    prompt = script(texts=1, end="eof")
    response = client.post("/v1/completions", json={"model": "scripted", "prompt": prompt})
    check_error(response, 500, "server_error", "engine_error")
    response = client.post(
        "/v1/completions", json={"model": "scripted", "prompt": prompt, "stream": True}
    )
    events = sse_events(response.text)
    assert events[-2]["error"]["code"] == "engine_error"
    assert events[-1] == "[DONE]"


def test_unreachable_worker_is_503_at_once(gateway_with):
    dead = ModelConfig("dead", workers=("127.0.0.1:1",))
    gw = gateway_with(models=(dead,))
    import httpx

    for stream in (False, True):
        response = httpx.post(
            gw.url + "/v1/completions",
            json={"model": "dead", "prompt": "x", "stream": stream},
            timeout=30,
        )
        check_error(response, 503, "server_error", "engine_unavailable")


def test_context_length_from_the_demo_engine(client):
    response = client.post("/v1/completions", json={"prompt": "w " * 64})
    check_error(response, 400, "invalid_request_error", "context_length_exceeded")
    assert "maximum context length is 64" in response.json()["error"]["message"]
    assert "no room for any output tokens" in response.json()["error"]["message"]
    response = client.post("/v1/completions", json={"prompt": "a b", "max_tokens": 65})
    check_error(response, 400, "invalid_request_error", None)
    assert response.json()["error"]["param"] == "max_tokens"


def test_the_gateways_refusals_are_not_engine_errors_and_each_error_has_its_rows():
    """One tree (`gateway/protocol/errors.py`): each error is a `Refusal` (the request
    refused as asked: the gateway's checks, limits, drain and capacity, or a worker's of
    those kinds) or an `EngineError` (the worker or its engine failed), never both, but
    `ShutDown` (the gateway's own stop mid-answer); each has its row in the HTTP table and
    a status a worker sends for it."""
    bases = {errors.GatewayError, errors.Refusal, errors.EngineError}
    kinds = [
        kind
        for kind in vars(errors).values()
        if isinstance(kind, type) and issubclass(kind, errors.GatewayError) and kind not in bases
    ]
    assert len(kinds) == len(ERROR_TABLE)
    for kind in kinds:
        if kind is not errors.ShutDown:
            assert issubclass(kind, errors.Refusal) != issubclass(kind, errors.EngineError), kind
        assert kind in ERROR_TABLE, kind
        assert any(issubclass(kind, known) for known in ERROR_TO_STATUS), kind
    refused_here = (errors.Invalid, errors.CannotCount, errors.TooLong, errors.ModelNotFound)
    refused_here += (errors.NotAnLLM,)
    refused_here += (errors.Busy, errors.Draining, errors.RateLimited, errors.BudgetExceeded)
    assert all(issubclass(kind, errors.Refusal) for kind in refused_here)
    failed = (errors.Unavailable, errors.Timeout, errors.AuthFailed, errors.Failed)
    assert all(issubclass(kind, errors.EngineError) for kind in failed)


def test_an_upstream_that_cannot_count_is_answered_as_an_invalid_naming_model():
    """`CannotCount` tells the routes that count to edit a prompt that the model's upstream
    counts no tokens; elsewhere it is the `Invalid` naming `model` it stands for, to the
    client and on the wire, where its class does not cross: `CannotCount.of` reads it back
    from a count's refusal naming `model`, and leaves any other as it is."""
    error = errors.CannotCount("The model's upstream server cannot count tokens.", param="model")
    plain = errors.Invalid(error.message, param="model")
    sent, same = from_error(error, 1), from_error(plain, 1)
    assert (sent.status, sent.fields(), sent.body(), sent.outcome, sent.reason) == (
        same.status,
        same.fields(),
        same.body(),
        same.outcome,
        same.reason,
    )
    assert sent.status == 400 and sent.param == "model" and sent.retry_after is None
    assert status_from_error(error) == status_from_error(plain)
    code, trailing = status_from_error(error)
    arrived = error_from_status(code, error.message, dict(trailing))
    assert type(arrived) is errors.Invalid
    read = errors.CannotCount.of(arrived)
    assert type(read) is errors.CannotCount
    assert (read.message, read.param) == (error.message, "model")
    others = [
        errors.Invalid("bad", param="messages"),
        errors.Invalid("bad"),
        errors.ModelNotFound("gone", param="model"),
        errors.NotAnLLM("tensor", param="model"),
        errors.Failed("broke"),
    ]
    assert all(errors.CannotCount.of(other) is other for other in others)
