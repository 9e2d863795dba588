"""Routing by what the engines hold (issue 26), against real gRPC workers whose demo
engine models a prefix cache and publishes its KV events (`SubscribeKvEvents`), and the
real gateway under uvicorn: the index follows every store and removal, a repeated long
prefix goes to the worker that holds it, a worker that goes away takes its part of the
index with it and comes back empty, two gateway replicas converge to the same index, a
session stays on its worker until that worker is overloaded, and a hostile event stream
is bounded, counted and never stops the routing."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import httpx
import pytest

from gateway.config import ModelConfig, RoutingConfig
from gateway.fleet.balancing import PrefixAffinity
from gateway.fleet.kv_index import KvIndex
from gateway.fleet.pool import ModelPool
from gateway.fleet.routing import LOAD_FRESH, Router
from gateway.fleet.worker import EjectionPolicy, Worker
from gateway.protocol.kv_blocks import (
    BlocksRemoved,
    BlocksStored,
    CacheCleared,
    EngineLoad,
    KvBatch,
    chain,
)
from gateway.protocol.types import GenerateRequest
from gateway.worker.demo import DemoEngine
from gateway.worker.kv_events import KvPublisher
from gateway.worker.server import WorkerServer
from tests.support.servers import Gateway, ServerLoop
from tests.support.waiting import HANG_GUARD, wait_until

MODEL = "kv-demo"
#: ~40 blocks of 16 bytes: a shared document a conversation starts with.
DOCUMENT = " ".join(f"word{i}" for i in range(110))


def _engines(count: int, **options: Any) -> list[DemoEngine]:
    return [DemoEngine(MODEL, max_context=100_000, **options) for _ in range(count)]


def _model(servers: list[WorkerServer], **routing: Any) -> ModelConfig:
    return ModelConfig(
        MODEL, workers=tuple(s.address for s in servers), routing=RoutingConfig(**routing)
    )


def _pool(gw: Gateway) -> ModelPool:
    return gw.state.fleet.models[MODEL]


def _index(gw: Gateway) -> KvIndex:
    router = _pool(gw).router
    assert router is not None
    return router.index


def _ask(http: httpx.Client, prompt: str, **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, **extra.pop("body", {})}
    response = http.post("/v1/completions", json=body, **extra)
    assert response.status_code == 200, response.text
    return response


def _mirrors(gw: Gateway, server: WorkerServer, engine: DemoEngine) -> bool:
    """The gateway's index holds exactly the engine's blocks for that worker."""
    kv = _index(gw).workers.get(server.address)
    assert engine.kv_cache is not None
    return kv is not None and set(kv.blocks) == set(engine.kv_cache.blocks)


@pytest.fixture
def http_of() -> Iterator[Callable[[Gateway], httpx.Client]]:
    clients: list[httpx.Client] = []

    def make(gw: Gateway) -> httpx.Client:
        clients.append(httpx.Client(base_url=gw.url, timeout=HANG_GUARD))
        return clients[-1]

    yield make
    for http in clients:
        http.close()


def test_the_index_follows_every_store_and_removal(
    serve_engines: Callable[..., list[WorkerServer]],
    gateway_with: Callable[..., Gateway],
    http_of: Callable[[Gateway], httpx.Client],
) -> None:
    engines = _engines(2, kv_blocks=64)
    servers = serve_engines(*engines)
    gw = gateway_with(models=(_model(servers),))
    http = http_of(gw)
    wait_until(lambda: len(_index(gw).workers) == 2, "both workers' event streams")
    for i in range(12):  # 12 prompts of ~40 blocks through caches of 64: evictions
        _ask(http, f"{i} {DOCUMENT}")
        for server, engine in zip(servers, engines, strict=True):
            wait_until(lambda s=server, e=engine: _mirrors(gw, s, e), "the index to mirror")
    assert sum(len(e.kv_cache.blocks) for e in engines if e.kv_cache) > 64  # both used
    snapshot = gw.state.fleet.snapshot()
    (model,) = [m for m in snapshot["models"] if m["name"] == MODEL]  # type: ignore[attr-defined]
    for worker in model["workers"]:
        assert worker["routing"]["events"] == "events"
        assert worker["routing"]["cached_blocks"] <= 64
    metrics = http.get("/metrics").text
    assert f'furnace_gateway_worker_kv_cached_blocks{{model="{MODEL}"' in metrics
    assert f'furnace_gateway_kv_index_bytes{{model="{MODEL}"}}' in metrics


def test_a_repeated_long_prefix_goes_to_the_worker_that_holds_it(
    serve_engines: Callable[..., list[WorkerServer]],
    gateway_with: Callable[..., Gateway],
    http_of: Callable[[Gateway], httpx.Client],
) -> None:
    engines = _engines(3)
    servers = serve_engines(*engines)
    gw = gateway_with(models=(_model(servers),))
    http = http_of(gw)
    wait_until(lambda: len(_index(gw).workers) == 3, "the workers' event streams")
    for doc in range(3):  # three documents, each asked about five times in turn
        document = f"document {doc}: {DOCUMENT}"
        served = [e.served for e in engines]
        _ask(http, f"{document} question 0")
        (holder,) = [e for e, n in zip(engines, served, strict=True) if e.served > n]
        wait_until(lambda d=document: _index_holds(_index(gw), d), "the stores to reach it")
        for question in range(1, 5):
            _ask(http, f"{document} question {question}")
        assert holder.served == served[engines.index(holder)] + 5
    router = _pool(gw).router
    assert router is not None and router.last.policy == "kv_aware"
    assert router.last.cache_hit_blocks >= len(f"document 2: {DOCUMENT}") // 16 - 1


def _index_holds(index: KvIndex, text: str) -> bool:
    hashes = chain(tuple(text.encode()), 16)
    return bool(hashes) and all(h in index.holders for h in hashes)


def test_a_worker_that_goes_away_takes_its_part_and_comes_back_empty(
    server_loop: ServerLoop,
    serve_engines: Callable[..., list[WorkerServer]],
    gateway_with: Callable[..., Gateway],
    http_of: Callable[[Gateway], httpx.Client],
) -> None:
    engines = _engines(2)
    servers = serve_engines(*engines)
    gw = gateway_with(models=(_model(servers),), health_check_interval=0.2)
    http = http_of(gw)
    index = _index(gw)
    wait_until(lambda: len(index.workers) == 2, "both workers' event streams")
    for i in range(6):
        _ask(http, f"{i} {DOCUMENT}")
    wait_until(lambda: all(_mirrors(gw, s, e) for s, e in zip(servers, engines, strict=True)), "")
    gone, stays = servers
    port = gone.port
    server_loop.call(gone.stop(0))
    wait_until(lambda: gone.address not in index.workers, "its part of the index to go")
    router = _pool(gw).router
    assert router is not None
    wait_until(lambda: router.states.get(gone.address) == "broken", "the stream marked broken")
    for i in range(4):  # still served, by the other
        _ask(http, f"{i} {DOCUMENT}")
    # the same address, a new engine: subscribed again, from its (empty) state
    (back,) = serve_engines(DemoEngine(MODEL, max_context=100_000), port=port)
    wait_until(lambda: back.address in index.workers, "the worker's stream again", 60)
    assert len(index.workers[back.address].blocks) == 0
    wait_until(lambda: router.states.get(back.address) == "events", "its events followed")
    del stays


def test_workers_without_events_fall_back_visibly(
    serve_engines: Callable[..., list[WorkerServer]],
    gateway_with: Callable[..., Gateway],
    http_of: Callable[[Gateway], httpx.Client],
) -> None:
    servers = serve_engines(*_engines(2, kv_blocks=0))
    gw = gateway_with(models=(_model(servers),))
    http = http_of(gw)
    router = _pool(gw).router
    assert router is not None
    wait_until(
        lambda: all(router.states.get(s.address) == "unsupported" for s in servers),
        "the workers to say they publish nothing",
    )
    for i in range(4):
        _ask(http, f"{i} {DOCUMENT}")
    assert router.last.reason == "fallback"
    assert router.fallbacks_total >= 4
    metrics = http.get("/metrics").text
    assert 'state="unsupported"' in metrics


def test_two_replicas_converge_to_the_same_index(
    serve_engines: Callable[..., list[WorkerServer]],
    gateway_with: Callable[..., Gateway],
    http_of: Callable[[Gateway], httpx.Client],
) -> None:
    engines = _engines(2, kv_blocks=128)
    servers = serve_engines(*engines)
    first = gateway_with(models=(_model(servers),))
    for i in range(5):  # blocks stored before the second replica exists
        _ask(http_of(first), f"{i} {DOCUMENT}")
    second = gateway_with(models=(_model(servers),))
    for i in range(5, 10):
        _ask(http_of(second if i % 2 else first), f"{i} {DOCUMENT}")

    def same() -> bool:
        a, b = _index(first), _index(second)
        return (
            bool(a.holders)
            and set(a.holders) == set(b.holders)
            and all(set(a.workers[w].blocks) == set(b.workers[w].blocks) for w in a.workers)
            and set(a.workers) == set(b.workers)
        )

    wait_until(same, "the two replicas' indexes to agree")


def test_a_session_stays_on_its_worker_until_it_is_overloaded(
    serve_engines: Callable[..., list[WorkerServer]],
    gateway_with: Callable[..., Gateway],
    http_of: Callable[[Gateway], httpx.Client],
) -> None:
    engines = _engines(2, token_delay=0.05)
    servers = serve_engines(*engines)
    gw = gateway_with(models=(_model(servers, policy="round_robin"),))
    http = http_of(gw)
    _ask(http, "hello", headers={"x-session-id": "conversation-1"})
    (holder,) = [e for e in engines if e.served]
    for i in range(5):  # round robin would alternate; the session keeps its worker
        _ask(http, f"turn {i}", headers={"x-session-id": "conversation-1"})
    assert holder.served == 6
    router = _pool(gw).router
    assert router is not None and router.last.reason == "session"
    for i in range(4):  # the OpenAI `user` is a session key too
        _ask(http, f"turn {i}", body={"user": "someone"})
    assert sorted(e.served for e in engines) in ([4, 6], [0, 10])
    before = [e.served for e in engines]
    for i in range(4):  # and OpenAI's `prompt_cache_key`, before `user`
        _ask(http, f"turn {i}", body={"prompt_cache_key": "prefix-1", "user": f"u{i}"})
    assert sorted(e.served - n for e, n in zip(engines, before, strict=True)) == [0, 4]
    before = [e.served for e in engines]
    for i in range(4):  # and Claude Code's session header
        _ask(http, f"turn {i}", headers={"x-claude-code-session-id": "5f1c-claude"})
    assert sorted(e.served - n for e, n in zip(engines, before, strict=True)) == [0, 4]
    refused = http.post(
        "/v1/completions",
        json={"model": MODEL, "prompt": "a", "prompt_cache_key": "k" * 257},
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt_cache_key"
    # 8 turns of one session at once: past 1.5x the average load, it moves
    before = [e.served for e in engines]
    with ThreadPoolExecutor(8) as pool:
        list(
            pool.map(
                lambda i: _ask(
                    http_of(gw),
                    f"at once {i}",
                    headers={"x-session-id": "hot"},
                    body={"max_tokens": 20, "ignore_eos": True},
                ),
                range(8),
            )
        )
    assert all(e.served > n for e, n in zip(engines, before, strict=True))
    assert router.session_moves_total >= 1


class _HostilePublisher(KvPublisher):
    """A worker's event stream that is wrong in every way it can be."""

    def __init__(self, block_size: int = 16) -> None:
        super().__init__(lambda: ())
        self.sent = asyncio.Event()

    async def subscribe(self, load: EngineLoad | None = None) -> AsyncIterator[KvBatch]:
        block = bytes(range(16))
        yield KvBatch(1, (), True, EngineLoad(1, 2, 3, math.nan))
        # a batch far too big (refused whole), then one out of order
        yield KvBatch(2, (BlocksStored(tuple(range(70_000)), None, b"", 16),))
        yield KvBatch(1, (BlocksStored((7,), None, block, 16),))
        # tokens that do not fill the blocks; an unknown parent; removals of nothing
        yield KvBatch(3, (BlocksStored((8, 9), None, block, 16),))
        yield KvBatch(4, (BlocksStored((10,), 999, block, 16), BlocksRemoved((123, 456))))
        # a gap, then a block of another size, then a clear and one good block
        yield KvBatch(9, (BlocksStored((11,), None, block, 16),))
        yield KvBatch(10, (BlocksStored((12,), None, bytes(8), 8),))
        yield KvBatch(11, (CacheCleared(), BlocksStored((13,), None, block, 16)))
        self.sent.set()
        await asyncio.get_running_loop().create_future()


class _HostileEngine(DemoEngine):
    def __init__(self) -> None:
        super().__init__(MODEL, max_context=100_000, kv_blocks=0)
        self.publisher = _HostilePublisher()

    def kv_events(self) -> KvPublisher | None:
        return self.publisher


def test_a_hostile_event_stream_is_bounded_and_never_stops_routing(
    serve_engines: Callable[..., list[WorkerServer]],
    gateway_with: Callable[..., Gateway],
    http_of: Callable[[Gateway], httpx.Client],
    caplog: pytest.LogCaptureFixture,
) -> None:
    hostile = _HostileEngine()
    good = DemoEngine(MODEL, max_context=100_000)
    servers = serve_engines(hostile, good)
    gw = gateway_with(models=(_model(servers),))
    http = http_of(gw)
    index = _index(gw)
    address = servers[0].address
    wait_until(lambda: address in index.workers and index.workers[address].sequence == 11, "")
    kv = index.workers[address]
    assert list(kv.blocks) == [13]  # only the good block after the clear
    assert kv.refused >= 6
    assert kv.load is not None and kv.load.kv_usage == 0.0  # NaN is no use: read as 0
    for i in range(6):
        _ask(http, f"{i} {DOCUMENT}")
    assert hostile.served + good.served == 6
    assert any("KV events of worker" in r.getMessage() for r in caplog.records)


def test_the_index_alone_refuses_what_is_wrong() -> None:
    """KvIndex as a value: bounds and resynchronization, without servers."""
    index = KvIndex(MODEL, cap=80, max_batch=1000)
    tokens = bytes(range(16)) * 50  # 50 blocks
    stored = BlocksStored(tuple(range(100, 150)), None, tokens, 16)
    assert index.apply("a", KvBatch(1, (stored,), True))
    assert len(index.workers["a"].blocks) == 50
    more = BlocksStored(tuple(range(200, 250)), 149, bytes(range(1, 17)) * 50, 16)
    assert index.apply("a", KvBatch(2, (more,)))
    kv = index.workers["a"]
    assert len(kv.blocks) <= 80 and kv.evicted >= 20  # the cap, oldest first
    assert 100 not in kv.blocks and 249 in kv.blocks
    assert index.match(tokens)[0].get("a", 0) == 0  # its start was evicted
    assert index.apply("b", KvBatch(5, (stored,)))
    # the walk: each worker's blocks from the start, and the block it stopped at
    longer = tokens + bytes(range(2, 18)) * 2
    hashes = chain(longer, 16)
    assert index.match(tokens) == ({"b": 50}, hashes[49])  # held to its last block
    assert index.match(list(longer)) == ({"b": 50}, hashes[50])  # ids as bytes alike
    assert index.match(tokens[:15]) == ({}, None)  # shorter than a block
    assert not index.apply("b", KvBatch(6, (BlocksStored(tuple(range(2000)), None, b"", 16),)))
    assert index.match(tokens) == ({}, hashes[0])  # refused whole: b's part dropped
    index.drop("a")
    index.drop("b")
    assert not index.holders and not index.workers


def test_the_index_shares_one_int_for_each_set_of_holders() -> None:
    """Blocks with the same holders share one int (`KvIndex._sets`), and the sets no block
    has any more are forgotten once they are many, without changing what `match` finds:
    13 workers store 1,500 one-block documents, each on its own set of workers, three
    times over (each time a reset and other sets: thousands of sets made, 1,500 left)."""
    index = KvIndex(MODEL)
    documents = [i.to_bytes(16, "big") for i in range(1500)]
    made = 0
    for turn in range(3):
        owners = [((d + 1500 * turn) * 2_654_435_761) % 8191 + 1 for d in range(1500)]
        for w in range(13):  # owners[d]: a bit for each worker
            mine = [d for d in range(1500) if owners[d] >> w & 1]
            stored = tuple(BlocksStored((d,), None, documents[d], 16) for d in mine)
            assert index.apply(f"w{w}", KvBatch(turn + 1, stored, True))
            made = max(made, len(index._sets))
    assert made > 4096 and len(index._sets) == 1500  # pruned to the sets in use
    assert all(index._sets[bits] is bits for bits in index.holders.values())
    for d in (0, 1, 777, 1499):
        held = {f"w{w}": 1 for w in range(13) if owners[d] >> w & 1}
        assert index.match(documents[d] + b"more") == (held, chain(documents[d], 16)[0])
    for w in range(13):
        index.drop(f"w{w}")
    assert not index.holders


def test_vllm_batches_translate_to_what_the_index_can_use() -> None:
    """vLLM's relayed batches (smg-grpc-proto common.proto) as ours: device blocks of the
    base model kept, offloaded, remote, adapter and salted ones left out, the load read."""
    from smg_grpc_proto.generated import common_pb2 as common

    from gateway.upstreams.vllm_kv import batch_from_vllm

    def stored(**fields: Any) -> common.KvCacheEvent:
        block = common.KvBlock(block_hash=5, token_ids=list(range(4)), block_size=4)
        return common.KvCacheEvent(stored=common.KvBlocksStored(blocks=[block], **fields))

    message = common.KvEventBatch(
        sequence_number=7,
        events=[
            stored(),
            stored(tier=common.KV_CACHE_TIER_HOST),
            stored(locality=common.KV_CACHE_LOCALITY_REMOTE),
            stored(lora_name="adapter"),
            stored(cache_salt="salt"),
            common.KvCacheEvent(removed=common.KvBlocksRemoved(block_hashes=[5])),
            common.KvCacheEvent(cleared=common.KvCacheCleared()),
        ],
        load=common.EngineLoad(
            running_requests=2, waiting_requests=1, waiting_uncached_tokens=300, token_usage=0.5
        ),
    )
    batch = batch_from_vllm(message, first=True)
    assert batch.sequence == 7 and batch.reset
    assert batch.events == (
        BlocksStored((5,), None, [0, 1, 2, 3], 4),
        BlocksRemoved((5,)),
        CacheCleared(),
    )
    assert batch.load == EngineLoad(2, 1, 300, 0.5)


def test_an_engine_whose_kv_cache_is_full_makes_its_worker_full(
    serve_engines: Callable[..., list[WorkerServer]],
    gateway_with: Callable[..., Gateway],
    http_of: Callable[[Gateway], httpx.Client],
) -> None:
    """`max_kv_usage` over the demo engine's load records (its cache's use before each
    prompt): a full engine is routed around while another has room, even when it holds
    the prompt, and the model sheds (503, workers_saturated) once every engine is full."""
    engines = _engines(2, kv_blocks=8)  # a DOCUMENT prompt fills a cache
    servers = serve_engines(*engines)
    gw = gateway_with(models=(_model(servers, max_kv_usage=0.9),))
    http = http_of(gw)
    router = _pool(gw).router
    assert router is not None
    wait_until(lambda: len(_index(gw).workers) == 2, "both workers' event streams")

    def served() -> list[int]:
        return [e.served for e in engines]

    def full(engine: DemoEngine) -> bool:
        return router.engine_full(servers[engines.index(engine)].address)

    before = served()
    _ask(http, DOCUMENT)  # its load record: the cache empty before the prompt
    (first,) = [e for e, n in zip(engines, before, strict=True) if e.served > n]
    (other,) = [e for e in engines if e is not first]
    wait_until(lambda: _index_holds(_index(gw), DOCUMENT[: 8 * 16]), "the first stores")
    _ask(http, DOCUMENT)  # to the holder; its record now says its cache is full
    assert first.served == 2
    wait_until(lambda: full(first), "the first engine's full cache in its load record")
    _ask(http, DOCUMENT)  # routed around the full holder
    assert other.served == 1 and not full(other)
    wait_until(lambda: other.kv_cache is not None and other.kv_cache.usage == 1.0, "")
    _ask(http, f"0 {DOCUMENT}")  # the only one with room; then it is full too
    assert other.served == 2
    wait_until(lambda: full(other), "the second engine's full cache in its load record")
    assert _pool(gw).saturated()
    shed = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert shed.status_code == 503, shed.text
    assert "as many requests as it says it can" in shed.json()["error"]["message"]
    assert served() == [2, 2]
    workers = gw.state.fleet.snapshot()["models"]
    (model,) = [m for m in workers if m["name"] == MODEL]  # type: ignore[index]
    assert all(w["routing"]["engine_full"] for w in model["workers"])  # type: ignore[index]


def test_a_load_record_makes_a_worker_full_only_past_its_bounds_and_while_fresh() -> None:
    """Router.engine_full as a value: `max_engine_waiting` (more waiting than it),
    `max_kv_usage` (at least it), a record older than LOAD_FRESH no longer counts, and
    without either setting no record makes a worker full."""
    config = RoutingConfig(max_engine_waiting=2, max_kv_usage=0.9)
    router = Router(MODEL, config, PrefixAffinity(256, 1.5))
    loads = {"two": EngineLoad(waiting=2), "three": EngineLoad(waiting=3)}
    loads |= {"used": EngineLoad(kv_usage=0.9), "room": EngineLoad(waiting=1, kv_usage=0.5)}
    for address, load in loads.items():
        router.index.apply(address, KvBatch(1, (), True, load), now=100.0)
    full = {a for a in loads if router.engine_full(a, now=100.0)}
    assert full == {"three", "used"}
    assert not router.engine_full("three", now=100.0 + LOAD_FRESH + 1)
    assert not router.engine_full("unknown", now=100.0)
    unbounded = Router(MODEL, RoutingConfig(), PrefixAffinity(256, 1.5))
    unbounded.index.apply("three", KvBatch(1, (), True, EngineLoad(waiting=1000)), now=0.0)
    assert not unbounded.sheds


def test_a_busy_load_record_stops_costing_its_worker_once_it_is_stale(
    serve_engines: Callable[..., list[WorkerServer]],
    gateway_with: Callable[..., Gateway],
    http_of: Callable[[Gateway], httpx.Client],
    server_loop: ServerLoop,
) -> None:
    """kv_aware's cost reads an engine's load record only while it is fresh (LOAD_FRESH),
    as `engine_full` does: an idle engine sends none, so its last, busy one would cost it
    as busy for ever. A demo engine whose record says its cache is full is routed around
    even for the prompt it holds; once that record is older than LOAD_FRESH (applied
    with the `now` the index takes, not slept for) it gets the prompt again, and its next
    record, fresh, counts again."""
    engines = _engines(2, kv_blocks=8)  # a DOCUMENT prompt fills a cache
    servers = serve_engines(*engines)
    gw = gateway_with(models=(_model(servers, usage_cost=100_000),))
    http = http_of(gw)
    index = _index(gw)
    wait_until(lambda: len(index.workers) == 2, "both workers' event streams")
    _ask(http, DOCUMENT)
    (first,) = [e for e in engines if e.served]
    (other,) = [e for e in engines if e is not first]
    address = servers[engines.index(first)].address

    def usage() -> float | None:
        kv = index.workers.get(address)
        return None if kv is None or kv.load is None else kv.load.kv_usage

    wait_until(lambda: _index_holds(index, DOCUMENT[: 8 * 16]), "the first stores")
    _ask(http, DOCUMENT)  # to the holder; its record now says its cache is full
    assert first.served == 2
    wait_until(lambda: usage() == 1.0, "the first engine's full cache in its load record")
    stale = time.monotonic() - LOAD_FRESH - 1

    async def age() -> None:  # on the gateway's loop, as its followers apply batches
        kv = index.workers[address]
        index.apply(address, KvBatch(kv.sequence, load=kv.load), now=stale)

    server_loop.call(age())
    _ask(http, DOCUMENT)  # the stale record no longer costs it: its cached prefix wins
    assert (first.served, other.served) == (3, 0)
    wait_until(lambda: index.workers[address].load_at > stale, "its fresh record")
    _ask(http, DOCUMENT)  # fresh again: a full cache costs more than the prefix saves
    assert (first.served, other.served) == (3, 1)


def test_past_32_candidates_the_holders_are_found_by_address() -> None:
    """Past SAMPLE_ABOVE candidates the router costs the holders the walk found (by
    address, not by a scan of the candidates) and SAMPLED others: the holder of a
    document wins among 40 workers, a candidate list without it (a retry's) never gets
    it, and its engine's fresh full record routes around it while a stale one does not."""
    addresses = [f"10.0.1.{i}:8000" for i in range(40)]
    workers = [Worker(a, cast(Any, None), EjectionPolicy()) for a in addresses]
    router = Router(MODEL, RoutingConfig(max_kv_usage=0.9), PrefixAffinity(256, 1.5))
    for address in addresses:
        router.index.apply(address, KvBatch(1, (), True))
    holder = addresses[17]
    document = b"a long shared document, " * 8  # 12 blocks
    stored = BlocksStored(tuple(range(12)), None, document, 16)
    router.index.apply(holder, KvBatch(2, (stored,)))
    request = GenerateRequest(MODEL, prompt=f"{document.decode()} and a question")
    assert {router.pick(list(workers), request).address for _ in range(5)} == {holder}
    assert router.last.cache_hit_blocks == 12
    others = [w for w in workers if w.address != holder]
    assert all(router.pick(others, request) in others for _ in range(5))
    assert router.pick(list(workers), request).address == holder
    router.index.apply(holder, KvBatch(2, load=EngineLoad(kv_usage=0.95)))
    assert router.pick(list(workers), request).address != holder  # full, while fresh
    stale = time.monotonic() - LOAD_FRESH - 1
    router.index.apply(holder, KvBatch(2, load=EngineLoad(kv_usage=0.95)), now=stale)
    assert router.pick(list(workers), request).address == holder


def test_a_prefix_no_worker_holds_lands_on_one_worker_on_every_replica() -> None:
    """kv_aware's tie-break among workers that hold none of a prompt: a rendezvous hash of
    the prompt's first block that no worker holds. Every request for one new document
    picks the same worker, on each of two replicas alike (so a document is not copied
    into every cache before any of them holds it), and several documents spread."""
    addresses = [f"10.0.0.{i}:8000" for i in range(4)]
    workers = [Worker(a, cast(Any, None), EjectionPolicy()) for a in addresses]
    other = bytes(16)  # a block of another prompt: the index learns the block size

    def replica() -> Router:
        router = Router(MODEL, RoutingConfig(), PrefixAffinity(256, 1.5))
        for address in addresses:
            router.index.apply(address, KvBatch(1, (), True))
        stored = BlocksStored((7,), None, other, 16)
        router.index.apply(addresses[0], KvBatch(2, (stored,)))
        return router

    first, second = replica(), replica()
    documents = [f"document {d}: " + "words of a long shared system prompt " * 4 for d in range(8)]
    chosen = {}
    for document in documents:
        picks = {
            router.pick(workers, GenerateRequest(MODEL, prompt=f"{document} question {q}")).address
            for router in (first, second)
            for q in range(3)
        }
        assert len(picks) == 1, (document, picks)
        chosen[document] = picks.pop()
    assert first.last.policy == "kv_aware"
    assert len(set(chosen.values())) > 1  # 8 documents over 4 workers do not all herd
