"""LoRA adapters (`models[].adapter_of`) against real vLLM (CPU build, the tiny model and
adapters of it built on the spot): one OpenAI HTTP server started with `--enable-lora`,
one adapter from its start (`--lora-modules`) and runtime loading allowed. An adapter is a
model of its own to clients (listed with its `parent`, answered by its name, greedy
answers equal to vLLM's own for that adapter), served by its base's worker; one with an
`adapter_path` is loaded there once, by the first requests (concurrent ones share the
load), and again after the server restarted and forgot it; a path the server cannot
load is the operator's error (500, counted), not a worker failure."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import ConfigError, ModelConfig, parse_config
from gateway.fleet.adapters import AdapterPool
from tests.support.adapters import BASE, PROMPT, ask, refused_load
from tests.support.clients import openai_sdk
from tests.support.metrics import scrape, value
from tests.support.servers import Gateway
from tests.support.vllm import VllmProcess, start_http_server
from tests.support.waiting import HANG_GUARD

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def lora_server(
    vllm_model: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmProcess]:
    """vLLM serving the base and `sql` from its start, loading others at runtime."""
    extra = (
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"sql={adapters['sql']}",
    )
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    logs = tmp_path_factory.mktemp("vllm-lora-logs")
    server = start_http_server(vllm_model, logs, BASE, extra, env)
    yield server
    server.stop()


def _models(server: VllmProcess, adapters: dict[str, Path], **more: Any) -> tuple[ModelConfig, ...]:
    """The base model on `server`, and its adapters as the config file writes them."""
    raw = {
        "models": [
            {"name": BASE, "upstream": "openai", "workers": [_url(server)]},
            {"name": "sql", "adapter_of": BASE},
            {"name": "chat", "adapter_of": BASE, "adapter_path": str(adapters["chat"])},
            {"name": "legal", "adapter_of": BASE, "adapter_path": str(adapters["legal"])},
            {"name": "nowhere", "adapter_of": BASE, "adapter_path": "/no/such/adapter"},
        ],
        **more,
    }
    return parse_config(raw, env={}).models


def _url(server: VllmProcess) -> str:
    return f"http://127.0.0.1:{server.port}/v1"


def _direct(server: VllmProcess, model: str) -> str:
    """vLLM's own greedy answer for `model`."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    answer = httpx.post(f"{_url(server)}/completions", json=body, timeout=HANG_GUARD)
    assert answer.status_code == 200, answer.text
    return str(answer.json()["choices"][0]["text"])


def _served(server: VllmProcess) -> set[str]:
    listed = httpx.get(f"{_url(server)}/models", timeout=HANG_GUARD).json()["data"]
    return {m["id"] for m in listed}


@pytest.fixture
def lora_gateway(
    gateway_with: Callable[..., Gateway], lora_server: VllmProcess, adapters: dict[str, Path]
) -> Gateway:
    return gateway_with(models=_models(lora_server, adapters))


def test_adapters_are_models_with_their_base_as_parent(lora_gateway: Gateway) -> None:
    listed = httpx.get(f"{lora_gateway.url}/v1/models", timeout=HANG_GUARD).json()["data"]
    by_id = {m["id"]: m for m in listed}
    assert "parent" not in by_id[BASE]
    for name in ("sql", "chat", "legal", "nowhere"):
        assert by_id[name]["parent"] == BASE
        assert by_id[name]["max_model_len"] == by_id[BASE]["max_model_len"]
    one = httpx.get(f"{lora_gateway.url}/v1/models/chat", timeout=HANG_GUARD).json()
    assert one["parent"] == BASE


def test_an_adapter_the_server_started_with_answers_as_vllm_does(
    lora_gateway: Gateway, lora_server: VllmProcess
) -> None:
    with openai_sdk(lora_gateway.url) as sdk:
        assert ask(sdk, "sql") == _direct(lora_server, "sql")
        assert ask(sdk, BASE) == _direct(lora_server, BASE)
    assert _direct(lora_server, "sql") != _direct(lora_server, BASE)


def test_an_adapter_is_loaded_once_by_its_first_requests(
    lora_gateway: Gateway, lora_server: VllmProcess
) -> None:
    pool = lora_gateway.state.fleet.models["legal"]
    assert isinstance(pool, AdapterPool)
    loaded_before = pool.loads_total["loaded"]
    assert "legal" not in _served(lora_server)
    with (
        openai_sdk(lora_gateway.url) as sdk,
        concurrent.futures.ThreadPoolExecutor(6) as threads,
    ):
        answers = list(threads.map(lambda _: ask(sdk, "legal"), range(6)))
        assert pool.loads_total["loaded"] == loaded_before + 1  # one load for all six
        assert "legal" in _served(lora_server)
        assert set(answers) == {_direct(lora_server, "legal")}
        assert answers[0] != _direct(lora_server, BASE)
        stream = sdk.chat.completions.create(
            model="legal", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True
        )
        assert [chunk.model for chunk in stream] and pool.loads_total["loaded"] == loaded_before + 1
    samples = scrape(lora_gateway.url)
    worker = _url(lora_server)
    assert value(samples, "furnace_gateway_worker_adapter_loaded", model="legal", worker=worker)
    assert value(samples, "furnace_gateway_worker_adapter_loaded", model="sql", worker=worker)
    assert value(samples, "furnace_gateway_adapter_loads_total", model="legal", outcome="loaded")


def test_an_adapter_that_cannot_be_loaded_is_the_operators_error(lora_gateway: Gateway) -> None:
    refused_load(lora_gateway, "nowhere")
    samples = scrape(lora_gateway.url)
    assert value(samples, "furnace_gateway_adapter_loads_total", model="nowhere", outcome="failed")


def test_a_restarted_server_gets_the_adapter_again(
    gateway_with: Callable[..., Gateway], lora_server: VllmProcess, adapters: dict[str, Path]
) -> None:
    # health checked seldom: the gateway learns of the restart from the adapter's 404
    gw = gateway_with(models=_models(lora_server, adapters), health_check_interval=120.0)
    pool = gw.state.fleet.models["chat"]
    assert isinstance(pool, AdapterPool)
    with openai_sdk(gw.url) as sdk:
        first = ask(sdk, "chat")
        assert pool.holds(next(iter(pool.workers.values())))
        lora_server.restart()
        assert "chat" not in _served(lora_server)
        assert ask(sdk, "chat") == first
    assert "chat" in _served(lora_server)
    assert pool.loads_total["loaded"] == 2


@pytest.mark.parametrize(
    ("entry", "error"),
    [
        ({"name": "a", "adapter_of": "nobody"}, "models[1].adapter_of: not another model"),
        (
            {"name": "a", "adapter_of": BASE, "workers": ["http://x/v1"]},
            "models[1].workers: an adapter takes its base model's",
        ),
        ({"name": "a", "adapter_path": "/x"}, "models[1].adapter_path: only with adapter_of"),
    ],
)
def test_an_adapter_entry_is_checked(entry: dict[str, Any], error: str) -> None:
    raw = {"models": [{"name": BASE, "upstream": "openai", "workers": ["http://h/v1"]}, entry]}
    with pytest.raises(ConfigError, match=error.replace("[", r"\[").replace("]", r"\]")):
        parse_config(raw, env={})


@pytest.mark.parametrize(
    "base",
    [
        {"upstream": "vllm-grpc", "tokenizer": None},  # vLLM's gRPC server takes no adapter
        {"upstream": "kserve-grpc", "kind": "tensor"},
    ],
)
def test_only_a_grpc_or_openai_model_takes_adapters(base: dict[str, Any], vllm_model: Path) -> None:
    if "tokenizer" in base:
        base = {**base, "tokenizer": str(vllm_model)}
    raw = {
        "models": [
            {"name": "g", "workers": ["127.0.0.1:1"], **base},
            {"name": "a", "adapter_of": "g", "adapter_path": "/x"},
        ]
    }
    with pytest.raises(ConfigError, match="not an `upstream: grpc` or `upstream: openai` LLM"):
        parse_config(raw, env={})


def test_our_workers_model_takes_adapters() -> None:
    raw = {
        "models": [
            {"name": "g", "workers": ["127.0.0.1:1"]},
            {"name": "a", "adapter_of": "g", "adapter_path": "/x"},
        ]
    }
    adapter = parse_config(raw, env={}).models[1]
    assert adapter.upstream == "grpc" and adapter.workers == ("127.0.0.1:1",)


def test_an_adapters_prompt_is_counted_by_its_base_without_a_load(lora_gateway: Gateway) -> None:
    def count(model: str) -> int:
        body = {"model": model, "messages": [{"role": "user", "content": PROMPT}]}
        url = f"{lora_gateway.url}/v1/messages/count_tokens"
        answer = httpx.post(url, json=body, timeout=HANG_GUARD)
        assert answer.status_code == 200, answer.text
        return int(answer.json()["input_tokens"])

    assert count("nowhere") == count(BASE) > 0  # an adapter no worker can load
    pool = lora_gateway.state.fleet.models["nowhere"]
    assert isinstance(pool, AdapterPool)
    assert not pool.loads_total
