"""The tests' fixtures: real servers (gRPC workers, the gateway under uvicorn) on
loopback ports, on one uvloop event loop in a background thread.

Tests talk to them with real clients (httpx, the openai SDK) from the main
thread. After every test, the `no_leaks` check waits until every slot, worker
call and engine generation is free again. The helpers live in tests.support.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.protocol.tls import ServerTLS
from gateway.worker.server import WorkerServer
from tests.support.clients import openai_sdk
from tests.support.mcp_server import start_mcp_server
from tests.support.redis_server import RedisServer
from tests.support.servers import (
    Gateway,
    ServerLoop,
    Workers,
    assert_nothing_left,
    make_config,
    start_gateway,
    start_workers,
)
from tests.support.tiny_model import build_lora_adapter
from tests.support.vllm import (
    VllmProcess,
    build_vllm_model,
    start_grpc_server,
    start_http_server,
)
from tests.support.vllm_worker import VllmWorker, start_vllm_worker
from tests.support.waiting import HANG_GUARD

#: The conformance suites' fixtures (`target`, `served`, `engine`, `sdk`): one gateway
#: per worker kind, for every test module that runs over the kinds.
pytest_plugins = ["tests.support.conformance"]


@pytest.fixture(scope="session")
def server_loop() -> Iterator[ServerLoop]:
    loop = ServerLoop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def workers(server_loop: ServerLoop) -> Iterator[Workers]:
    workers = server_loop.call(start_workers())
    yield workers
    for server in (workers.demo, workers.slow, workers.scripted):
        server_loop.call(server.stop())


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


@pytest.fixture
def api(gateway: Gateway) -> Iterator[openai.OpenAI]:
    """The official `openai` SDK on the shared gateway, closed after the test (a client
    left to the garbage collector warns, and warnings are errors)."""
    with openai_sdk(gateway.url) as sdk:
        yield sdk


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


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A real `redis-server` of this test's own (skipped where none is installed)."""
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (apt-get install -y redis-server)")
    server = RedisServer()
    server.start()
    yield server
    if server.process is not None and server.process.poll() is None:
        server.stop()


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model in a folder, as vLLM and the gateway's tokenizer read it."""
    return build_vllm_model(tmp_path_factory.mktemp("tiny-vllm"))


@pytest.fixture(scope="session")
def mcp_url() -> Iterator[str]:
    """A real MCP server's URL (tests/support/mcp_server.py), started once a session."""
    with start_mcp_server() as url:
        yield url


@pytest.fixture(scope="session")
def adapters(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Three LoRA adapters of the tiny model, each its own weights (the LoRA specs')."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: build_lora_adapter(root / name, vllm_model, seed)
        for seed, name in enumerate(("sql", "chat", "legal"), start=1)
    }


@pytest.fixture(scope="session")
def vllm_http(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmProcess]:
    """vLLM's OpenAI HTTP server, started once per session when first asked for."""
    server = start_http_server(vllm_model, tmp_path_factory.mktemp("vllm-http-logs"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_grpc(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmProcess]:
    """vLLM's own gRPC server, started once per session when first asked for."""
    server = start_grpc_server(vllm_model, tmp_path_factory.mktemp("vllm-grpc-logs"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_worker(vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmWorker]:
    """Our worker with `--engine vllm`, started once per session when first asked for."""
    worker = start_vllm_worker(vllm_model, tmp_path_factory.mktemp("vllm-worker-logs"))
    yield worker
    worker.stop()
