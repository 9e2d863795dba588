"""KV events over ZMQ (vLLM's publisher, `gateway.protocol.kv_zmq`) for `upstream: openai`
workers named in `routing.kv_events`: a real gateway under uvicorn in front of a real
OpenAI-compatible server, and a pyzmq PUB socket in the test speaking vLLM's wire (topic,
8-byte sequence, msgpack batch), then lying on it: garbage, a frame past the size bound,
sequences out of order, a restart. The index follows the valid batches, the rest is
refused, counted and logged, a stopped publisher's part is dropped at once, and routing
never stops. Real vLLM: tests/test_kv_routing_vllm.py."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq
import zmq.asyncio

from gateway.config import ConfigError, ModelConfig, RoutingConfig, parse_config
from gateway.fleet import Fleet
from gateway.fleet.pool import make_balancer
from gateway.fleet.routing import Router
from gateway.protocol import kv_zmq
from gateway.protocol.kv_blocks import BlocksRemoved, BlocksStored, CacheCleared, EngineLoad
from gateway.protocol.kv_zmq import MAX_MESSAGE_BYTES, Malformed, ZmqKvSubscriber, decode
from gateway.protocol.types import Message
from gateway.tokenization import load_tokenizer
from gateway.worker.demo import DemoEngine
from gateway.worker.kv_events import ForwardedCache, KvPublisher
from gateway.worker.server import WorkerServer
from tests.support.certs import CertificateAuthority
from tests.support.openai_server import OpenAIServer, serving
from tests.support.processes import free_port
from tests.support.servers import Gateway, ServerLoop
from tests.support.tiny_model import build_tokenizer
from tests.support.waiting import HANG_GUARD, wait_until

MODEL = "kv-zmq"
KEY_ENV = "FURNACE_TEST_KV_ZMQ_KEY"
BLOCK = 16
REFUSED = "furnace_gateway_worker_kv_events_refused_total{"
DOCUMENT = " ".join(f"line {i} of the shared document," for i in range(30))


def _message(sequence: int, events: list[dict[str, object]]) -> list[bytes]:
    payload = msgpack.packb([1.7e9, events, 0])
    return [b"", sequence.to_bytes(8, "big"), payload]


def _stored(ids: list[int], first_hash: int = 1000) -> dict[str, object]:
    count = len(ids) // BLOCK
    return {
        "type": "BlockStored",
        "block_hashes": [(first_hash + i).to_bytes(32, "big") for i in range(count)],
        "parent_block_hash": None,
        "token_ids": ids[: count * BLOCK],
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


@pytest.fixture
def upstream(
    server_loop: ServerLoop, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[OpenAIServer, CertificateAuthority]]:
    with serving(server_loop, tmp_path, MODEL) as (server, ca):
        monkeypatch.setenv(KEY_ENV, server.key)
        yield server, ca


@pytest.fixture
def publisher() -> Iterator[tuple[zmq.Socket[bytes], str]]:
    socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    port = free_port()
    socket.bind(f"tcp://127.0.0.1:{port}")
    yield socket, f"tcp://127.0.0.1:{port}"
    socket.close(linger=0)


def _model(
    server: OpenAIServer, ca: CertificateAuthority, folder: Path, endpoint: str
) -> tuple[ModelConfig, str]:
    """The model of `server`, reached with its key and CA, routed on the events its
    engine publishes at `endpoint`; and its tokenizer's folder (made in `folder`)."""
    build_tokenizer().save_pretrained(folder / "tokenizer")
    tokenizer = str(folder / "tokenizer")
    model = ModelConfig(
        MODEL,
        workers=(server.url,),
        upstream="openai",
        api_key_env=KEY_ENV,
        ca_file=ca.ca_file,
        tokenizer=tokenizer,
        routing=RoutingConfig(kv_events=((server.url, endpoint),)),
    )
    return model, tokenizer


def test_a_hostile_publisher_is_bounded_logged_and_never_stops_routing(
    upstream: tuple[OpenAIServer, CertificateAuthority],
    publisher: tuple[zmq.Socket[bytes], str],
    gateway_with: Callable[..., Gateway],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    server, ca = upstream
    pub, endpoint = publisher
    model, tokenizer = _model(server, ca, tmp_path, endpoint)
    gw = gateway_with(models=(model,))
    router = gw.router(MODEL)
    index = router.index
    subscriber = router.zmq[server.url]
    messages = [Message("user", DOCUMENT)]
    ids = load_tokenizer(tokenizer).prompt_ids(None, messages)
    assert len(ids) >= 2 * BLOCK

    def publish_until(frames: list[bytes], seen: Callable[[], bool], what: str) -> None:
        """Sends until the gateway saw it (a SUB socket misses what comes before it
        connects, as any of vLLM's subscribers does)."""
        wait_until(lambda: pub.send_multipart(frames) is None and seen(), what, HANG_GUARD)

    def chat() -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": DOCUMENT}]}
        response = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=HANG_GUARD)
        assert response.status_code == 200, response.text

    publish_until(_message(0, [_stored(ids)]), lambda: bool(index.holders), "the first batch")
    kv = index.workers[server.url]
    assert router.states[server.url] == "events"
    assert len(kv.blocks) == len(ids) // BLOCK
    chat()  # tokenized as vLLM would: the whole prefix is a hit
    assert router.last.cache_hit_blocks == len(ids) // BLOCK

    garbage = [
        [b"one frame"],
        [b"", b"short", b"\x90"],
        [b"", (1).to_bytes(8, "big"), b"\xc1 not msgpack"],
        [b"", (2).to_bytes(8, "big"), msgpack.packb({"not": "a batch"})],
        _message(3, [{"type": "BlockStored", "token_ids": ["a"], "block_hashes": [1]}]),
        _message(4, [{"type": "BlockStored", "token_ids": [-1], "block_size": 1}]),
        _message(5, [[1, 2, 3]]),
        [b"", (6).to_bytes(8, "big"), msgpack.packb([0, [None] * 10])],
    ]
    for frames in garbage:
        pub.send_multipart(frames)
    # read before the huge frame is sent: libzmq drops the connection on that one, and
    # with it what it read in the same batch but had not handed over yet (a busy machine
    # lost all eight so)
    wait_until(lambda: subscriber.malformed >= len(garbage) - 1, "the garbage refused")
    pub.send_multipart([b"", (7).to_bytes(8, "big"), b"\x00" * (MAX_MESSAGE_BYTES + 1)])
    # after a gap (the refused numbers), a store: the index drops what it had first
    second = ids[: 2 * BLOCK]
    publish_until(
        _message(9, [{"type": "AllBlocksCleared"}, _stored(second, 5000)]),
        lambda: kv.sequence >= 9,
        "a valid batch after the garbage and the huge frame",
    )
    assert subscriber.malformed >= len(garbage) - 1  # the last two may come in any order
    assert len(kv.blocks) == 2
    assert any("a message refused" in r.getMessage() for r in caplog.records)
    metrics = httpx.get(gw.url + "/metrics", timeout=HANG_GUARD).text
    (line,) = [m for m in metrics.splitlines() if m.startswith(REFUSED)]
    assert float(line.split()[-1]) >= subscriber.malformed
    chat()
    assert router.last.cache_hit_blocks == 2

    # a number below the last: the publisher restarted; its first batch resets
    publish_until(
        _message(0, [_stored(ids[:BLOCK], 9000)]),
        lambda: kv.sequence == 0,
        "a restarted publisher's batch",
    )
    assert list(kv.blocks) == [9000]
    chat()
    assert router.last.cache_hit_blocks == 1

    # the engine stops (its socket closes): its part goes at once, not at its next batch;
    # one started again on the same port is followed from its first batch
    pub.close(linger=0)
    wait_until(lambda: not kv.blocks, "the worker's part dropped with its publisher")
    assert router.states[server.url] == "broken"  # in /admin/workers and the metric too
    restarted: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    try:
        restarted.bind(endpoint)
        frames = _message(0, [_stored(ids, 100)])
        wait_until(
            lambda: restarted.send_multipart(frames) is None and bool(kv.blocks),
            "the restarted publisher's first batch",
        )
        chat()
        assert router.last.cache_hit_blocks == len(ids) // BLOCK
        assert router.states[server.url] == "events"
    finally:
        restarted.close(linger=0)
    assert server.refused == 0


def _publishers_at(*offsets: int) -> tuple[int, list[zmq.Socket[bytes]]]:
    """PUB sockets bound at a base port plus each of `offsets` (free ports found by
    trying): the base, and the sockets."""
    context = zmq.Context.instance()
    while True:
        base = free_port()
        sockets: list[zmq.Socket[bytes]] = []
        try:
            for offset in offsets:
                sockets.append(context.socket(zmq.PUB))
                sockets[-1].bind(f"tcp://127.0.0.1:{base + offset}")
        except zmq.ZMQError:  # taken: another base
            for socket in sockets:
                socket.close(linger=0)
            continue
        return base, sockets


def test_a_hybrid_servers_engines_follow_the_publishers_of_their_ranks(
    upstream: tuple[OpenAIServer, CertificateAuthority],
    gateway_with: Callable[..., Gateway],
    tmp_path: Path,
) -> None:
    """Under vLLM's hybrid load balancing a server runs ranks 8 and 9 of a larger group,
    and each rank publishes at the configured port + its rank (vLLM's offset): its
    engines `#dp0` and `#dp1` follow the publishers at + 8 and + 9, and a prompt whose
    blocks rank 9 holds goes to `#dp1`, pinned as its server's second engine."""
    server, ca = upstream
    server.engines, server.load = (8, 9), (0, 0, 0.0)
    base, (eight, nine) = _publishers_at(8, 9)
    model, tokenizer = _model(server, ca, tmp_path, f"tcp://127.0.0.1:{base}")
    model = replace(model, data_parallel_size=2)
    try:
        gw = gateway_with(models=(model,))
        router = gw.router(MODEL)
        engines = [f"{server.url}#dp{index}" for index in range(2)]
        ids = load_tokenizer(tokenizer).prompt_ids(None, [Message("user", DOCUMENT)])
        frames = _message(0, [_stored(ids)])
        held = router.index.workers

        def seen() -> bool:
            return engines[1] in held and bool(held[engines[1]].blocks)

        wait_until(lambda: nine.send_multipart(frames) is None and seen(), "rank 9's batch")
        ports = [router.zmq[e].endpoint.rpartition(":")[2] for e in engines]
        assert ports == [str(base + 8), str(base + 9)]
        assert router.states[engines[1]] == "events"
        body = {"model": MODEL, "messages": [{"role": "user", "content": DOCUMENT}]}
        response = httpx.post(gw.url + "/v1/chat/completions", json=body, timeout=HANG_GUARD)
        assert response.status_code == 200, response.text
        assert router.last.cache_hit_blocks == len(ids) // BLOCK
        assert server.last_rank == "1"
    finally:
        for socket in (eight, nine):
            socket.close(linger=0)


class _ForwardingEngine(DemoEngine):
    """The demo engine, with the KV events of an engine publishing on vLLM's ZMQ wire
    (the test's PUB socket), forwarded as the vLLM engine forwards its engine's."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(MODEL, max_context=100_000, kv_blocks=0)
        self.cache = ForwardedCache()
        self.subscriber = ZmqKvSubscriber(endpoint)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._forward())

    async def _forward(self) -> None:
        async for batch in self.subscriber.batches():
            self.cache.apply(batch, EngineLoad(running=self.running))

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()

    def kv_events(self) -> KvPublisher | None:
        return self.cache.publisher


def test_a_worker_forwards_its_engines_zmq_events_with_a_snapshot(
    publisher: tuple[zmq.Socket[bytes], str],
    serve_engines: Callable[..., list[WorkerServer]],
    gateway_with: Callable[..., Gateway],
) -> None:
    pub, endpoint = publisher
    engine = _ForwardingEngine(endpoint)
    (server,) = serve_engines(engine)
    model = ModelConfig(MODEL, workers=(server.address,), routing=RoutingConfig())
    first = gateway_with(models=(model,))
    prompt = f"a prompt {DOCUMENT}"  # our workers' blocks: the prompt's bytes
    data = list(prompt.encode())
    blocks = len(data) // BLOCK

    def holds(gw: Gateway, count: int) -> bool:
        kv = gw.router(MODEL).index.workers.get(server.address)
        return kv is not None and len(kv.blocks) == count

    wait_until(
        lambda: (
            pub.send_multipart(_message(0, [_stored(data)])) is None and bool(engine.cache.blocks)
        ),
        "the engine's first batch at the worker",
    )
    wait_until(lambda: holds(first, blocks), "the first gateway's index")
    # a gateway that subscribes later gets the blocks as the worker's snapshot
    second = gateway_with(models=(model,))
    wait_until(lambda: holds(second, blocks), "the second gateway's index, from the snapshot")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    response = httpx.post(second.url + "/v1/completions", json=body, timeout=HANG_GUARD)
    assert response.status_code == 200, response.text
    assert second.router(MODEL).last.cache_hit_blocks == blocks
    # a gap in the engine's stream: the worker clears, the gateways follow from there
    pub.send_multipart(_message(5, [_stored(data[: 2 * BLOCK], 7000)]))
    for gw in (first, second):
        wait_until(lambda g=gw: holds(g, 2), "the gateways to drop what came before the gap")
    assert list(engine.cache.blocks) == [7000, 7001]  # 32-byte hashes, their low 64 bits


def test_decode_reads_vllm_batches_and_keeps_what_the_index_can_use() -> None:
    gpu = _stored(list(range(2 * BLOCK)), 7)
    gpu["parent_block_hash"] = 3
    host = {**gpu, "medium": "CPU"}
    adapter = {**gpu, "lora_name": "sql"}
    salted = {**gpu, "extra_keys": [None, ("salt",)]}
    other_group = {**gpu, "group_idx": 1}
    removed = {"type": "BlockRemoved", "block_hashes": [7, 2**64 - 1], "medium": "GPU"}
    later = {"type": "BlockPinned", "block_hashes": [7]}
    events = [gpu, host, adapter, salted, other_group, removed, later, {"type": "AllBlocksCleared"}]
    sequence, stamp, decoded = decode(_message(41, events))
    assert (sequence, stamp) == (41, 1.7e9)
    assert decoded == (
        BlocksStored((7, 8), 3, list(range(2 * BLOCK)), BLOCK),
        BlocksRemoved((7, -1)),  # hashes folded to 64 signed bits, as the protocol has them
        CacheCleared(),
    )
    for bad in (
        [b"", b"\x00" * 8, msgpack.packb([0, [{"type": 3}]])],
        [b"", b"\x00" * 8, msgpack.packb([0, [gpu | {"block_size": 0}]])],
        [b"", b"\x00" * 8, msgpack.packb([0, [gpu | {"extra_keys": 5}]])],
        [b"", b"\x00" * 8, msgpack.packb([0, [0] * ((1 << 20) + 1)])],
    ):
        with pytest.raises(Malformed):
            decode(bad)


def test_the_config_names_each_workers_endpoint(tmp_path: Path) -> None:
    build_tokenizer().save_pretrained(tmp_path)
    url = "http://10.0.0.1:8000/v1"
    row = {"name": MODEL, "upstream": "openai", "workers": [url], "tokenizer": str(tmp_path)}

    def parse(**changes: object) -> RoutingConfig | None:
        return parse_config({"models": [{**row, **changes}]}).models[0].routing

    routing = parse(routing={"kv_events": {url: "tcp://10.0.0.1:5557"}})
    assert routing is not None and routing.kv_events == ((url, "tcp://10.0.0.1:5557"),)
    routing = parse(
        routing={"kv_events": {url: "tcp://h:1"}, "kv_replay": {url: "tcp://10.0.0.1:5558"}}
    )
    assert routing is not None and routing.kv_replay == ((url, "tcp://10.0.0.1:5558"),)
    # a prefill worker (prefill/decode disaggregation) publishes too, to its own pool's router
    prefill = "http://10.0.0.2:8000/v1"
    events = {url: "tcp://10.0.0.1:5557", prefill: "tcp://10.0.0.2:5557"}
    config = parse_config(
        {"models": [{**row, "prefill_workers": [prefill], "routing": {"kv_events": events}}]}
    )
    pools = (
        make_balancer(config.models[0], config),
        make_balancer(replace(config.models[0], workers=(prefill,)), config),
    )
    assert [list(b.zmq) for b in pools if isinstance(b, Router)] == [[url], [prefill]]
    # or the prefill tier's own routing (`--prefill-policy`), its publishers named there
    split = {**row, "prefill_workers": [prefill], "routing": {"policy": "least_load"}}
    own = {"policy": "kv_aware", "kv_events": {prefill: "tcp://10.0.0.2:5557"}}
    fleet = Fleet(parse_config({"models": [{**split, "prefill_routing": own}]}))
    decode_router, prefill_router = fleet.models[MODEL].router, fleet.models[MODEL].prefill.router
    assert (decode_router.policy, list(decode_router.zmq)) == ("least_load", [])
    assert (prefill_router.policy, list(prefill_router.zmq)) == ("kv_aware", [prefill])
    for changes, where in (
        ({"prefill_routing": own, "prefill_workers": []}, "prefill_routing: only with"),
        (  # with `prefill_routing`, the prefill workers' publishers are named there
            {"prefill_routing": {}, "routing": {"kv_events": events}},
            f"routing.kv_events.{prefill}",
        ),
        (
            {"prefill_routing": {"kv_events": {url: "tcp://h:1"}}},
            f"prefill_routing.kv_events.{url}: not one of the model's upstream: openai "
            "prefill_workers",
        ),
        ({"prefill_routing": {"kv_replay": {prefill: "tcp://h:2"}}}, "prefill_routing.kv_replay"),
    ):
        with pytest.raises(ConfigError, match=re.escape(where)):
            parse_config({"models": [{**split, **changes}]})
    for changes, where in (
        ({"routing": {"kv_events": {url: "tcp://*:5557"}}}, "kv_events"),
        ({"routing": {"kv_events": {url: "10.0.0.1:5557"}}}, "kv_events"),
        ({"routing": {"kv_events": {"http://other/v1": "tcp://h:1"}}}, "kv_events"),
        ({"routing": {"kv_events": {url: "tcp://h:1"}}, "tokenizer": None}, "tokenizer"),
        ({"routing": {"kv_replay": {url: "tcp://h:2"}}}, "kv_replay"),
    ):
        with pytest.raises(ConfigError, match=where):
            parse(**changes)


class _ReplayingPublisher:
    """vLLM's publisher as the test plays it: a PUB socket, and a ROUTER replay socket
    that sends back the kept messages from a number on, then the end marker (-1);
    `answer` may lie: None (no answer at all), or a number of extra messages."""

    def __init__(self, answer: int | None = 0) -> None:
        context = zmq.asyncio.Context.instance()
        self.pub = context.socket(zmq.PUB)
        self.router = context.socket(zmq.ROUTER)
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.replay = f"tcp://127.0.0.1:{free_port()}"
        self.pub.bind(self.endpoint)
        self.router.bind(self.replay)
        self.kept: list[list[bytes]] = []
        self.answer = answer
        self.requests: list[int] = []

    def publish(self, sequence: int, events: list[dict[str, object]], live: bool = True) -> None:
        frames = _message(sequence, events)
        self.kept.append(frames)
        if live:
            self.pub.send_multipart(frames)

    async def serve(self) -> None:
        while True:
            client, empty, start = await self.router.recv_multipart()
            self.requests.append(int.from_bytes(start, "big"))
            if self.answer is None:
                continue
            for frames in self.kept:
                if int.from_bytes(frames[1], "big") >= self.requests[-1]:
                    await self.router.send_multipart([client, empty, *frames])
            for extra in range(self.answer):
                await self.router.send_multipart([client, empty, *_message(100 + extra, [])])
            await self.router.send_multipart([client, empty, b"", b"\xff" * 8, b""])

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)


def test_a_replay_socket_brings_what_the_subscriber_missed() -> None:
    """Subscribed late, the gateway asks for the publisher's kept batches first; after a
    gap it asks for the missing numbers; live batches a replay brought are not applied
    twice, and nothing says reset but the first."""
    ids = list(range(4 * BLOCK))

    async def scenario() -> list[tuple[int, bool, int]]:
        publisher = _ReplayingPublisher()
        server = asyncio.create_task(publisher.serve())
        for sequence in range(3):  # before anyone listens
            publisher.publish(sequence, [_stored(ids[: (sequence + 1) * BLOCK], 10 * sequence)])
        subscriber = ZmqKvSubscriber(publisher.endpoint, publisher.replay)
        seen: list[tuple[int, bool, int]] = []
        batches = subscriber.batches()
        try:
            for _ in range(3):
                batch = await asyncio.wait_for(anext(batches), HANG_GUARD)
                seen.append((batch.sequence, batch.reset, len(batch.events)))
            publisher.publish(3, [], live=False)  # lost on the way: a gap

            async def keep_publishing() -> None:
                # until the live socket is subscribed it misses what is published (ZMQ's
                # slow joiner): one message and a wait for it could wait forever
                while True:
                    publisher.publish(len(publisher.kept), [])
                    await asyncio.sleep(0.05)

            ticker = asyncio.create_task(keep_publishing())
            try:
                while True:
                    batch = await asyncio.wait_for(anext(batches), HANG_GUARD)
                    seen.append((batch.sequence, batch.reset, len(batch.events)))
                    if batch.sequence >= 4:
                        break
            finally:
                ticker.cancel()
            assert subscriber.replays >= 1 and subscriber.malformed == 0
            assert publisher.requests[0] == 0
            return seen
        finally:
            await batches.aclose()
            server.cancel()
            publisher.close()

    seen = asyncio.run(scenario())
    assert seen[:3] == [(0, True, 1), (1, False, 1), (2, False, 1)]
    numbers = [sequence for sequence, _, _ in seen]
    assert numbers == list(range(len(numbers)))  # each once, the gap's number replayed
    assert not any(reset for _, reset, _ in seen[1:])


@pytest.mark.parametrize("answer", [None, 50])
def test_a_replay_that_never_ends_or_never_answers_is_cut(
    answer: int | None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(kv_zmq, "MAX_REPLAY", 10)
    monkeypatch.setattr(kv_zmq, "REPLAY_WAIT", 0.3)

    async def scenario() -> list[int]:
        publisher = _ReplayingPublisher(answer)
        server = asyncio.create_task(publisher.serve())
        subscriber = ZmqKvSubscriber(publisher.endpoint, publisher.replay)
        batches = subscriber.batches()
        seen: list[int] = []

        async def live() -> None:
            while True:
                await publisher.pub.send_multipart(_message(1000, []))
                await asyncio.sleep(0.05)

        sender = asyncio.create_task(live())
        try:
            while 1000 not in seen:  # the live stream goes on after the replay is cut
                batch = await asyncio.wait_for(anext(batches), HANG_GUARD)
                seen.append(batch.sequence)
            return seen
        finally:
            await batches.aclose()
            sender.cancel()
            server.cancel()
            publisher.close()

    seen = asyncio.run(scenario())
    # at most MAX_REPLAY on connecting, as many for the gap the lie leaves (one a
    # REPLAY_WAIT), then the live one
    assert len(seen) <= 2 * 10 + 1
    why = "within" if answer is None else "past 10 messages"
    assert any(why in r.getMessage() for r in caplog.records)


def test_a_publisher_flooding_with_oversized_frames_never_aborts_the_process() -> None:
    """A publisher sending without pause, an oversized frame now and then: each refusal
    drops the connection, and the subscriber goes on with a socket of its own, never
    reading the old one again (reading a socket after zmq_disconnect with messages queued
    aborted the whole process in libzmq's fq.cpp, `!_more`, within a second or two here)."""
    payload = msgpack.packb([1.7e9, [], 0])
    stop = False

    def flood(pub: zmq.Socket[bytes]) -> None:
        sequence = 0
        while not stop:
            sequence += 1
            if sequence % 2000 == 0:
                pub.send_multipart([b"", b"\0" * 8, b"\0" * (MAX_MESSAGE_BYTES + 1)])
            pub.send_multipart([b"", sequence.to_bytes(8, "big"), payload])
            if sequence % 100 == 0:
                time.sleep(0.001)

    async def scenario(endpoint: str) -> tuple[int, int]:
        subscriber = ZmqKvSubscriber(endpoint)
        batches = subscriber.batches()
        resets = received = 0
        try:
            while resets < 10:
                batch = await asyncio.wait_for(anext(batches), HANG_GUARD)
                resets += batch.reset
                received += 1
            return resets, received
        finally:
            await batches.aclose()

    pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    pub.bind(endpoint)
    sender = threading.Thread(target=flood, args=(pub,))
    sender.start()
    try:
        resets, received = asyncio.run(scenario(endpoint))
    finally:
        stop = True
        sender.join(HANG_GUARD)
        pub.close(linger=0)
    assert resets == 10 and received > resets


def test_an_endpoint_zmq_refuses_is_an_error_that_leaves_no_socket_open() -> None:
    """An endpoint libzmq cannot connect to fails the subscription at once, and neither
    its SUB socket nor the socket's monitor is left open for the garbage collector."""
    context = zmq.asyncio.Context.instance()

    def open_sockets() -> int:
        return sum(not socket.closed for socket in list(context._sockets))

    async def subscribe() -> None:
        async for _ in ZmqKvSubscriber("tcp://no-port-here").batches():
            pass

    before = open_sockets()
    with pytest.raises(zmq.ZMQError) as raised:
        asyncio.run(subscribe())
    assert "Invalid argument" in str(raised.value)
    assert open_sockets() == before  # the traceback holds the sockets: closed, not leaked


def test_a_data_parallel_servers_engines_are_workers_with_their_own_publishers(
    tmp_path: Path,
) -> None:
    """`data_parallel_size`: each engine of a server a worker (`URL#dpR`), subscribed at
    its own port (vLLM binds rank R at the configured port + R, the replay socket too),
    on an upstream pinned to its rank; refused where the servers are not vLLM's."""
    build_tokenizer().save_pretrained(tmp_path)
    url = "http://10.0.0.1:8000/v1"
    routing = {"kv_events": {url: "tcp://10.0.0.1:5557"}, "kv_replay": {url: "tcp://h:6000"}}
    row = {
        "name": MODEL,
        "upstream": "openai",
        "workers": [url],
        "tokenizer": str(tmp_path),
        "data_parallel_size": 3,
        "routing": routing,
    }
    fleet = Fleet(parse_config({"models": [row]}))
    pool = fleet.models[MODEL]
    router = pool.router
    assert router is not None
    engines = [f"{url}#dp{rank}" for rank in range(3)]
    assert list(router.zmq) == engines
    assert [router.zmq[e].endpoint for e in engines] == [
        f"tcp://10.0.0.1:{5557 + r}" for r in range(3)
    ]
    assert [router.zmq[e].replay for e in engines] == [f"tcp://h:{6000 + r}" for r in range(3)]
    pool.update(pool.targets[0], [url], lambda worker: None)
    assert list(pool.workers) == engines
    upstreams = [pool.workers[e].upstream for e in engines]
    assert [u.name for u in upstreams] == engines  # type: ignore[attr-defined]
    assert [u._headers["X-data-parallel-rank"] for u in upstreams] == ["0", "1", "2"]  # type: ignore[attr-defined]
    grpc = {"name": "g", "upstream": "grpc", "workers": ["h:1"], "data_parallel_size": 2}
    with pytest.raises(ConfigError, match=re.escape("models[0].data_parallel_size: with upstream")):
        parse_config({"models": [grpc]})
    with pytest.raises(ConfigError, match="data_parallel_size"):
        parse_config({"models": [{**row, "data_parallel_size": 0}]})
