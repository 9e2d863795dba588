"""KV-aware routing against real vLLM (CPU build, the tiny model), started with prefix
caching and KV-cache events: two of vLLM's own gRPC servers behind a gateway with
`routing: {policy: kv_aware}` and no further setting (their `SubscribeKvEvents` streams),
and two of vLLM's OpenAI HTTP servers behind a gateway whose `routing.kv_events` names
each one's ZMQ publisher. The events reach the index with the token ids the gateway
encodes itself, a repeated long prefix goes to the worker that holds it, an engine
restarted under the gateway leaves the index and is followed again, and the blocks a
small cache evicts leave it. vLLM servers are heavy on a 2-core machine: each pair is
started once for the module (a restart spec restarts one of them within itself), the
small-cache engine and our worker only for their specs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import ModelConfig, RoutingConfig
from gateway.fleet.kv_index import KvIndex
from gateway.fleet.pool import ModelPool
from gateway.fleet.routing import Router
from tests.support.processes import free_port
from tests.support.servers import Gateway
from tests.support.vllm import (
    VllmProcess,
    kv_events_args,
    start_grpc_server,
    start_http_server,
)
from tests.support.vllm_worker import start_vllm_worker
from tests.support.waiting import HANG_GUARD, wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

MODEL = "tiny-kv"
#: A long prompt: ~950 of the tiny model's tokens, 7 of vLLM's CPU KV blocks (128 tokens).
DOCUMENT = " ".join(f"line {i} of the shared document," for i in range(40))
#: Seconds between the restart specs' gateways' health checks: a stopped engine shows
#: soon (each check may take `health_check_timeout`, 5 s by default).
HEALTH = 2.0


@dataclass
class Routed:
    """A gateway serving MODEL with `kv_aware` routing: its pool, router and index, and a
    client of it."""

    pool: ModelPool
    router: Router
    http: httpx.Client

    @property
    def index(self) -> KvIndex:
        return self.router.index

    def ask(self, prompt: str, model: str = MODEL) -> None:
        body = {"model": model, "prompt": prompt, "max_tokens": 2}
        answer = self.http.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text

    def blocks(self, address: str) -> dict[int, int]:
        """The blocks the index has of the worker (engine hash: ours), none without an entry."""
        kv = self.index.workers.get(address)
        return {} if kv is None else kv.blocks

    def holders(self) -> list[str]:
        """The workers the index has blocks of."""
        return [address for address, kv in self.index.workers.items() if kv.blocks]

    def store(
        self, label: str, on: str | None = None, ask: Callable[[str], None] | None = None
    ) -> str:
        """A new document asked until the index has more blocks (of worker `on` when
        named), by `ask` (the gateway's MODEL by default): a subscription misses what
        its engine published before it was made (a ZMQ SUB socket connects after the
        gateway starts, vLLM's gRPC relay is live only). The document that got there."""

        def count() -> int:
            return len(self.blocks(on)) if on else len(self.index.holders)

        for attempt in range(5):
            before, document = count(), f"{label} {attempt} {DOCUMENT}"
            (ask or self.ask)(f"{document} first")
            try:
                wait_until(lambda b=before: count() > b, f"the blocks of {label} {attempt}", 20)
                return document
            except AssertionError:
                continue
        raise AssertionError(f"no blocks of 5 {label} documents in the index")


@contextmanager
def routed(
    gateway_with: Callable[..., Gateway], *models: ModelConfig, **settings: Any
) -> Iterator[Routed]:
    """A gateway serving `models` (the first one MODEL, routed) and a client of it."""
    gw = gateway_with(models=models, **settings)
    pool = gw.state.fleet.models[MODEL]
    assert pool.router is not None
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD * 4) as http:
        yield Routed(pool, pool.router, http)


def _grpc_address(server: VllmProcess) -> str:
    return f"127.0.0.1:{server.port}"


def _grpc_model(
    vllm_model: Path, *servers: VllmProcess, name: str = MODEL, kv_aware: bool = True
) -> ModelConfig:
    """`upstream: vllm-grpc` on `servers`, with `kv_aware` routing when asked."""
    return ModelConfig(
        name,
        upstream="vllm-grpc",
        tokenizer=str(vllm_model),
        workers=tuple(_grpc_address(s) for s in servers),
        routing=RoutingConfig() if kv_aware else None,
    )


def _restart_spec(
    kv: Routed,
    servers: list[VllmProcess],
    addresses: list[str],
    ask_on: Callable[[int, str], None],
) -> None:
    """The worker holding a long prefix has its vLLM stopped and started again on its
    port: its part of the index goes when it stops and stays empty until the new engine
    stores, the prefix is never scored as a hit on it in between (it goes to the other
    worker, which then holds it), and the new engine's events are followed (`ask_on(i,
    prompt)` asks server `i`, the worker at `addresses[i]`, itself)."""
    document = kv.store("restart")
    (holder,) = kv.holders()
    (other,) = [address for address in addresses if address != holder]
    held = addresses.index(holder)
    server = servers[held]
    worker = kv.pool.workers[holder]
    server.stop()
    wait_until(lambda: not kv.blocks(holder), "the stopped engine's blocks gone", 60)
    wait_until(lambda: worker.serving is False, "the stopped engine seen down", 60)
    kv.ask(f"{document} while it is down")
    assert kv.router.last.cache_hit_blocks == 0
    wait_until(lambda: bool(kv.blocks(other)), "the other worker's blocks of it", 60)

    server.restart()
    wait_until(lambda: worker.serving is True, "the restarted engine seen up", 60)
    kv.ask(f"{document} after the restart")
    assert kv.router.last.cache_hit_blocks >= 1  # the other worker's, not stale ones
    assert not kv.blocks(holder)  # nothing of the old engine came back

    fresh = kv.store("restarted", on=holder, ask=partial(ask_on, held))
    assert kv.router.states[holder] == "events"
    kv.ask(f"{fresh} again")
    assert kv.router.last.cache_hit_blocks >= 1  # the restarted engine's: only it holds it
    assert kv.router.last.policy == "kv_aware"


@pytest.fixture(scope="module")
def engines(
    vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VllmProcess]]:
    servers: list[VllmProcess] = []
    try:
        for i in range(2):
            logs = tmp_path_factory.mktemp(f"vllm-kv-{i}")
            servers.append(start_grpc_server(vllm_model, logs, kv_events_args()))
        yield servers
    finally:
        for server in servers:
            server.stop()


def test_vllm_events_reach_the_index_and_a_long_prefix_goes_to_its_holder(
    engines: list[VllmProcess],
    vllm_model: Path,
    gateway_with: Callable[..., Gateway],
) -> None:
    with routed(gateway_with, _grpc_model(vllm_model, *engines)) as kv:
        kv.ask(f"{DOCUMENT} first")
        wait_until(lambda: bool(kv.index.holders), "the first prompt's blocks in the index", 60)
        (holder,) = kv.holders()
        assert kv.router.states[holder] == "events"  # vLLM sends nothing until its first event
        assert kv.index.block_size > 0
        assert kv.index.workers[holder].load is not None  # load records ride along
        for i in range(4):
            kv.ask(f"{DOCUMENT} again {i}")
            assert kv.router.last.cache_hit_blocks >= 1
            assert kv.router.last.policy == "kv_aware"
        # every repeat went to the holder: the other still holds nothing of it
        assert kv.holders() == [holder]


def test_a_restarted_vllm_grpc_engine_leaves_the_index_and_is_followed_again(
    engines: list[VllmProcess],
    vllm_model: Path,
    gateway_with: Callable[..., Gateway],
) -> None:
    """Restarts one of the module's engines within the spec: the next specs find it up."""
    alone = [
        _grpc_model(vllm_model, s, name=f"{MODEL}-{i}", kv_aware=False)
        for i, s in enumerate(engines)
    ]
    model = _grpc_model(vllm_model, *engines)
    with routed(gateway_with, model, *alone, health_check_interval=HEALTH) as kv:
        addresses = [_grpc_address(s) for s in engines]
        _restart_spec(kv, engines, addresses, lambda i, prompt: kv.ask(prompt, f"{MODEL}-{i}"))


#: The small-cache engine's KV blocks (vLLM's --num-gpu-blocks-override, which its CPU
#: build honours): one request of the whole context (1,024 tokens, 8 blocks), the null
#: block vLLM keeps, and a spare; each DOCUMENT fills 7.
SMALL_CACHE = 10


def test_blocks_a_small_vllm_cache_evicts_leave_the_index(
    vllm_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    gateway_with: Callable[..., Gateway],
) -> None:
    """New prompts evict the first one's blocks from the engine's cache: its
    BlockRemoved events take them out of the index (not the gateway's own cap, not a
    reset), the index never has more blocks than the cache, and the evicted prefix is
    no longer scored as a hit."""
    logs = tmp_path_factory.mktemp("vllm-kv-small")
    small = ("--num-gpu-blocks-override", str(SMALL_CACHE))
    server = start_grpc_server(vllm_model, logs, (*kv_events_args(), *small))
    address = _grpc_address(server)
    try:
        with routed(gateway_with, _grpc_model(vllm_model, server)) as kv:
            first = kv.store("evicted")
            entry = kv.index.workers[address]
            held, resets = set(entry.blocks), entry.resets
            kv.ask(f"{first} again")
            assert kv.router.last.cache_hit_blocks >= 1  # a hit while the cache holds it
            for i in range(4):  # 4 x 7 blocks through a cache of 10
                kv.ask(f"other {i} {DOCUMENT}")
                assert len(kv.blocks(address)) <= SMALL_CACHE
            wait_until(
                lambda: not held & set(kv.blocks(address)), "the first prompt's blocks removed", 60
            )
            assert kv.index.workers[address] is entry  # the same stream all along
            assert (entry.resets, entry.evicted) == (resets, 0)  # the engine's removals did it
            assert 0 < len(entry.blocks) <= SMALL_CACHE
            kv.ask(f"{first} once more")
            assert kv.router.last.cache_hit_blocks == 0
            assert kv.router.last.policy == "kv_aware"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def http_engines(
    vllm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[tuple[VllmProcess, str]]]:
    """Two OpenAI HTTP servers, each with the ZMQ endpoint its engine publishes on."""
    servers: list[tuple[VllmProcess, str]] = []
    try:
        for i in range(2):
            logs, port = tmp_path_factory.mktemp(f"vllm-http-kv-{i}"), free_port()
            server = start_http_server(vllm_model, logs, MODEL, kv_events_args(port))
            servers.append((server, f"tcp://127.0.0.1:{port}"))
        yield servers
    finally:
        for server, _ in servers:
            server.stop()


def _http_url(server: VllmProcess) -> str:
    return f"http://127.0.0.1:{server.port}/v1"


def _http_model(vllm_model: Path, http_engines: list[tuple[VllmProcess, str]]) -> ModelConfig:
    """`upstream: openai` on the HTTP servers, routed on their ZMQ publishers' events."""
    urls = tuple(_http_url(server) for server, _ in http_engines)
    endpoints = [endpoint for _, endpoint in http_engines]
    return ModelConfig(
        MODEL,
        upstream="openai",
        tokenizer=str(vllm_model),
        workers=urls,
        routing=RoutingConfig(kv_events=tuple(zip(urls, endpoints, strict=True))),
    )


def test_vllm_http_servers_events_over_zmq_route_a_long_prefix_to_its_holder(
    http_engines: list[tuple[VllmProcess, str]],
    vllm_model: Path,
    gateway_with: Callable[..., Gateway],
) -> None:
    with routed(gateway_with, _http_model(vllm_model, http_engines)) as kv:
        shared = kv.store("zmq")
        (holder,) = kv.holders()
        assert kv.router.states[holder] == "events"
        assert kv.index.block_size > 0
        for i in range(4):
            kv.ask(f"{shared} again {i}")
            assert kv.router.last.policy == "kv_aware"
            assert kv.router.last.cache_hit_blocks >= 1  # ids as vLLM's front end makes them
        assert kv.holders() == [holder]
        assert all(subscriber.malformed == 0 for subscriber in kv.router.zmq.values())


def test_a_restarted_vllm_http_server_leaves_the_index_and_is_followed_again(
    http_engines: list[tuple[VllmProcess, str]],
    vllm_model: Path,
    gateway_with: Callable[..., Gateway],
) -> None:
    """As for the gRPC servers, over ZMQ: the subscriber sees the publisher's
    connection drop (a reset) and connects to the new one by itself."""
    servers = [server for server, _ in http_engines]

    def ask_on(i: int, prompt: str) -> None:
        url = f"{_http_url(servers[i])}/completions"
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
        assert httpx.post(url, json=body, timeout=HANG_GUARD * 4).status_code == 200

    model = _http_model(vllm_model, http_engines)
    with routed(gateway_with, model, health_check_interval=HEALTH) as kv:
        _restart_spec(kv, servers, [_http_url(s) for s in servers], ask_on)
        assert all(subscriber.malformed == 0 for subscriber in kv.router.zmq.values())


def test_the_vllm_worker_forwards_its_engines_events(
    vllm_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    gateway_with: Callable[..., Gateway],
) -> None:
    """Our worker on `--engine vllm` with vLLM's `--kv-events-config`: it reads its
    engine's ZMQ publisher and serves the events on `SubscribeKvEvents`; a gateway with
    the model's `tokenizer` hashes the prompt's ids and finds the blocks."""
    logs = tmp_path_factory.mktemp("vllm-worker-kv")
    worker = start_vllm_worker(vllm_model, logs, *kv_events_args(), name=MODEL)
    try:
        address = f"127.0.0.1:{worker.port}"
        model = ModelConfig(
            MODEL, workers=(address,), tokenizer=str(vllm_model), routing=RoutingConfig()
        )
        with routed(gateway_with, model) as kv:
            wait_until(lambda: kv.router.states.get(address) == "events", "the stream", 60)
            kv.ask(f"{DOCUMENT} first")
            wait_until(lambda: bool(kv.index.holders), "the engine's blocks, forwarded", 60)
            assert kv.index.workers[address].load is not None
            kv.ask(f"{DOCUMENT} again")
            assert kv.router.last.cache_hit_blocks >= 1
    finally:
        worker.stop()
