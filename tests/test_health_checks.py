"""A worker's health checks: `health_check_interval` says how often, and
`health_check_timeout` how long one check may take, apart. A check slower than a short
interval is not a failure (before, each check's timeout was the interval, so a loaded
machine's healthy workers flapped unreachable at 0.5 s); one slower than the timeout is.
Against a real OpenAI-compatible server whose /health answers late, behind the real
gateway. A check that times out closes its connection, even one cut short in its TLS
handshake (httpcore's own left that socket to the garbage collector, which warns: on a
loaded machine the handshake alone outlasted a short timeout)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from gateway.config import ModelConfig
from tests.support.certs import CertificateAuthority
from tests.support.openai_server import OpenAIServer, serving
from tests.support.requests import user
from tests.support.servers import Gateway, ServerLoop
from tests.support.waiting import HANG_GUARD, wait_until

MODEL = "slow-health"
KEY_ENV = "FURNACE_TEST_SLOW_HEALTH_KEY"
#: Seconds the server's /health takes.
DELAY = 0.3


@pytest.fixture
def slow_server(
    server_loop: ServerLoop, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[OpenAIServer, str]]:
    with serving(server_loop, tmp_path, MODEL) as (server, ca):
        server.health_delay = DELAY
        monkeypatch.setenv(KEY_ENV, server.key)
        yield server, ca.ca_file


def _gateway(
    gateway_with: Callable[..., Gateway], server: OpenAIServer, ca_file: str, timeout: float
) -> Gateway:
    model = ModelConfig(
        MODEL, workers=(server.url,), upstream="openai", api_key_env=KEY_ENV, ca_file=ca_file
    )
    return gateway_with(models=(model,), health_check_interval=0.05, health_check_timeout=timeout)


def _state(gw: Gateway) -> str:
    """The worker's state as /admin/workers says it."""
    (model,) = httpx.get(gw.url + "/admin/workers", timeout=HANG_GUARD).json()["models"]
    return str(model["workers"][0]["state"])


def _chat(gw: Gateway) -> httpx.Response:
    body = {"model": MODEL, "messages": user("hi")}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=HANG_GUARD)


def test_a_health_check_slower_than_the_interval_is_not_a_failure(
    slow_server: tuple[OpenAIServer, str],  # before the gateway: stopped after it
    gateway_with: Callable[..., Gateway],
    caplog: pytest.LogCaptureFixture,
) -> None:
    server, ca_file = slow_server
    gw = _gateway(gateway_with, server, ca_file, timeout=HANG_GUARD)
    wait_until(lambda: _state(gw) == "healthy", "the slow worker healthy")
    for _ in range(3):  # checks keep coming 0.05 s apart, each taking 0.3 s
        response = _chat(gw)
        assert response.status_code == 200, response.text
    assert not [r for r in caplog.records if "unreachable" in r.getMessage()]


def test_a_health_check_slower_than_its_timeout_is_unreachable(
    slow_server: tuple[OpenAIServer, str],  # before the gateway: stopped after it
    gateway_with: Callable[..., Gateway],
    caplog: pytest.LogCaptureFixture,
) -> None:
    server, ca_file = slow_server
    caplog.set_level(logging.WARNING)
    gw = _gateway(gateway_with, server, ca_file, timeout=DELAY / 3)
    wait_until(
        lambda: any("unreachable" in r.getMessage() for r in caplog.records),
        "the worker unreachable",
    )
    assert _state(gw) == "not_serving"
    refused = _chat(gw)
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "engine_unavailable"


class MuteServer:
    """Takes TCP connections and never answers (a TLS handshake with it never ends);
    counts those their client closed."""

    def __init__(self) -> None:
        self.closed = 0
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    async def start(self) -> int:
        """Listens on a free loopback port, which it returns."""
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return int(self._server.sockets[0].getsockname()[1])

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while await reader.read(4096):  # the client's hello, then its close
                pass
        except ConnectionResetError:  # closed too, by a reset
            pass
        finally:
            writer.close()
            self._handlers.discard(task)
        self.closed += 1

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        await self._server.wait_closed()


def test_a_health_check_that_times_out_in_the_tls_handshake_closes_its_connection(
    server_loop: ServerLoop,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    gateway_with: Callable[..., Gateway],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    mute = MuteServer()
    port = server_loop.call(mute.start())
    try:
        monkeypatch.setenv(KEY_ENV, "sk-unused")
        ca = CertificateAuthority(tmp_path, "upstream-ca")
        model = ModelConfig(
            MODEL,
            workers=(f"https://127.0.0.1:{port}/v1",),
            upstream="openai",
            api_key_env=KEY_ENV,
            ca_file=ca.ca_file,
        )
        gateway_with(models=(model,), health_check_interval=0.05, health_check_timeout=0.1)
        wait_until(
            lambda: any("unreachable" in r.getMessage() for r in caplog.records),
            "the worker unreachable",
        )
        # each check's socket closed by the gateway (before, by the garbage collector,
        # with a ResourceWarning: an error here, as every warning)
        wait_until(lambda: mute.closed >= 3, "three timed-out checks' connections closed")
    finally:
        server_loop.call(mute.stop())
