"""A gateway in front of the engines a test module starts (vLLM's servers, most often, or
in-process engines behind our workers), and the official SDKs on it. The modules that test
through real engines each started the same gateway over their own models, built the same
clients on it and checked the same way that nothing was left in it after each test: they
share these instead."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from gateway.config import Config, ModelConfig
from gateway.worker.server import WorkerServer
from tests.support import servers
from tests.support.servers import Gateway, ServerLoop, Workers, assert_nothing_left
from tests.support.vllm import VllmProcess
from tests.support.waiting import HANG_GUARD, wait_until


@dataclass
class Front:
    """A gateway and the official SDKs on it."""

    gateway: Gateway
    sdk: openai.OpenAI
    claude: anthropic.Anthropic


def grpc_model(name: str, server: VllmProcess, tokenizer: Path, **fields: Any) -> ModelConfig:
    """`name` served by vLLM's gRPC `server` (`upstream: vllm-grpc`), the gateway rendering
    and tokenizing with `tokenizer` (a model's directory)."""
    return ModelConfig(
        name,
        upstream="vllm-grpc",
        tokenizer=str(tokenizer),
        workers=(f"127.0.0.1:{server.port}",),
        **fields,
    )


@contextmanager
def gateway_over(
    server_loop: ServerLoop, models: tuple[ModelConfig, ...], workers: Workers | None = None
) -> Iterator[Gateway]:
    """A gateway serving `models` alone, stopped after: on the tests' usual config with the
    session's `workers` (`make_config`), on a bare one without them."""
    if workers is None:
        config = Config(host="127.0.0.1", port=0, log_level="warning", models=models)
    else:
        config = servers.make_config(workers, models=models)
    gw = servers.start_gateway(server_loop, config)
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


@contextmanager
def engines_front(
    server_loop: ServerLoop, workers: Workers, engines: Sequence[Any]
) -> Iterator[Front]:
    """`front_over` the workers of in-process `engines`, each its own model; after, the
    workers stopped and the engines closed."""
    started = [WorkerServer(engine) for engine in engines]
    for server in started:
        server_loop.call(server.start())
    models = tuple(ModelConfig(s.engine.model, workers=(s.address,)) for s in started)
    with front_over(server_loop, models, workers) as front:
        yield front
    for server in started:
        server_loop.call(server.stop())
    for engine in engines:
        engine.close()


def nothing_left_after_each(fixture: str = "front") -> Any:
    """An autouse fixture for a module whose gateway is its module-scoped `fixture` (a
    `Front`, or anything with its `gateway`): after each test, nothing left in it, and
    none of its in-process `engines` (where it has them) running."""

    @pytest.fixture(autouse=True)
    def _nothing_left(request: pytest.FixtureRequest) -> Iterator[None]:
        front = request.getfixturevalue(fixture)
        yield
        assert_nothing_left(front.gateway, None)
        for engine in getattr(front, "engines", ()):
            wait_until(lambda e=engine: e.running == 0, f"{engine.model} to be idle")

    return _nothing_left
