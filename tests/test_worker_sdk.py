"""The worker SDK over real gRPC: stop strings, coalescing, cancellation and
deadlines reaching the engine, refusals as statuses, Describe and health."""

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.protocol import errors
from gateway.protocol.features import INCLUDE_STOP
from gateway.protocol.stop import StopMatcher
from gateway.protocol.types import Finished, FinishReason, Started, Text
from gateway.protocol.v1 import engine_pb2 as pb
from gateway.protocol.v1 import engine_pb2_grpc as pb_grpc
from gateway.worker.demo import DemoEngine
from tests.support.script_engine import ScriptEngine
from tests.support.waiting import wait_until


async def collect(address: str, **fields) -> tuple[list, grpc.aio.AioRpcError | None]:
    """All events of one Generate call, and the error that ended it, if any."""
    fields.setdefault("text", "x")
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.EngineStub(channel)
        events = []
        try:
            async for event in stub.Generate(pb.GenerateRequest(**fields), timeout=30):
                events.append(event)
        except grpc.aio.AioRpcError as error:
            return events, error
        return events, None


# -- stop strings ----------------------------------------------------------


@pytest.mark.parametrize(
    ("pieces", "stops", "released", "stopped"),
    [
        (["hello", " world"], ("STOP",), "hello world", False),
        (["a b ", "STOP", " c"], ("STOP",), "a b ", True),
        (["a b S", "TO", "P c"], ("STOP",), "a b ", True),  # straddles three pieces
        (["ab", "c"], ("bcd",), "abc", False),  # a prefix that never completes
        (["x END y"], ("zzz", "END"), "x ", True),
        (["x"], (), "x", False),
    ],
)
def test_stop_matcher(pieces, stops, released, stopped):
    matcher = StopMatcher(stops)
    out, hit = [], False
    for piece in pieces:
        text, hit = matcher.feed(piece)
        out.append(text)
        if hit:
            break
    if not hit:
        out.append(matcher.flush())
    assert "".join(out) == released
    assert hit == stopped


def test_stop_strings_through_the_gateway(client, workers):
    body = {"model": "furnace-demo", "prompt": "one two STOP three", "stop": ["STOP"]}
    for stream in (False, True):
        response = client.post("/v1/completions", json={**body, "stream": stream})
        if stream:
            assert '"finish_reason":"stop"' in response.text
            assert "three" not in response.text and "STOP" not in response.text
        else:
            choice = response.json()["choices"][0]
            assert choice["text"] == "one two "
            assert choice["finish_reason"] == "stop"
            assert response.json()["usage"]["completion_tokens"] == 3
    body = {"model": "furnace-slow", "prompt": "alpha beta gamma delta", "stop": "a gam"}
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == "alpha bet"


# -- coalescing, cancellation, deadlines ------------------------------------


def test_ready_tokens_are_coalesced(server_loop, serve_engines):
    worker = serve_engines(DemoEngine("big", max_context=10_000))[0]
    words = " ".join(f"w{i}" for i in range(500))
    events, error = server_loop.call(collect(worker.address, text=words))
    assert error is None
    texts = [e.text for e in events if e.WhichOneof("event") == "text"]
    assert sum(t.tokens for t in texts) == 500
    assert "".join(t.text for t in texts) == words
    assert len(texts) < 100  # far fewer messages than tokens
    assert events[-1].finished.completion_tokens == 500


def test_paced_tokens_go_one_by_one(server_loop, workers):
    events, _ = server_loop.call(collect(workers.slow.address, text="a b c d"))
    texts = [e.text for e in events if e.WhichOneof("event") == "text"]
    assert [t.text for t in texts] == ["a", " b", " c", " d"]


def test_deadline_stops_the_engine(server_loop, workers):
    engine = workers.slow_engine
    aborted = engine.aborted

    async def call() -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(workers.slow.address) as channel:
            stub = pb_grpc.EngineStub(channel)
            try:
                async for _ in stub.Generate(pb.GenerateRequest(text="w " * 500), timeout=0.3):
                    pass
            except grpc.aio.AioRpcError as error:
                return error.code()
        return grpc.StatusCode.OK

    assert server_loop.call(call()) == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: engine.aborted == aborted + 1, "the engine to stop")
    wait_until(lambda: engine.running == 0, "the engine to be idle")


def test_cancel_stops_the_engine(server_loop, workers):
    engine = workers.slow_engine
    aborted = engine.aborted

    async def call() -> None:
        async with grpc.aio.insecure_channel(workers.slow.address) as channel:
            stream = pb_grpc.EngineStub(channel).Generate(pb.GenerateRequest(text="w " * 500))
            await stream.read()
            await stream.read()
            stream.cancel()

    server_loop.call(call())
    wait_until(lambda: engine.aborted == aborted + 1, "the engine to stop")
    wait_until(lambda: workers.slow.service.active == 0, "the worker to be idle")


# -- refusals and failures ---------------------------------------------------


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (errors.TooLong("too long"), grpc.StatusCode.OUT_OF_RANGE),
        (errors.Invalid("bad", param="top_k"), grpc.StatusCode.INVALID_ARGUMENT),
        (errors.Busy("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (errors.Unavailable("down"), grpc.StatusCode.UNAVAILABLE),
        (errors.Failed("broken"), grpc.StatusCode.INTERNAL),
        (RuntimeError("a bug"), grpc.StatusCode.INTERNAL),
    ],
)
def test_engine_errors_become_statuses(server_loop, serve_engines, error, code):
    for events in ([error], [Started(1), Text("a", 1), error]):
        worker = serve_engines(ScriptEngine(events))[0]
        received, failure = server_loop.call(collect(worker.address))
        assert failure is not None
        assert failure.code() == code
        if isinstance(error, errors.Invalid):
            assert ("furnace-param", "top_k") in tuple(failure.trailing_metadata())
        if isinstance(error, RuntimeError):
            assert "a bug" not in failure.details()  # internals stay inside the worker
        assert len(received) == (0 if len(events) == 1 else 2)


def test_engine_that_breaks_the_protocol(server_loop, serve_engines):
    for events in ([Text("a", 1)], [Started(1), Text("a", 1)]):
        worker = serve_engines(ScriptEngine(events))[0]
        _, failure = server_loop.call(collect(worker.address))
        assert failure is not None and failure.code() == grpc.StatusCode.INTERNAL


def test_other_model_is_not_found(server_loop, workers):
    _, failure = server_loop.call(collect(workers.demo.address, model="other"))
    assert failure.code() == grpc.StatusCode.NOT_FOUND


def test_capacity_is_enforced(server_loop, serve_engines):
    worker = serve_engines(DemoEngine("tiny", token_delay=0.05, capacity=1))[0]

    async def one_then_another() -> tuple:
        async with grpc.aio.insecure_channel(worker.address) as channel:
            first = pb_grpc.EngineStub(channel).Generate(pb.GenerateRequest(text="w " * 10))
            await first.read()  # the first holds the only place
            second = await collect(worker.address, text="w")
            rest = []
            while (event := await first.read()) is not grpc.aio.EOF:
                rest.append(event)
            return rest, second

    rest, (_, second_error) = server_loop.call(one_then_another())
    assert rest[-1].finished.completion_tokens == 10
    assert second_error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_finish_reasons_and_counts(server_loop, serve_engines):
    (worker,) = serve_engines(
        ScriptEngine([Started(4), Text("ab", 2), Finished(FinishReason.LENGTH, 2)])
    )
    events, error = server_loop.call(collect(worker.address))
    assert error is None
    assert events[0].started.prompt_tokens == 4
    assert events[-1].finished.reason == pb.FINISH_REASON_LENGTH
    assert events[-1].finished.completion_tokens == 2


# -- Describe and health -----------------------------------------------------


def test_describe(server_loop, workers):
    async def describe() -> pb.DescribeResponse:
        async with grpc.aio.insecure_channel(workers.demo.address) as channel:
            return await pb_grpc.EngineStub(channel).Describe(pb.DescribeRequest(), timeout=5)

    reply = server_loop.call(describe())
    assert [(m.name, m.max_context) for m in reply.models] == [("furnace-demo", 64)]
    # "n" among them; the SDK matches the stop strings, so it keeps one where asked
    assert list(reply.models[0].features) == sorted(DemoEngine.features | {INCLUDE_STOP})
    assert reply.capacity == 256
    assert reply.load == 0


def test_health(server_loop, serve_engines):
    worker = serve_engines(DemoEngine("h"))[0]

    async def check(service: str) -> int:
        async with grpc.aio.insecure_channel(worker.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            return reply.status

    serving = health_pb2.HealthCheckResponse.SERVING
    assert server_loop.call(check("")) == serving
    assert server_loop.call(check("furnace.engine.v1.Engine")) == serving
