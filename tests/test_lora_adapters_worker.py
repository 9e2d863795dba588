"""LoRA adapters served by our own workers (`upstream: grpc`): `LoadAdapter` and the
adapters listed in `Describe` (their base as `parent`).

Against `furnace-gateway worker --engine vllm --enable-lora` (vLLM's CPU build, the tiny
model and adapters of it built on the spot), one adapter from the worker's start
(`--lora-modules`) and others loaded by the gateway: greedy answers equal to vLLM's own
HTTP server's for the same adapter (and not the base's), one load shared by concurrent
first requests, a path the worker cannot load is the operator's error (500, nothing
counted against the worker), and the worker refuses what a client may not ask (names and
paths out of bounds, another folder under a held name) by status.

And, fast, against the demo engine (which takes no adapters): UNIMPLEMENTED, which the
gateway answers as the operator's clear error.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest

from gateway.config import ModelConfig, parse_config
from gateway.fleet.adapters import AdapterPool
from gateway.protocol.status import PARAM_KEY
from gateway.protocol.v1 import engine_pb2 as pb
from gateway.protocol.v1 import engine_pb2_grpc as pb_grpc
from gateway.worker.demo import DEMO_MODEL
from tests.support.adapters import BASE, PROMPT, ask, refused_load
from tests.support.clients import openai_sdk
from tests.support.metrics import scrape, value
from tests.support.servers import Gateway, Workers
from tests.support.tiny_model import build_lora_adapter
from tests.support.vllm import VllmProcess, start_http_server
from tests.support.vllm_worker import VllmWorker, start_vllm_worker
from tests.support.waiting import HANG_GUARD

#: vLLM's LoRA options, the same for our worker and vLLM's server.
LORA_OPTIONS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8")


@pytest.fixture(scope="module")
def lora_worker(
    vllm_model: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmWorker]:
    """Our worker serving the base and `sql` from its start, loading others when asked."""
    logs = tmp_path_factory.mktemp("lora-worker-logs")
    options = (*LORA_OPTIONS, "--lora-modules", f"sql={adapters['sql']}")
    worker = start_vllm_worker(vllm_model, logs, *options, name=BASE)
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def reference(
    vllm_model: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmProcess]:
    """vLLM's own HTTP server with every adapter from its start: the answers to match."""
    modules = [f"{name}={path}" for name, path in adapters.items()]
    logs = tmp_path_factory.mktemp("lora-reference-logs")
    server = start_http_server(vllm_model, logs, BASE, (*LORA_OPTIONS, "--lora-modules", *modules))
    yield server
    server.stop()


def _models(worker: str, adapters: dict[str, Path]) -> tuple[ModelConfig, ...]:
    """The base on our worker at `worker` (`upstream: grpc`, the default), and its
    adapters as the config file writes them."""
    raw = {
        "models": [
            {"name": BASE, "workers": [worker]},
            {"name": "sql", "adapter_of": BASE},
            {"name": "chat", "adapter_of": BASE, "adapter_path": str(adapters["chat"])},
            {"name": "legal", "adapter_of": BASE, "adapter_path": str(adapters["legal"])},
            {"name": "nowhere", "adapter_of": BASE, "adapter_path": "/no/such/adapter"},
        ]
    }
    return parse_config(raw, env={}).models


@pytest.fixture
def lora_gateway(
    gateway_with: Callable[..., Gateway], lora_worker: VllmWorker, adapters: dict[str, Path]
) -> Gateway:
    return gateway_with(models=_models(f"127.0.0.1:{lora_worker.port}", adapters))


def _direct(server: VllmProcess, model: str) -> str:
    """vLLM's own greedy answer for `model`."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    url = f"http://127.0.0.1:{server.port}/v1/completions"
    answer = httpx.post(url, json=body, timeout=HANG_GUARD)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["choices"][0]["text"])


def _listed(worker: VllmWorker) -> dict[str, str]:
    """What the worker's Describe lists: each model's name and its parent."""
    return {m.name: m.parent for m in worker.describe().models}


def _load(port: int, name: str, path: str) -> grpc.RpcError | None:
    """The worker's answer to a LoadAdapter call: None (loaded) or its status."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.EngineStub(channel)
        try:
            stub.LoadAdapter(pb.LoadAdapterRequest(name=name, path=path), timeout=HANG_GUARD)
        except grpc.RpcError as error:
            return error
    return None


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_the_worker_lists_its_adapters_with_their_parent(lora_worker: VllmWorker) -> None:
    described = lora_worker.describe()
    listed = {m.name: m for m in described.models}
    assert listed[BASE].parent == "" and listed["sql"].parent == BASE
    assert listed["sql"].max_context == listed[BASE].max_context
    assert list(listed["sql"].features) == list(listed[BASE].features)


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_an_adapter_from_the_workers_start_answers_as_vllm_does(
    lora_gateway: Gateway, reference: VllmProcess
) -> None:
    with openai_sdk(lora_gateway.url) as sdk:
        assert ask(sdk, "sql") == _direct(reference, "sql")
        assert ask(sdk, BASE) == _direct(reference, BASE)
        chat = sdk.chat.completions.create(
            model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
        assert {chunk.model for chunk in chat} == {"sql"}
    assert _direct(reference, "sql") != _direct(reference, BASE)


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_the_gateway_loads_an_adapter_once_for_concurrent_first_requests(
    lora_gateway: Gateway, lora_worker: VllmWorker, reference: VllmProcess
) -> None:
    pool = lora_gateway.state.fleet.models["legal"]
    assert isinstance(pool, AdapterPool)
    assert "legal" not in _listed(lora_worker)
    with (
        openai_sdk(lora_gateway.url) as sdk,
        concurrent.futures.ThreadPoolExecutor(6) as threads,
    ):
        answers = list(threads.map(lambda _: ask(sdk, "legal"), range(6)))
        assert pool.loads_total["loaded"] == 1  # one load for all six
        assert set(answers) == {_direct(reference, "legal")}
        assert answers[0] != ask(sdk, BASE)
    assert _listed(lora_worker)["legal"] == BASE
    samples = scrape(lora_gateway.url)
    worker = f"127.0.0.1:{lora_worker.port}"
    assert value(samples, "furnace_gateway_worker_adapter_loaded", model="legal", worker=worker)
    assert value(samples, "furnace_gateway_adapter_loads_total", model="legal", outcome="loaded")


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_a_loaded_adapter_serves_the_multiplexed_and_plain_calls_alike(
    gateway_with: Callable[..., Gateway],
    lora_worker: VllmWorker,
    adapters: dict[str, Path],
    reference: VllmProcess,
) -> None:
    models = _models(f"127.0.0.1:{lora_worker.port}", adapters)
    for multiplex in (True, False):
        gw = gateway_with(models=models, multiplex_workers=multiplex)
        with openai_sdk(gw.url) as sdk:
            assert ask(sdk, "chat") == _direct(reference, "chat")
    assert _listed(lora_worker)["chat"] == BASE


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_an_adapter_the_worker_cannot_load_is_the_operators_error(
    lora_gateway: Gateway, lora_worker: VllmWorker
) -> None:
    refused_load(lora_gateway, "nowhere")
    assert "nowhere" not in _listed(lora_worker)


@pytest.mark.vllm
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("name", "path", "code", "param"),
    [
        ("x", "/no/such/adapter", grpc.StatusCode.FAILED_PRECONDITION, None),
        ("x", "relative/path", grpc.StatusCode.INVALID_ARGUMENT, "path"),
        ("", "/tmp", grpc.StatusCode.INVALID_ARGUMENT, "name"),
        ("a name", "/tmp", grpc.StatusCode.INVALID_ARGUMENT, "name"),
        ("x" * 257, "/tmp", grpc.StatusCode.INVALID_ARGUMENT, "name"),
        ("x", "/" + "p" * 4096, grpc.StatusCode.INVALID_ARGUMENT, "path"),
        (BASE, "/tmp", grpc.StatusCode.FAILED_PRECONDITION, None),  # the model's own name
        ("sql", "/tmp", grpc.StatusCode.FAILED_PRECONDITION, None),  # held from elsewhere
    ],
)
def test_the_worker_refuses_a_load_it_may_not_do(
    lora_worker: VllmWorker, name: str, path: str, code: grpc.StatusCode, param: str | None
) -> None:
    refused = _load(lora_worker.port, name, path)
    assert isinstance(refused, grpc.Call)
    assert refused.code() == code, refused.details()
    trailing = dict(refused.trailing_metadata() or ())
    assert trailing.get(PARAM_KEY) == param
    assert name not in _listed(lora_worker) or name in (BASE, "sql")


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_an_adapter_vllm_refuses_leaves_the_engine_serving(
    lora_worker: VllmWorker, lora_gateway: Gateway, vllm_model: Path, tmp_path: Path
) -> None:
    wide = build_lora_adapter(tmp_path / "wide", vllm_model, seed=9, rank=16)  # > --max-lora-rank
    refused = _load(lora_worker.port, "wide", str(wide))
    assert isinstance(refused, grpc.Call)
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "vLLM could not load the adapter `wide`" in (refused.details() or "")
    assert "wide" not in _listed(lora_worker)
    lora_worker.check_alive()
    with openai_sdk(lora_gateway.url) as sdk:  # still up, still serving its adapters
        assert ask(sdk, "sql") != ask(sdk, BASE)


@pytest.mark.vllm
@pytest.mark.timeout(600)
def test_an_adapter_held_already_is_loaded(
    lora_worker: VllmWorker, adapters: dict[str, Path]
) -> None:
    assert _load(lora_worker.port, "sql", str(adapters["sql"])) is None
    assert _load(lora_worker.port, "sql", f"{adapters['sql']}/.") is None  # spelled otherwise


# -- an engine that takes no adapters (the demo engine), fast ----------------------------


def test_an_engine_without_adapters_answers_load_adapter_unimplemented(workers: Workers) -> None:
    port = int(workers.demo.address.rpartition(":")[2])
    refused = _load(port, "lora", "/some/adapter")
    assert isinstance(refused, grpc.Call)
    assert refused.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "loads no LoRA adapters" in (refused.details() or "")
    assert {m.name: m.parent for m in _describe(port).models} == {DEMO_MODEL: ""}


def _describe(port: int) -> pb.DescribeResponse:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply: pb.DescribeResponse = pb_grpc.EngineStub(channel).Describe(
            pb.DescribeRequest(), timeout=HANG_GUARD
        )
        return reply


def test_the_gateway_says_a_worker_takes_no_adapters(
    gateway_with: Callable[..., Gateway], workers: Workers, caplog: pytest.LogCaptureFixture
) -> None:
    raw: dict[str, Any] = {
        "models": [
            {"name": DEMO_MODEL, "workers": [workers.demo.address]},
            {"name": "demo-lora", "adapter_of": DEMO_MODEL, "adapter_path": "/some/adapter"},
        ]
    }
    gw = gateway_with(models=parse_config(raw, env={}).models)
    with openai_sdk(gw.url) as sdk:
        with pytest.raises(openai.InternalServerError) as refused:
            sdk.completions.create(model="demo-lora", prompt="hi", max_tokens=2)
        assert refused.value.code == "engine_error"  # its message is the edge's own
        assert sdk.completions.create(model=DEMO_MODEL, prompt="hi", max_tokens=2).choices
    pool = gw.state.fleet.models["demo-lora"]
    assert isinstance(pool, AdapterPool)
    worker = next(iter(pool.workers.values()))
    assert worker.consecutive_failures == 0 and worker.state == "healthy"
    assert pool.loads_total == {"failed": 1}
    said = "could not load the adapter `demo-lora`: it takes no adapters: The engine"
    assert any(said in record.getMessage() for record in caplog.records)  # the operator's
