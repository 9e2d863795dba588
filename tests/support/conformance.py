"""The worker kinds the conformance suite (tests/test_conformance.py) runs against.

Each kind is one entry of `KINDS`: a factory that, given the test session's fixture
request, starts or finds its engine and returns an `Engine`: the gateway's model
entries for it (the suite starts its own gateways in front), the models a test asks
for, how to read the engine's running requests and see it stop one early, and what differs
between kinds (the demo echoes its prompt; a real model's text is junk). Adding a
kind is one entry here plus the session fixture that starts its engine (conftest).
vLLM's kinds are marked `vllm`: each starts a vLLM server (15-20 s, 1.3-2.4 GiB).

Cost: one gateway per kind for the session, started on the shared server loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vllm_pb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vllm_pb_grpc

from gateway.config import Config, ModelConfig
from tests.support.servers import Gateway, ServerLoop, assert_nothing_left, start_gateway
from tests.support.tiny_model import tools_tokenizer
from tests.support.vllm import MAX_MODEL_LEN, VllmProcess
from tests.support.vllm_worker import MODEL as VLLM_WORKER_MODEL
from tests.support.vllm_worker import VllmWorker
from tests.support.waiting import HANG_GUARD, wait_until


@dataclass
class Engine:
    """An engine behind the gateway, as the suite sees it."""

    #: The gateway's model entries that serve it.
    models: tuple[ModelConfig, ...]
    #: A model answering short requests, and one whose long answers take seconds
    #: (for cancellation and timeouts; the same model for a real engine).
    model: str
    slow_model: str
    #: The engine's context length (/v1/models `max_model_len`).
    max_context: int
    #: Requests the engine is generating right now.
    running: Callable[[], int]
    #: A reading of the engine's progress, and whether, since that reading, it stopped
    #: one request of `long_request` before its end (the demo counts aborts; vLLM counts
    #: no aborts in its metrics, but its generated tokens fall short of `max_tokens`).
    progress: Callable[[], float]
    stopped_early: Callable[[float], bool]
    #: Body fields of a request whose answer takes seconds on `slow_model`.
    long_request: dict[str, Any]
    #: The answer is the prompt's words (the demo engine); else text is not checked.
    echoes: bool = False
    #: Fields a test adds to every generation (temperature 0 for a real model).
    defaults: dict[str, Any] = field(default_factory=dict)
    #: Its model's chat template takes `tool` messages (the tiny vLLM model's refuses them).
    tool_messages: bool = True
    #: Why the suite cannot see this engine stop a request early, if it cannot (the test
    #: that checks it another way is named there).
    unseen_stops: str | None = None


Factory = Callable[[pytest.FixtureRequest], Engine]


def _demo(request: pytest.FixtureRequest) -> Engine:
    workers = request.getfixturevalue("workers")
    engines = (workers.demo_engine, workers.slow_engine)
    return Engine(
        models=(
            ModelConfig("furnace-demo", workers=(workers.demo.address,)),
            ModelConfig("furnace-slow", workers=(workers.slow.address,)),
        ),
        model="furnace-demo",
        slow_model="furnace-slow",
        max_context=64,
        running=lambda: sum(e.running for e in engines),
        progress=lambda: sum(e.aborted for e in engines),
        stopped_early=lambda before: sum(e.aborted for e in engines) == before + 1,
        long_request={"prompt": "w " * 200},
        echoes=True,
    )


def _openai_fake(request: pytest.FixtureRequest) -> Engine:
    """The demo workers behind the shared gateway, reached as an OpenAI HTTP server."""
    engine = _demo(request)
    upstream = request.getfixturevalue("gateway").url + "/v1"
    engine.models = tuple(
        ModelConfig(m.name, workers=(upstream,), upstream="openai") for m in engine.models
    )
    return engine


def vllm_metric(port: int, name: str, labels: str = "") -> float:
    """The sum of a vLLM server's Prometheus samples `name{...labels...}`."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=HANG_GUARD).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _vllm_http(request: pytest.FixtureRequest) -> Engine:
    server: VllmProcess = request.getfixturevalue("vllm_http")
    url = f"http://127.0.0.1:{server.port}/v1"
    max_tokens = MAX_MODEL_LEN - 64  # seconds of junk on CPU (the tiny model hits no EOS)

    def generated() -> float:
        return vllm_metric(server.port, "vllm:generation_tokens_total")

    return Engine(
        models=(ModelConfig("tiny-vllm", workers=(url,), upstream="openai"),),
        model="tiny-vllm",
        slow_model="tiny-vllm",
        max_context=MAX_MODEL_LEN,
        running=lambda: int(vllm_metric(server.port, "vllm:num_requests_running")),
        progress=generated,
        stopped_early=lambda before: 0 < generated() - before < max_tokens,
        long_request={"prompt": "one two three", "max_tokens": max_tokens},
        defaults={"temperature": 0},
        tool_messages=False,
    )


def _vllm_engine(request: pytest.FixtureRequest) -> Engine:
    """Our worker with `--engine vllm` (vLLM's AsyncLLM in-process)."""
    worker: VllmWorker = request.getfixturevalue("vllm_worker")
    return Engine(
        models=(ModelConfig(VLLM_WORKER_MODEL, workers=(f"127.0.0.1:{worker.port}",)),),
        model=VLLM_WORKER_MODEL,
        slow_model=VLLM_WORKER_MODEL,
        max_context=MAX_MODEL_LEN,
        running=worker.load,
        progress=worker.aborted,
        stopped_early=lambda before: worker.aborted() == before + 1,
        long_request={"prompt": "one two three", "max_tokens": MAX_MODEL_LEN - 64},
        defaults={"temperature": 0},
        tool_messages=False,
    )


def _vllm_grpc(request: pytest.FixtureRequest) -> Engine:
    """vLLM's own gRPC server (`upstream: vllm-grpc`): the gateway renders the tiny
    model's tools template (so tool turns are served) and parses its calls."""
    server: VllmProcess = request.getfixturevalue("vllm_grpc")
    model: Path = request.getfixturevalue("vllm_model")
    tokenizer = tools_tokenizer(model, request.getfixturevalue("tmp_path_factory").mktemp("tools"))
    address = f"127.0.0.1:{server.port}"

    def running() -> int:
        with grpc.insecure_channel(address) as channel:
            loads = vllm_pb_grpc.VllmEngineStub(channel).GetLoads(
                vllm_pb.GetLoadsRequest(), timeout=HANG_GUARD
            )
        return sum(load.num_running_reqs + load.num_waiting_reqs for load in loads.loads)

    return Engine(
        models=(
            ModelConfig(
                "tiny-vllm-grpc",
                workers=(address,),
                upstream="vllm-grpc",
                tokenizer=str(tokenizer),
                tool_call_parser="hermes",
            ),
        ),
        model="tiny-vllm-grpc",
        slow_model="tiny-vllm-grpc",
        max_context=MAX_MODEL_LEN,
        running=running,
        progress=lambda: 0.0,
        stopped_early=lambda before: False,
        long_request={"prompt": "one two three", "max_tokens": MAX_MODEL_LEN - 64},
        defaults={"temperature": 0},
        unseen_stops=(
            "vLLM's gRPC server counts no aborts where a client can read them (no metrics "
            "port; its log is at WARNING); tests/test_vllm_grpc.py checks the abort"
        ),
    )


@dataclass(frozen=True)
class Kind:
    factory: Factory
    marks: tuple[pytest.MarkDecorator, ...] = ()


#: Worker kind → how to reach it.
KINDS: dict[str, Kind] = {
    "grpc-demo": Kind(_demo),
    "openai-fake": Kind(_openai_fake),
    "vllm-http": Kind(_vllm_http, (pytest.mark.vllm,)),
    "vllm-engine": Kind(_vllm_engine, (pytest.mark.vllm,)),
    "vllm-grpc": Kind(_vllm_grpc, (pytest.mark.vllm,)),
}


def params() -> list[Any]:
    """The kinds as pytest params, with their marks."""
    return [pytest.param(name, marks=kind.marks, id=name) for name, kind in KINDS.items()]


def start_gateway_for(server_loop: ServerLoop, engine: Engine, **overrides: Any) -> Gateway:
    """A gateway serving only `engine`'s models, on a free loopback port."""
    settings: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "log_level": "warning",
        "models": engine.models,
        # A real engine on a loaded 2-core machine (another CPU-heavy process beside
        # the suite) has taken more than the default 10 s to start an answer; these
        # suites check answers' shapes, not the start timeout (test_fleet does).
        "start_timeout": 120.0,
    }
    settings.update(overrides)
    return start_gateway(server_loop, Config(**settings))


# The suites' fixtures (a test module imports those it uses): one gateway per kind
# and test module, a check that nothing is left after each test.


@pytest.fixture(scope="session", params=params())
def target(request: pytest.FixtureRequest, server_loop) -> Iterator[tuple[Engine, Gateway]]:
    """One kind's engine and a gateway in front of it, once per session."""
    engine = KINDS[request.param].factory(request)
    front = start_gateway_for(server_loop, engine)
    yield engine, front
    front.stop()


@pytest.fixture
def served(target) -> Iterator[tuple[Engine, Gateway]]:
    """The kind under test; after the test, nothing left in the gateway or the engine."""
    yield target
    engine, front = target
    assert_nothing_left(front, None)
    wait_until(lambda: engine.running() == 0, "the engine to be idle")


@pytest.fixture
def engine(served) -> Engine:
    return served[0]


@pytest.fixture
def sdk(served) -> Iterator[openai.OpenAI]:
    """The official SDK on the gateway, closed after the test. Left to the garbage
    collector, a client is a reference cycle: a full collection that finds it while its
    socket is in a younger generation finalizes the socket first, an unclosed-socket
    ResourceWarning (127.0.0.1 to the gateway) in whichever later test that runs in."""
    with openai.OpenAI(
        base_url=served[1].url + "/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD
    ) as client:
        yield client


def greedy(engine: Engine, **fields: Any) -> dict[str, Any]:
    return {"model": engine.model, **engine.defaults, **fields}


__all__ = [
    "KINDS",
    "Engine",
    "Kind",
    "engine",
    "greedy",
    "params",
    "sdk",
    "served",
    "start_gateway_for",
    "target",
    "vllm_metric",
]
