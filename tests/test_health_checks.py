"""A worker's health checks: `health_check_interval` says how often, and
`health_check_timeout` how long one check may take, apart. A check slower than a short
interval is not a failure (before, each check's timeout was the interval, so a loaded
machine's healthy workers flapped unreachable at 0.5 s); one slower than the timeout is.
Against a real OpenAI-compatible server whose /health answers late, behind the real
gateway."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from gateway.config import ModelConfig
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
