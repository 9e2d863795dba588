"""A gateway in front of the engines a test module starts (vLLM's servers, most often), and
the official SDKs on it. The modules that test through real engines each started the same
gateway over their own models, built the same clients on it and checked the same way that
nothing was left in it after each test: they share these instead."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
import pytest

from gateway.config import Config, ModelConfig
from tests.support.servers import (
    Gateway,
    ServerLoop,
    Workers,
    assert_nothing_left,
    make_config,
    start_gateway,
)
from tests.support.waiting import HANG_GUARD


@dataclass
class Front:
    """A gateway and the official SDKs on it."""

    gateway: Gateway
    sdk: openai.OpenAI
    claude: anthropic.Anthropic


@contextmanager
def gateway_over(
    server_loop: ServerLoop, models: tuple[ModelConfig, ...], workers: Workers | None = None
) -> Iterator[Gateway]:
    """A gateway serving `models` alone, stopped after: on the tests' usual config with the
    session's `workers` (`make_config`), on a bare one without them."""
    if workers is None:
        config = Config(host="127.0.0.1", port=0, log_level="warning", models=models)
    else:
        config = make_config(workers, models=models)
    gw = start_gateway(server_loop, config)
    try:
        yield gw
    finally:
        gw.stop()


def openai_at(url: str, **options: Any) -> openai.OpenAI:
    """The openai SDK on `url` (a gateway's `/v1`, or an engine's own), with no key of
    its own and the hang guard as its timeout (`options` go on or over them)."""
    return openai.OpenAI(base_url=url, **{"api_key": "unused", "timeout": HANG_GUARD, **options})


@contextmanager
def checked_sdk(gw: Gateway, workers: Workers | None, **options: Any) -> Iterator[openai.OpenAI]:
    """The openai SDK through `gw` (`openai_at`); after, nothing left in it (nor in the
    session's `workers`, given)."""
    with openai_at(gw.url + "/v1", **options) as sdk:
        yield sdk
    assert_nothing_left(gw, workers)


@contextmanager
def front_over(
    server_loop: ServerLoop, models: tuple[ModelConfig, ...], workers: Workers | None = None
) -> Iterator[Front]:
    """`gateway_over` with both SDKs on it, neither retrying: for a module-scoped fixture,
    with `nothing_left_after_each`."""
    options: dict[str, Any] = {"api_key": "unused", "max_retries": 0, "timeout": HANG_GUARD}
    with (
        gateway_over(server_loop, models, workers) as gw,
        anthropic.Anthropic(base_url=gw.url, **options) as claude,
        openai.OpenAI(base_url=gw.url + "/v1", **options) as sdk,
    ):
        yield Front(gw, sdk, claude)


def nothing_left_after_each(fixture: str = "front") -> Any:
    """An autouse fixture for a module whose gateway is its module-scoped `fixture` (a
    `Front`, or anything with its `gateway`): after each test, nothing left in it."""

    @pytest.fixture(autouse=True)
    def _nothing_left(request: pytest.FixtureRequest) -> Iterator[None]:
        front = request.getfixturevalue(fixture)
        yield
        assert_nothing_left(front.gateway, None)

    return _nothing_left
