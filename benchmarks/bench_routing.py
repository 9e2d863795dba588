"""Benchmark: routing policies on real vLLM CPU workers (issue 26), one run, every row
interleaved. Two (`--workers`) vLLM servers, each pinned to a core of its own (vLLM's
`VLLM_CPU_OMP_THREADS_BIND`; with more workers than cores, engine i on core i mod cores:
requests go one at a time, so only one engine computes at a time), prefix caching and
KV-cache events on, serving a random-weight
model the benchmark builds (`--size`, hidden size and layers: at 256x4 a cold 2,000-token
prefill measured 2.7-4.3 s here, a cached one 0.4-0.6 s).

`--engines http` (the default): vLLM's OpenAI HTTP servers. Rows, in front of the same
engines: furnace-gateway with `round_robin`, `prefix` (its text prefix affinity) and
`kv_aware` (the engines' events over ZMQ, `routing.kv_events`, the model's `tokenizer`);
smg (`--policy cache_aware`, its approximate tree on HTTP workers) and vllm-router
(`--policy cache_aware`), started as bench_vllm starts them.

`--engines grpc`: vLLM's gRPC servers (the smg servicer). Rows: furnace-gateway with
`upstream: vllm-grpc` and the same three policies (`kv_aware` subscribes to each engine's
`SubscribeKvEvents` over its own channel), and smg in gRPC mode (`--worker-urls grpc://...
--model-path`, `--policy cache_aware`), whose event-driven KV index subscribes to the same
RPC with no flag (it learns vLLM's 128-token block from the events; its `smg_kv_*` metrics
and cache-aware branches, event hit or miss, go to stderr with furnace's). vllm-router has
no gRPC mode: its row says so.

`--engines pd`: prefill/decode disaggregation (`prefill_workers`): the `--workers` servers
prefill (vLLM's HTTP servers with the NixlConnector, `kv_producer`, their events over ZMQ)
and one more server decodes (`kv_consumer`, on the next core), pulling each prompt's blocks.
The routing under test is the prefill tier's, where a cached prefix saves the prefill: the
columns read the prefill servers (their hits, the oracle over their events). Rows:
furnace-gateway with the three policies (its `routing` routes both tiers; the decode tier
has one server), smg and vllm-router in their PD modes with `--prefill-policy cache_aware`.
The servers run in float32 (`tests.support.vllm.nixl_args`), slower than the other modes.

`--engines dp`: one vLLM HTTP server of `--workers` data-parallel engines
(`--data-parallel-size`), each with its cache and its ZMQ publisher (the port + its rank).
Rows: furnace-gateway `kv_aware` with `data_parallel_size` (each engine a worker, each
request pinned to one), the same with the server as one worker (what it did before: rank
0's events alone, vLLM placing each request), `round_robin` over the engines; vllm-router
(`--intra-node-data-parallel-size`) and smg (`--dp-aware`), both `cache_aware`. The oracle
follows every engine's publisher.

Workload: `--documents` long shared documents (~`--doc-tokens` tokens each, a system
prompt) and `--conversations` conversations per row over them, `--turns` turns each: the
conversation so far plus a new user message of ~`--turn-tokens` tokens, streamed, greedy,
`max_tokens` 16 (the model's output layer is zero, `ordered`: it answers its first token,
printable, so the first text is the first token); the turn's answer is kept as a fixed
text. Each row has its own documents (a salt in their first block), so one row's blocks are
never another's hits; requests go one at a time, rows interleaved (A B C D E, A B C D E,
...), so every row sees the same engines under the same load. An odd number of
conversations keeps round robin from pinning each one to an engine by accident.
`--concurrent K` sends K conversations' turns of a row at once (1 by default: one request
at a time): the counters, the oracle and the router's CPU are read around each group, whose
hits are shared among its requests by their prompts' lengths (each request's prefill to do,
for the fitted line below, is then an estimate).
`--kv-blocks` bounds each engine's KV cache to about a quarter of the distinct blocks all
rows' prompts fill (printed above the table: 1,241 at the defaults, 300 blocks an engine),
as a fleet's cache is in production (the two caches hold about half of them): placing a
prefix where it already is saves its prefill and the room for a second copy.

Columns: the engines' prefix-cache hit rate (vLLM's own `vllm:prefix_cache_hits_total` over
`..._queries_total`, both engines' deltas around each request: tokens found cached over
the prompt's tokens, a hit being whole blocks from the start and never the prompt's last
token, which vLLM always computes; a gRPC server serves no /metrics and its `GetLoads`
gives only a hit rate over its last 64 requests, so its engine's counters are read from
Prometheus's multiprocess files, `PROMETHEUS_MULTIPROC_DIR` set for it alone); the
oracle's, a router that knows every cache: for each request, the most tokens of its
prompt that any engine holds when it is sent, counted as vLLM counts them, over the
prompt's tokens (`CacheOracle`: the engines' own KV events, followed by the benchmark as a
`kv_aware` gateway follows them, into a `KvIndex`; it is the best choice among the caches
as they are, evictions by every row included, so a router can reach it, not pass it);
and "no evictions", the hits if caches kept everything (every whole block seen before in
the row is a hit: an upper bound no router reaches, whose gap to the oracle is what the
bounded caches cost). Then TTFT p50, with a 95 % confidence interval of it that assumes
nothing of the distribution (order statistics), and p99 (to the first streamed text),
completion tokens/s over the row's request time, the router's CPU (its process tree) per
request, during its own requests, and its CPU per second between them (while the other
rows' requests run: a cost of following engines, not of requests: for kv_aware over HTTP,
its `/metrics` load scrape, about 2 ms of CPU a read, one read an engine a second). A
request whose engine hit more than the oracle's best, or counted other tokens than the
benchmark's own tokenization of the prompt, is reported on stderr (none is expected: the
oracle would be wrong).

After the table, each request's TTFT is fitted against its prefill still to do (its prompt's
tokens its engine did not find cached), a least-squares line over every row, with each row's
median and mean prefill to do and the oracle's mean: what a router as good as the caches
allow could show over round robin on these engines, read off the line.

On a shared 2-core VM the client, the gateways and the routers share the cores with the
engines: figures are indicative.

Before the table, the kv_aware gateway's index metrics go to stderr (cached blocks per
worker, event state, evictions, fallbacks): whether its events were followed.

Run: `.venv/bin/python -m benchmarks.bench_routing [--engines http|grpc|pd|dp] [--quick]
[--concurrent 1] [--size 256x4] [--kv-blocks 300] [--conversations 15] [--turns 5]
[--no-peers]`. The
defaults, 75 requests a row (375 in all), took 3.8 minutes here on a quiet machine (load
average 1-3), 7.4-9.2 while other work ran (load 4-16); with the
earlier 20 a row (5 conversations of 4 turns) the p50 of one row moved by 100-300 ms
between runs, as much as kv_aware, prefix and smg differ (the p50's interval now says
whether one run separates two rows). More turns than 5 make the
longest prompt pass the engines' 4,096-token context at these sizes. `--quick`: 1
document, 3 conversations of 2 turns, for development (2-3 minutes, most of it the
engines' start). Not collected by pytest.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import re
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_peers import PEERS_VENV, install_peers, tree_cpu  # noqa: E402
from benchmarks.bench_vllm import (  # noqa: E402
    MODEL,
    Target,
    one_chat,
    start_gateway,
    start_pd_router,
    start_router,
)
from gateway.fleet.data_parallel import rank_endpoint  # noqa: E402
from gateway.fleet.kv_index import KvIndex  # noqa: E402
from gateway.protocol.kv_blocks import KvBatch  # noqa: E402
from gateway.protocol.kv_zmq import ZmqKvSubscriber  # noqa: E402
from gateway.protocol.types import Message  # noqa: E402
from gateway.tokenization.tokenizer import ModelTokenizer, load_tokenizer  # noqa: E402
from gateway.upstreams.vllm_grpc import VllmGrpcUpstream  # noqa: E402
from tests.support.processes import free_port  # noqa: E402
from tests.support.tiny_model import build_tiny_model  # noqa: E402
from tests.support.vllm import (  # noqa: E402
    VllmProcess,
    nixl_args,
    start_grpc_server,
    start_http_server,
)

POLICIES = ("round_robin", "prefix", "kv_aware")
#: `--engines pd`: the NixlConnector's roles of the prefill servers and the decode server.
PRODUCER, CONSUMER = "kv_producer", "kv_consumer"
PEER_POLICY = "cache_aware"
BLOCK = 128  # vLLM's KV block on CPU, in tokens
MAX_TOKENS = 16
ANSWER = "noted, thank you."
FILLER = [f"item{i}" for i in range(300)]
INDEX_METRICS = r"^furnace_gateway_(?:worker_kv_\w+|routing_fallbacks_total)(?:\{.*\})? .*$"
SMG_KV = r"^smg_(?:kv_(?!\w+_bucket)\w+|cache_aware_policy_branch_total)(?:\{.*\})? .*$"
COUNTER = re.compile(r"^vllm:prefix_cache_(hits|queries)_total\{[^}]*\} ([0-9.e+]+)$", re.M)


@dataclass
class Row:
    """What one row measured, request by request."""

    name: str
    url: str = ""
    pid: int | None = None
    missing: str | None = None
    ttfts: list[float] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0
    cpu: float = 0.0
    hits: float = 0.0
    queries: float = 0.0
    #: The best engine's cached tokens for each prompt when it was sent (`CacheOracle`).
    oracle_hits: int = 0
    #: Whole blocks seen before in the row: caches that never evict (`_unbounded`).
    unbounded_hits: int = 0
    prompt_tokens: int = 0
    seen: set[tuple[int, ...]] = field(default_factory=set)
    #: Requests whose engine hit more tokens than the oracle said any engine held, and
    #: whose engines counted other than the prompt's tokens: both 0 when the oracle and
    #: the engines see the same prompts and blocks.
    beyond: int = 0
    miscounted: int = 0
    #: The router's CPU over the whole measure, in and out of its own requests, and the
    #: measure's wall time.
    cpu_total: float = 0.0
    wall: float = 0.0
    #: Each request's prompt tokens the engine did not find cached (its prefill to do)
    #: and its TTFT in seconds, for `_cost_line`.
    prefills: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Engine:
    """One vLLM server: how routers reach it (`http://HOST:PORT`, or `HOST:PORT` for a
    gRPC server), its ZMQ publisher and its Prometheus text."""

    server: VllmProcess
    url: str
    publisher: str
    metrics: Callable[[], str]


def _engine(
    model: Path,
    work: Path,
    core: int,
    blocks: int,
    grpc: bool,
    role: str | None = None,
    data_parallel: int = 1,
) -> Engine:
    """vLLM's OpenAI (or gRPC) server on core `core` with prefix caching and KV events
    published on a free port (a gRPC server relays them on its `SubscribeKvEvents`), and
    with the NixlConnector in `role` when given (`--engines pd`); with `data_parallel`
    engines (`--engines dp`: on every core, rank R publishing on the port + R)."""
    events = free_port()
    while data_parallel > 1 and not _free(range(events + 1, events + data_parallel)):
        events = free_port()
    config = (
        f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{events}"}}'
    )
    extra: tuple[str, ...] = (
        "--enable-prefix-caching",
        "--kv-events-config",
        config,
        "--max-model-len",
        "4096",
    )
    if blocks:  # vLLM's CPU backend takes its cache's size from the environment, 1 GiB
        extra += ("--num-gpu-blocks-override", str(blocks))
    logs = work / f"vllm-{core}"
    logs.mkdir()
    env = {"VLLM_CPU_OMP_THREADS_BIND": str(core % (os.cpu_count() or 1))}
    if data_parallel > 1:  # its engines placed by vLLM
        extra += ("--data-parallel-size", str(data_parallel))
        env = {}
    if role is not None:
        transfer, variables = nixl_args(role)
        extra += transfer
        env.update(variables)
    if grpc:  # its counters, in files this process reads (it serves no /metrics)
        env["PROMETHEUS_MULTIPROC_DIR"] = str(logs / "prometheus")
        (logs / "prometheus").mkdir()
    os.environ.update(env)
    try:
        if grpc:
            server = start_grpc_server(model, logs, ("--served-model-name", MODEL, *extra))
        else:
            server = start_http_server(model, logs, MODEL, extra)
    finally:
        for name in env:
            del os.environ[name]
    publisher = f"tcp://127.0.0.1:{events}"
    if grpc:
        files = env["PROMETHEUS_MULTIPROC_DIR"]
        return Engine(server, f"127.0.0.1:{server.port}", publisher, lambda: _files(files))
    url = f"http://127.0.0.1:{server.port}"
    return Engine(server, url, publisher, lambda: httpx.get(url + "/metrics", timeout=30).text)


def _free(ports: range) -> bool:
    """Whether every port of `ports` can be bound on loopback now."""
    for port in ports:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _ranks(engine: Engine, size: int) -> list[Engine]:
    """A data-parallel server's engines as the oracle follows them: each its publisher,
    named as the gateway names it (`URL/v1#dpR`); their counters are the server's."""
    return [
        Engine(
            engine.server, f"{engine.url}/v1#dp{rank}", rank_endpoint(engine.publisher, rank), str
        )
        for rank in range(size)
    ]


def _files(path: str) -> str:
    """The Prometheus text of a process's multiprocess files in `path`."""
    from prometheus_client import CollectorRegistry, generate_latest, multiprocess

    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=path)  # type: ignore[no-untyped-call]
    return generate_latest(registry).decode()


def _counters(engines: list[Engine]) -> tuple[float, float]:
    """Prefix-cache hits and queries (tokens) of all engines, from their counters."""
    hits = queries = 0.0
    for engine in engines:
        for kind, value in COUNTER.findall(engine.metrics()):
            if kind == "hits":
                hits += float(value)
            else:
                queries += float(value)
    return hits, queries


def workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload's options, which bench_route_tokens shares: shared documents, and
    conversations over them that grow a user turn at a time."""
    parser.add_argument("--documents", type=int, default=3)
    parser.add_argument("--doc-tokens", type=int, default=1800)
    parser.add_argument("--conversations", type=int, default=5)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=150)


def user_turn(rng: random.Random, turn: int, tokens: int) -> str:
    """A user turn of about `tokens` tokens of filler words, numbered by its turn."""
    words = " ".join(rng.choice(FILLER) for _ in range(tokens // 3))
    return f"Q{turn}: {words}?"


def _documents(tokenizer: ModelTokenizer, row: str, count: int, tokens: int) -> list[str]:
    """`count` documents of about `tokens` tokens each, salted with the row's name."""
    rng = random.Random(row)
    words = [f"{w}{i}" for i in range(400) for w in ("data", "node", "fleet")]
    docs = []
    for d in range(count):
        text = f"[{row} document {d}]"
        while len(tokenizer.encode(text, add_special_tokens=False)) < tokens:
            text += " " + " ".join(rng.choice(words) for _ in range(50))
        docs.append(text)
    return docs


def _unbounded(row: Row, ids: list[int]) -> int:
    """The request's tokens a router would find cached if caches never evicted: its
    whole blocks seen before in this row (the last token is always computed)."""
    hit = 0
    for end in range(BLOCK, len(ids), BLOCK):
        key = tuple(ids[:end])
        if key in row.seen:
            hit = end
        row.seen.add(key)
    return hit


class CacheOracle:
    """The engines' caches as their own KV events say they are, followed as a `kv_aware`
    gateway follows them (each engine's ZMQ publisher, or its gRPC `SubscribeKvEvents`,
    into a `KvIndex`): `cached` is what a router that knows every cache would find."""

    def __init__(self, engines: list[Engine], grpc: bool, model: Path) -> None:
        self.index = KvIndex(MODEL)
        self.zmq = {e.url: ZmqKvSubscriber(e.publisher) for e in engines if not grpc}
        self.grpc = {
            e.url: VllmGrpcUpstream(e.url, model=MODEL, tokenizer=str(model))
            for e in engines
            if grpc
        }
        self.tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Subscribes to every engine, and waits (10 s at most) until each is followed."""
        streams: dict[str, AsyncIterator[KvBatch]] = {
            url: subscriber.batches() for url, subscriber in self.zmq.items()
        }
        streams |= {url: upstream.kv_events(MODEL) for url, upstream in self.grpc.items()}
        self.tasks = [asyncio.create_task(self._follow(u, s)) for u, s in streams.items()]
        for _ in range(200):  # polled: the subscribers signal nothing
            if self._followed():
                break
            await asyncio.sleep(0.05)
        else:
            print("the oracle does not follow every engine's events", file=sys.stderr)
        await asyncio.sleep(0.5)  # a ZMQ subscription reaches the publisher after connecting

    def _followed(self) -> bool:
        """Whether every publisher is connected and every gRPC stream has begun (its
        first message is a load record)."""
        zmq = all(s.connected for s in self.zmq.values())
        return zmq and all(url in self.index.workers for url in self.grpc)

    async def _follow(self, address: str, batches: AsyncIterator[KvBatch]) -> None:
        async for batch in batches:
            self.index.apply(address, batch)

    def cached(self, ids: list[int]) -> int:
        """The most tokens of the prompt any engine holds now, as vLLM counts a hit: whole
        blocks from the start, the last token excepted (it is always computed)."""
        held, _ = self.index.match(ids)
        return min(max(held.values(), default=0), (len(ids) - 1) // BLOCK) * BLOCK

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for upstream in self.grpc.values():
            await upstream.close()


async def _measure(
    args: argparse.Namespace,
    rows: list[Row],
    engines: list[Engine],
    model: Path,
    caches: list[Engine],
) -> None:
    """The rows' requests; `caches`: the engines whose caches the oracle follows (those
    of `engines`, or a data-parallel server's engines)."""
    oracle = CacheOracle(caches, args.engines == "grpc", model)
    await oracle.start()
    try:
        await _requests(args, rows, engines, model, oracle)
    finally:
        await oracle.close()
    if oracle.index.block_size not in (0, BLOCK):
        print(f"the engines' blocks are of {oracle.index.block_size} tokens", file=sys.stderr)


async def _requests(
    args: argparse.Namespace,
    rows: list[Row],
    engines: list[Engine],
    model: Path,
    oracle: CacheOracle,
) -> None:
    tokenizer = load_tokenizer(str(model))
    rng = random.Random(7)
    talks: dict[str, list[list[dict[str, str]]]] = {}
    for row in rows:
        docs = _documents(tokenizer, row.name, args.documents, args.doc_tokens)
        talks[row.name] = [
            [{"role": "system", "content": docs[c % len(docs)]}] for c in range(args.conversations)
        ]
    start_cpu = {row.name: tree_cpu(row.pid) if row.pid else None for row in rows}
    began = time.perf_counter()
    together = max(1, args.concurrent)
    async with httpx.AsyncClient(timeout=300) as client:
        for turn in range(args.turns):
            for first in range(0, args.conversations, together):
                group = range(first, min(first + together, args.conversations))
                questions = [user_turn(rng, turn, args.turn_tokens) for _ in group]
                for row in rows:  # interleaved: the same engines, the same load
                    talk = [talks[row.name][c] for c in group]
                    await _group(client, row, talk, questions, tokenizer, engines, oracle)
            print(f"  turn {turn + 1} of {args.turns} done", file=sys.stderr, flush=True)
    for row in rows:
        row.wall = time.perf_counter() - began
        before = start_cpu[row.name]
        after = tree_cpu(row.pid) if row.pid else None
        if before is not None and after is not None:
            row.cpu_total = after - before


async def _group(
    client: httpx.AsyncClient,
    row: Row,
    talks: list[list[dict[str, str]]],
    questions: list[str],
    tokenizer: ModelTokenizer,
    engines: list[Engine],
    oracle: CacheOracle,
) -> None:
    """One turn of `talks` (conversations of `row`), sent at once (`--concurrent`; one
    at a time by default), each with its new user message: the engines' counters, the
    oracle and the router's CPU read around the group (a group's hits are shared among
    its requests by their prompts' lengths)."""
    prompts = []
    for talk, question in zip(talks, questions, strict=True):
        talk.append({"role": "user", "content": question})
        prompts.append(tokenizer.prompt_ids(None, [Message(m["role"], m["content"]) for m in talk]))
    await asyncio.sleep(0.05)  # the last request's last events, applied
    best = sum(oracle.cached(ids) for ids in prompts)
    row.oracle_hits += best
    for ids in prompts:
        row.unbounded_hits += _unbounded(row, ids)
        row.prompt_tokens += len(ids)
    hits, queries = _counters(engines)
    cpu = tree_cpu(row.pid) if row.pid else None
    start = time.perf_counter()
    answers = await asyncio.gather(
        *(one_chat(client, row.url, {"messages": talk, "max_tokens": MAX_TOKENS}) for talk in talks)
    )
    row.seconds += time.perf_counter() - start
    after = tree_cpu(row.pid) if row.pid else None
    if cpu is not None and after is not None:
        row.cpu += after - cpu
    now_hits, now_queries = _counters(engines)
    hit, asked = now_hits - hits, sum(len(ids) for ids in prompts)
    row.hits += hit
    row.queries += now_queries - queries
    row.beyond += hit > best
    row.miscounted += now_queries - queries != asked
    for ids, (ttft, tokens), talk in zip(prompts, answers, talks, strict=True):
        row.ttfts.append(ttft)
        row.prefills.append((len(ids) - round(hit * len(ids) / asked), ttft))
        row.tokens += tokens
        talk.append({"role": "assistant", "content": ANSWER})


def median_interval(values: list[float]) -> tuple[float, float]:
    """A 95 % confidence interval of the median of sorted `values` that assumes nothing
    of their distribution: the order statistics j and n+1-j (1-based), j the largest
    with P(Binomial(n, 1/2) < j) <= 2.5 % (the whole range when n < 6)."""
    n, j = len(values), 1
    below = 0.5**n  # P(Binomial(n, 1/2) < j)
    while j < n // 2 and below + math.comb(n, j) * 0.5**n <= 0.025:
        below += math.comb(n, j) * 0.5**n
        j += 1
    return values[j - 1], values[n - j]


def _table(rows: list[Row]) -> str:
    lines = [
        "| row | requests | hit rate | oracle | oracle, no evictions | TTFT p50 (95 % CI) "
        "| TTFT p99 "
        "| tokens/s | CPU/request | CPU/s between requests |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        if row.missing:
            lines.append(f"| {row.name} | not measured: {row.missing} | | | | | | | | |")
            continue
        values = sorted(row.ttfts)
        p99 = values[min(len(values) - 1, int(len(values) * 0.99))]
        hit = row.hits / row.queries if row.queries else 0.0
        low, high = median_interval(values)
        idle = row.wall - row.seconds
        between = (row.cpu_total - row.cpu) / idle if idle > 0 and row.cpu_total else 0.0
        lines.append(
            f"| {row.name} | {len(values)} | {hit:.1%} "
            f"| {row.oracle_hits / row.prompt_tokens:.1%} "
            f"| {row.unbounded_hits / row.prompt_tokens:.1%} "
            f"| {statistics.median(values) * 1000:.0f} ms ({low * 1000:.0f}-{high * 1000:.0f}) "
            f"| {p99 * 1000:.0f} ms "
            f"| {row.tokens / row.seconds:.1f} | {row.cpu / len(values) * 1e3:.1f} ms "
            f"| {between * 1e3:.1f} ms |"
        )
    return "\n".join(lines)


def _cost_line(rows: list[Row]) -> str:
    """What a cache hit can buy on these engines: TTFT against the prefill still to do
    (the prompt's tokens its engine did not find cached), a least-squares line over every
    row's requests; then each row's median prefill to do, and the TTFT p50 the line
    gives for the oracle's (a router as good as the caches allow), so the best TTFT ratio
    over round robin this workload can show on these engines is read off the line."""
    pairs = [pair for row in rows for pair in row.prefills]
    if len(pairs) < 3 or len({todo for todo, _ in pairs}) < 2:
        return ""
    slope, intercept = statistics.linear_regression(
        [float(todo) for todo, _ in pairs], [ttft * 1e3 for _, ttft in pairs]
    )
    r = statistics.correlation([float(t) for t, _ in pairs], [ttft for _, ttft in pairs])
    lines = [
        f"\nTTFT against the prefill to do, over all {len(pairs)} requests: "
        f"{intercept:.0f} ms + {slope * 1e3:.0f} ms per 1,000 uncached tokens (r² {r * r:.2f})",
        "| row | median prefill to do | mean prefill to do | line at the mean |",
        "| --- | ---: | ---: | ---: |",
    ]
    for row in rows:
        todo = [float(t) for t, _ in row.prefills]
        mean = statistics.fmean(todo)
        lines.append(
            f"| {row.name} | {statistics.median(todo):.0f} | {mean:.0f} "
            f"| {intercept + slope * mean:.0f} ms |"
        )
    oracle = rows[0].prompt_tokens - rows[0].oracle_hits  # the first row's prompts
    mean = oracle / len(rows[0].prefills)
    lines.append(
        f"| oracle (the first row's prompts) | | {mean:.0f} | {intercept + slope * mean:.0f} ms |"
    )
    return "\n".join(lines)


def _checks(rows: list[Row]) -> None:
    """Requests the oracle could not account for (stderr): an engine that hit more than
    the oracle saw anywhere, or that counted other tokens than the prompt's."""
    for row in rows:
        if row.beyond or row.miscounted:
            print(
                f"{row.name}: {row.beyond} requests hit more than the oracle's best engine, "
                f"{row.miscounted} counted other than the prompt's tokens",
                file=sys.stderr,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--size", default="256x4", help="the model's hidden size x layers")
    workload_arguments(parser)
    parser.set_defaults(conversations=15, turns=5)  # 75 requests a row: `Run` below
    parser.add_argument("--kv-blocks", type=int, default=300, help="per engine; 0: vLLM's")
    parser.add_argument("--no-peers", action="store_true")
    parser.add_argument("--engines", choices=("http", "grpc", "pd", "dp"), default="http")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--concurrent",
        type=int,
        default=1,
        help="conversations whose turns a row sends at once (1: one request at a time)",
    )
    args = parser.parse_args()
    began = time.monotonic()
    if args.quick:
        args.documents, args.conversations, args.turns = 1, 3, 2
    hidden, layers = (int(n) for n in args.size.split("x"))
    with tempfile.TemporaryDirectory() as raw, ExitStack() as stack:
        work = Path(raw)
        model = build_tiny_model(work / "model", ordered=True, for_vllm=True, size=(hidden, layers))
        grpc, pd, dp = (args.engines == kind for kind in ("grpc", "pd", "dp"))
        engines = []  # with `pd`, the prefill servers: where the prompts' caches are
        role = PRODUCER if pd else None
        for core in range(1 if dp else args.workers):
            size = args.workers if dp else 1
            engines.append(_engine(model, work, core, args.kv_blocks, grpc, role, size))
            stack.callback(engines[-1].server.stop)
        caches = _ranks(engines[0], args.workers) if dp else engines
        decode = None
        if pd:  # one decode server, pulling each prompt's blocks from its prefill server
            decode = _engine(model, work, args.workers, 0, False, CONSUMER)
            stack.callback(decode.server.stop)
        rows = [] if not dp else _dp_rows(stack, work, model, engines[0], args.workers)
        for policy in () if dp else POLICIES:
            routing: dict[str, object] = {"policy": policy}
            if policy == "kv_aware" and not grpc:  # gRPC workers' ride their own channel
                routing["kv_events"] = {f"{e.url}/v1": e.publisher for e in engines}
            urls = [e.url if grpc else f"{e.url}/v1" for e in engines]
            upstream: dict[str, object] = {
                "name": MODEL,
                "upstream": "vllm-grpc" if grpc else "openai",
                "tokenizer": str(model),
                "workers": urls,
                "routing": routing,
            }
            if decode is not None:  # the prefill tier routed; the decode tier has one server
                upstream.update(workers=[f"{decode.url}/v1"], prefill_workers=urls)
            target = start_gateway(stack, work, policy, upstream)
            rows.append(_row(f"furnace {policy}", target))
        peers = {} if args.no_peers else install_peers(PEERS_VENV)
        smg_metrics = ""
        for name, executable in peers.items():
            if dp:  # their DP-aware modes, cache-aware
                extra = ["--worker-urls", engines[0].url, "--policy", PEER_POLICY]
                extra += _dp_aware(name, args.workers)
                target = start_router(stack, name, executable, work, engines[0].url, extra)
                rows.append(_row(f"{name} {PEER_POLICY}, DP-aware", target))
                continue
            if decode is not None:  # their PD modes, the prefill tier cache-aware
                prefills = [e.url for e in engines]
                policy = ["--prefill-policy", PEER_POLICY]
                target = start_pd_router(
                    stack, name, executable, work, prefills, decode.url, None, policy
                )
                rows.append(_row(f"{name} {PEER_POLICY}", target))
                continue
            if grpc and name != "smg":
                rows.append(Row(f"{name} {PEER_POLICY}", missing="it has no gRPC mode"))
                continue
            urls = [f"grpc://{e.url}" if grpc else e.url for e in engines]
            extra = ["--worker-urls", *urls, "--policy", PEER_POLICY]
            if grpc:  # it tokenizes; its KV metrics say whether it followed the events
                port = free_port()
                smg_metrics = f"http://127.0.0.1:{port}/metrics"
                extra += ["--model-path", str(model), "--prometheus-port", str(port)]
            target = start_router(stack, name, executable, work, urls[0], extra)
            rows.append(_row(f"{name} {PEER_POLICY}", target))
        time.sleep(2)  # the kv_aware gateway subscribes to the engines' events
        measured = [row for row in rows if not row.missing]
        asyncio.run(_measure(args, measured, engines, model, caches))
        for row in measured:  # the kv_aware gateway's index: were events followed?
            if row.name.startswith("furnace kv_aware"):
                text = httpx.get(row.url + "/metrics").text
                print(*re.findall(INDEX_METRICS, text, re.M), sep="\n", file=sys.stderr)
        if smg_metrics:  # smg's index: did its gRPC router subscribe to the events?
            text = httpx.get(smg_metrics).text
            print(*re.findall(SMG_KV, text, re.M), sep="\n", file=sys.stderr)
        blocks = re.findall(r"num_gpu_blocks=\"(\d+)\"", engines[0].metrics())
    load = os.getloadavg()
    needed = sum(len(row.seen) for row in rows)  # the blocks all rows' prompts fill
    minutes = (time.monotonic() - began) / 60
    print(
        f"model {args.size}, {args.workers} {args.engines} engines of {blocks[:1] or '?'} "
        "KV blocks, "
        f"{args.documents} documents of ~{args.doc_tokens} tokens, {args.conversations} "
        f"conversations x {args.turns} turns a row ({needed} distinct blocks in all); load "
        f"average {load[0]:.1f} {load[1]:.1f}; {minutes:.1f} minutes"
    )
    _checks([row for row in rows if not row.missing])
    print(_table(rows))
    print(_cost_line([row for row in rows if row.prefills]))


def _dp_aware(router: str, size: int) -> list[str]:
    """A Rust router's options for a server of `size` data-parallel engines: smg's
    `--dp-aware`; vllm-router's engine count, with the key it then requires (vLLM's
    servers here take any)."""
    if router == "smg":
        return ["--dp-aware"]
    return ["--intra-node-data-parallel-size", str(size), "--api-key", "unused"]


def _dp_rows(stack: ExitStack, work: Path, model: Path, server: Engine, size: int) -> list[Row]:
    """furnace-gateway in front of one data-parallel server (`--engines dp`): kv_aware
    with each engine a worker, kv_aware with the server one worker, round robin over
    the engines."""
    url = f"{server.url}/v1"
    rows = []
    for name, policy, engines in (
        ("kv_aware, each engine a worker", "kv_aware", size),
        ("kv_aware, the server one worker", "kv_aware", 1),
        ("round_robin over the engines", "round_robin", size),
    ):
        routing: dict[str, object] = {"policy": policy}
        if policy == "kv_aware":
            routing["kv_events"] = {url: server.publisher}
        upstream = {
            "name": MODEL,
            "upstream": "openai",
            "tokenizer": str(model),
            "workers": [url],
            "data_parallel_size": engines,
            "routing": routing,
        }
        target = start_gateway(stack, work, f"{policy}-{engines}", upstream)
        rows.append(_row(f"furnace {name}", target))
    return rows


def _row(name: str, target: Target) -> Row:
    """The row of a started target (its URL is its calls' URL) or why it is missing."""
    if target.missing or target.calls is None:
        return Row(name, missing=target.missing or "no calls")
    return Row(name, url=target.calls().url, pid=target.pid)


if __name__ == "__main__":
    main()
