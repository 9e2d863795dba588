"""A worker's life around its engine's: it listens and says NOT_SERVING while the
engine starts (vLLM loads for seconds to minutes), SERVING once it is up, NOT_SERVING
for good when the engine dies; an engine that fails to start stops the worker;
stopping the worker shuts the engine down; `Describe` reports the engine's own load
where it keeps one. And the `worker` command imports nothing of the gateway's server,
so it runs in an engine's own environment (vLLM's). After SIGTERM, calls in flight
get `--drain-timeout` seconds while new ones are refused."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.cli import main
from gateway.protocol.v1 import engine_pb2, engine_pb2_grpc
from gateway.worker.demo import DemoEngine
from gateway.worker.server import SERVICE_NAME, WorkerServer
from tests.support.processes import free_port, listening
from tests.support.servers import ServerLoop
from tests.support.waiting import HANG_GUARD, wait_until


class GatedEngine(DemoEngine):
    """The demo engine with a life of its own: up when `up` is set, dead when `dead` is."""

    def __init__(self) -> None:
        super().__init__("furnace-gated")
        self.up = asyncio.Event()
        self.dead = asyncio.Event()
        self.shut_down = False
        self.fail_start = False
        self.own_load: int | None = None

    async def start(self) -> None:
        await self.up.wait()
        if self.fail_start:
            raise RuntimeError("no memory for the KV cache")

    async def wait_dead(self) -> None:
        await self.dead.wait()

    async def shutdown(self) -> None:
        self.shut_down = True

    def load(self) -> int | None:
        return self.own_load


def _health(port: int) -> str:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _describe(port: int) -> engine_pb2.DescribeResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = engine_pb2_grpc.EngineStub(channel)
        return stub.Describe(engine_pb2.DescribeRequest(), timeout=5)


async def _set(event: asyncio.Event) -> None:
    event.set()


def test_not_serving_until_the_engine_is_up_and_once_it_died(server_loop: ServerLoop):
    engine = GatedEngine()
    server = WorkerServer(engine, port=free_port())
    starting = asyncio.run_coroutine_threadsafe(server.start(), server_loop.loop)
    wait_until(lambda: listening(server.port), "the worker to listen")
    assert _health(server.port) == "NOT_SERVING"
    assert not starting.done()

    server_loop.call(_set(engine.up))
    starting.result(HANG_GUARD)
    assert _health(server.port) == "SERVING"

    server_loop.call(_set(engine.dead))
    wait_until(lambda: _health(server.port) == "NOT_SERVING", "NOT_SERVING once the engine died")
    assert server.engine_dead
    server_loop.call(server.stop(0))
    assert engine.shut_down


def test_an_engine_that_fails_to_start_stops_the_worker(server_loop: ServerLoop):
    engine = GatedEngine()
    engine.fail_start = True
    server = WorkerServer(engine, port=free_port())
    starting = asyncio.run_coroutine_threadsafe(server.start(), server_loop.loop)
    wait_until(lambda: listening(server.port), "the worker to listen")
    server_loop.call(_set(engine.up))
    with pytest.raises(RuntimeError, match="KV cache"):
        starting.result(HANG_GUARD)
    assert not listening(server.port)


def test_describe_reports_the_engines_own_load(server_loop: ServerLoop):
    engine = GatedEngine()
    engine.up.set()  # not waited on yet: no loop holds it
    server = WorkerServer(engine, port=free_port())
    server_loop.call(server.start())
    try:
        assert _describe(server.port).load == 0  # the calls it serves: none
        engine.own_load = 5
        assert _describe(server.port).load == 5
    finally:
        server_loop.call(server.stop(0))


def test_the_worker_command_loads_nothing_of_the_server():
    server_only = ("starlette", "uvicorn", "httpx", "redis", "prometheus_client", "yaml", "orjson")
    code = (
        "import sys; import gateway.cli, gateway.worker.serve; "
        f"print(','.join(m for m in {server_only!r} + ('gateway.lifecycle', 'gateway.config') "
        "if m in sys.modules))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert loaded == ""


def test_engine_options_are_only_for_vllm(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_:
        main(["worker", "--engine", "demo", "--enforce-eager"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --enforce-eager" in capsys.readouterr().err


# -- the drain after SIGTERM -------------------------------------------------------

#: The demo's pace here: a 70-word echo streams for 7 s, past the old fixed 5 s drain.
TOKEN_DELAY = 0.1
WORDS = 70


def _draining_worker(port: int, drain_timeout: str) -> subprocess.Popen:
    """The `worker` command, slow enough that an answer outlives SIGTERM."""
    args = ["--engine", "demo", "--token-delay", str(TOKEN_DELAY), "--drain-timeout"]
    command = [sys.executable, "-m", "gateway", "worker", "--host", "127.0.0.1"]
    process = subprocess.Popen(
        [*command, "--port", str(port), *args, drain_timeout],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_until(lambda: process.poll() is not None or listening(port), "the worker to listen")
    assert process.poll() is None, process.communicate()[0]
    wait_until(lambda: _health(port) == "SERVING", "the demo engine to start")
    return process


def _answer_across_sigterm(
    port: int, process: subprocess.Popen
) -> tuple[list[str], float, grpc.RpcError | None]:
    """Starts a stream, SIGTERMs the worker after its first token, and checks what a
    gateway sees meanwhile: its health watch turns NOT_SERVING (then ends, so the
    watch holds no drain up) and a new call is refused. Returns the statuses watched,
    the seconds the stream lasted after SIGTERM, and the error that cut it, if any."""
    request = engine_pb2.GenerateRequest(text="w " * WORDS)
    health_request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_request, timeout=HANG_GUARD)
        statuses = [health_pb2.HealthCheckResponse.ServingStatus.Name(next(watch).status)]
        stream = engine_pb2_grpc.EngineStub(channel).Generate(request, timeout=HANG_GUARD)
        assert next(stream).HasField("started")
        tokens = [next(stream).text.text]
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        statuses += [health_pb2.HealthCheckResponse.ServingStatus.Name(r.status) for r in watch]
        other = grpc.insecure_channel(f"127.0.0.1:{port}")
        with other, pytest.raises(grpc.RpcError) as refused:
            engine_pb2_grpc.EngineStub(other).Describe(engine_pb2.DescribeRequest(), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        try:
            tokens += [event.text.text for event in stream if event.HasField("text")]
        except grpc.RpcError as error:
            return statuses, time.monotonic() - signalled, error
    return statuses, time.monotonic() - signalled, None


def test_a_long_drain_finishes_an_answer_past_five_seconds():
    """The chart gives a worker most of its pod's grace period (`--drain-timeout`):
    an answer in flight at SIGTERM finishes, however long past the old fixed 5 s,
    while new calls go elsewhere; the worker exits once it has, not at the drain's end."""
    port = free_port()
    process = _draining_worker(port, "60")
    try:
        statuses, lasted, cut = _answer_across_sigterm(port, process)
        assert cut is None
        assert statuses == ["SERVING", "NOT_SERVING"]
        assert lasted > 5.5
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=HANG_GUARD)


def test_a_short_drain_cuts_an_answer():
    """Past `--drain-timeout`, calls in flight are cancelled and the worker exits 0."""
    port = free_port()
    process = _draining_worker(port, "1")
    try:
        statuses, lasted, cut = _answer_across_sigterm(port, process)
        assert cut is not None
        assert statuses == ["SERVING", "NOT_SERVING"]
        assert lasted < 4
        assert process.wait(timeout=10) == 0
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=HANG_GUARD)


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "soon"])
def test_the_drain_timeout_is_a_number_of_seconds(value: str, capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_:
        main(["worker", "--engine", "demo", "--drain-timeout", value])
    assert exit_.value.code == 2
    assert "--drain-timeout: not a number of seconds" in capsys.readouterr().err
