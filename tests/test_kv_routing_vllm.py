"""KV-aware routing against real vLLM (CPU build, the tiny model), started with prefix
caching and KV-cache events: two of vLLM's own gRPC servers behind a gateway with
`routing: {policy: kv_aware}` and no further setting (their `SubscribeKvEvents` streams),
and two of vLLM's OpenAI HTTP servers behind a gateway whose `routing.kv_events` names
each one's ZMQ publisher. The events reach the index with the token ids the gateway
encodes itself, and a repeated long prefix goes to the worker that holds it. Two vLLM
servers are heavy on a 2-core machine: one test each, each pair started only for it."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from gateway.config import ModelConfig, RoutingConfig
from gateway.fleet.kv_index import KvIndex
from tests.support.processes import free_port
from tests.support.servers import Gateway
from tests.support.vllm import VllmProcess, start_grpc_server, start_http_server
from tests.support.vllm_worker import start_vllm_worker
from tests.support.waiting import HANG_GUARD, wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

MODEL = "tiny-kv"


def _events_args(port: int | None = None) -> tuple[str, ...]:
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        # a bind address, or vLLM loses every event
        "endpoint": f"tcp://*:{port or free_port()}",
    }
    return ("--enable-prefix-caching", "--kv-events-config", json.dumps(config))


@pytest.fixture(scope="module")
def engines(
    vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VllmProcess]]:
    servers: list[VllmProcess] = []
    try:
        for i in range(2):
            logs = tmp_path_factory.mktemp(f"vllm-kv-{i}")
            servers.append(start_grpc_server(vllm_model, logs, _events_args()))
        yield servers
    finally:
        for server in servers:
            server.stop()


def test_vllm_events_reach_the_index_and_a_long_prefix_goes_to_its_holder(
    engines: list[VllmProcess],
    vllm_model: Path,
    gateway_with: Callable[..., Gateway],
) -> None:
    workers = tuple(f"127.0.0.1:{s.port}" for s in engines)
    model = ModelConfig(
        MODEL,
        upstream="vllm-grpc",
        tokenizer=str(vllm_model),
        workers=workers,
        routing=RoutingConfig(),
    )
    gw = gateway_with(models=(model,))
    router = gw.state.fleet.models[MODEL].router
    assert router is not None
    index: KvIndex = router.index
    document = " ".join(f"line {i} of the shared document," for i in range(40))
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD * 4) as http:

        def ask(question: str) -> None:
            body = {"model": MODEL, "prompt": f"{document} {question}", "max_tokens": 2}
            assert http.post("/v1/completions", json=body).status_code == 200

        ask("first")
        wait_until(lambda: bool(index.holders), "the first prompt's blocks in the index", 60)
        (holder,) = [w for w, kv in index.workers.items() if kv.blocks]
        assert router.states[holder] == "events"  # vLLM sends nothing until its first event
        assert index.block_size > 0
        assert index.workers[holder].load is not None  # load records ride along
        for i in range(4):
            ask(f"again {i}")
            assert router.last.cache_hit_blocks >= 1
            assert router.last.policy == "kv_aware"
        # every repeat went to the holder: the other still holds nothing of it
        others = [w for w in workers if w != holder]
        assert all(not index.workers[w].blocks for w in others if w in index.workers)


@pytest.fixture(scope="module")
def http_engines(
    vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[tuple[VllmProcess, str]]]:
    """Two OpenAI HTTP servers, each with the ZMQ endpoint its engine publishes on."""
    servers: list[tuple[VllmProcess, str]] = []
    try:
        for i in range(2):
            logs, port = tmp_path_factory.mktemp(f"vllm-http-kv-{i}"), free_port()
            server = start_http_server(vllm_model, logs, MODEL, _events_args(port))
            servers.append((server, f"tcp://127.0.0.1:{port}"))
        yield servers
    finally:
        for server, _ in servers:
            server.stop()


def test_vllm_http_servers_events_over_zmq_route_a_long_prefix_to_its_holder(
    http_engines: list[tuple[VllmProcess, str]],
    vllm_model: Path,
    gateway_with: Callable[..., Gateway],
) -> None:
    urls = tuple(f"http://127.0.0.1:{server.port}/v1" for server, _ in http_engines)
    endpoints = [endpoint for _, endpoint in http_engines]
    model = ModelConfig(
        MODEL,
        upstream="openai",
        tokenizer=str(vllm_model),
        workers=urls,
        routing=RoutingConfig(kv_events=tuple(zip(urls, endpoints, strict=True))),
    )
    gw = gateway_with(models=(model,))
    router = gw.state.fleet.models[MODEL].router
    assert router is not None
    index: KvIndex = router.index
    document = " ".join(f"line {i} of the shared document," for i in range(40))
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD * 4) as http:

        def ask(prompt: str) -> None:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
            assert http.post("/v1/completions", json=body).status_code == 200

        # a SUB socket misses what is published before it connects: new documents
        # (new blocks, new events) until one is seen
        for attempt in range(5):
            shared = f"{attempt} {document}"
            ask(f"{shared} first")
            try:
                wait_until(lambda: bool(index.holders), "the first prompt's blocks", 20)
                break
            except AssertionError:
                continue
        (holder,) = [w for w, kv in index.workers.items() if kv.blocks]
        assert router.states[holder] == "events"
        assert index.block_size > 0
        for i in range(4):
            ask(f"{shared} again {i}")
            assert router.last.policy == "kv_aware"
            assert router.last.cache_hit_blocks >= 1  # ids as vLLM's front end makes them
        others = [w for w in urls if w != holder]
        assert all(not index.workers[w].blocks for w in others if w in index.workers)
        assert all(subscriber.malformed == 0 for subscriber in router.zmq.values())


def test_the_vllm_worker_forwards_its_engines_events(
    vllm_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    gateway_with: Callable[..., Gateway],
) -> None:
    """Our worker on `--engine vllm` with vLLM's `--kv-events-config`: it reads its
    engine's ZMQ publisher and serves the events on `SubscribeKvEvents`; a gateway with
    the model's `tokenizer` hashes the prompt's ids and finds the blocks."""
    logs = tmp_path_factory.mktemp("vllm-worker-kv")
    worker = start_vllm_worker(vllm_model, logs, *_events_args(), name=MODEL)
    try:
        address = f"127.0.0.1:{worker.port}"
        model = ModelConfig(
            MODEL, workers=(address,), tokenizer=str(vllm_model), routing=RoutingConfig()
        )
        gw = gateway_with(models=(model,))
        router = gw.state.fleet.models[MODEL].router
        assert router is not None
        wait_until(lambda: router.states.get(address) == "events", "the worker's stream", 60)
        document = " ".join(f"line {i} of the shared document," for i in range(40))
        with httpx.Client(base_url=gw.url, timeout=HANG_GUARD * 4) as http:

            def ask(prompt: str) -> None:
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
                assert http.post("/v1/completions", json=body).status_code == 200

            ask(f"{document} first")
            index = router.index
            wait_until(lambda: bool(index.holders), "the engine's blocks, forwarded", 60)
            assert index.workers[address].load is not None
            ask(f"{document} again")
            assert router.last.cache_hit_blocks >= 1
    finally:
        worker.stop()
