"""Real servers for the tests: gRPC workers and the gateway under uvicorn, on
loopback ports, on one uvloop event loop in a background thread.

Tests talk to them with real clients (httpx, the openai SDK) from the main
thread. After every test, the `no_leaks` check waits until every slot, worker
call and engine generation is free again.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvloop

from gateway.config import Config, ModelConfig
from gateway.lifecycle import Gateway as GatewayParts
from gateway.lifecycle import GatewayServer
from gateway.protocol.tls import ServerTLS
from gateway.worker.demo import DEMO_MODEL, DemoEngine
from gateway.worker.server import WorkerServer
from tests.scripted_worker import SCRIPTED_MODEL, ScriptedWorker

HANG_GUARD = 30.0  # seconds; only to fail instead of hanging


class ServerLoop:
    """An event loop in a thread; `call` runs a coroutine there and waits."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = HANG_GUARD) -> Any:
        """Runs `coro` on the loop and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        """Stops the loop and its thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(HANG_GUARD)


@dataclass
class Workers:
    """The workers every gateway of a test session points at."""

    demo: WorkerServer
    demo_engine: DemoEngine
    slow: WorkerServer
    slow_engine: DemoEngine
    scripted: ScriptedWorker


@dataclass
class Gateway:
    """A running gateway: its base URL and its state, for leak checks."""

    url: str
    state: GatewayParts
    stop: Callable[[], None]


@pytest.fixture(scope="session")
def server_loop() -> Iterator[ServerLoop]:
    loop = ServerLoop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def workers(server_loop: ServerLoop) -> Iterator[Workers]:
    async def start() -> Workers:
        demo_engine = DemoEngine(max_context=64)
        slow_engine = DemoEngine("furnace-slow", max_context=4096, token_delay=0.05)
        demo, slow = WorkerServer(demo_engine), WorkerServer(slow_engine)
        scripted = ScriptedWorker()
        for server in (demo, slow, scripted):
            await server.start()
        return Workers(demo, demo_engine, slow, slow_engine, scripted)

    workers = server_loop.call(start())
    yield workers
    for server in (workers.demo, workers.slow, workers.scripted):
        server_loop.call(server.stop())


def make_config(workers: Workers, **overrides: Any) -> Config:
    """A config serving the test workers on a free port."""
    models = (
        ModelConfig(DEMO_MODEL, workers=(workers.demo.address,)),
        ModelConfig("furnace-slow", workers=(workers.slow.address,)),
        ModelConfig(SCRIPTED_MODEL, workers=(workers.scripted.address,)),
        ModelConfig("resnet-50", kind="tensor"),
    )
    settings: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "log_level": "warning",
        # the fault tests fail one worker on purpose, again and again: no ejection
        # here (tests/test_fleet.py covers it with gateways of their own)
        "eject_after_failures": 1_000_000,
    }
    settings.update(overrides)
    settings.setdefault("models", models)
    return Config(**settings)


def start_gateway(server_loop: ServerLoop, config: Config) -> Gateway:
    """Starts the gateway under uvicorn on the server loop."""
    server = GatewayServer(config)
    server_loop.call(server.start())
    url = f"http://127.0.0.1:{server.port}"
    return Gateway(url, server.gateway, lambda: server_loop.call(server.stop()))


@pytest.fixture(scope="session")
def gateway(server_loop: ServerLoop, workers: Workers) -> Iterator[Gateway]:
    """The shared gateway, with default settings."""
    gw = start_gateway(server_loop, make_config(workers))
    yield gw
    gw.stop()


@pytest.fixture
def gateway_with(server_loop: ServerLoop, workers: Workers) -> Iterator[Callable[..., Gateway]]:
    """Starts gateways with config overrides; stops them after the test."""
    started: list[Gateway] = []

    def factory(**overrides: Any) -> Gateway:
        gw = start_gateway(server_loop, make_config(workers, **overrides))
        started.append(gw)
        return gw

    yield factory
    for gw in started:
        assert_nothing_left(gw, None)
        gw.stop()


@pytest.fixture
def client(gateway: Gateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=HANG_GUARD) as http:
        yield http


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    """Polls `condition` until true; fails the test after `timeout` seconds."""
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def assert_nothing_left(gw: Gateway, workers: Workers | None) -> None:
    """Every slot free, no call outstanding on any worker, no generation running."""
    wait_until(lambda: gw.state.slots.in_use == 0, "all slots to be free")
    wait_until(lambda: not gw.state.inflight.running, "no request in flight")
    pools = gw.state.fleet.models.values()
    wait_until(
        lambda: all(w.outstanding == 0 for p in pools for w in p.workers.values()),
        "no outstanding worker calls",
    )
    if workers is not None:
        wait_until(lambda: workers.scripted.active == 0, "the scripted worker to be idle")
        wait_until(lambda: workers.demo_engine.running == 0, "the demo engine to be idle")
        wait_until(lambda: workers.slow_engine.running == 0, "the slow engine to be idle")


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """After each test that used the shared gateway: nothing left behind."""
    yield
    if "gateway" in request.fixturenames:
        assert_nothing_left(request.getfixturevalue("gateway"), request.getfixturevalue("workers"))


@pytest.fixture
def serve_engines(server_loop: ServerLoop) -> Iterator[Callable[..., list[WorkerServer]]]:
    """Starts workers for engines (real gRPC servers); stops them after the test."""
    started: list[WorkerServer] = []

    def serve(
        *engines: Any, host: str = "127.0.0.1", port: int = 0, tls: ServerTLS | None = None
    ) -> list[WorkerServer]:
        servers = [WorkerServer(engine, host, port, tls) for engine in engines]
        for server in servers:
            server_loop.call(server.start())
        started.extend(servers)
        return servers

    yield serve
    for server in started:
        server_loop.call(server.stop(0))
