"""Benchmark: the gateway in front of a real engine (vLLM's CPU build, the tiny model), side
by side with the Rust gateways and with the engine reached directly, in one run.

Two paths, each against its own vLLM server:
- HTTP: vLLM's OpenAI server reached directly, through `vllm-router`, through `smg` (HTTP
  mode) and through furnace-gateway with `upstream: openai`.
- gRPC: vLLM's own gRPC server reached by a raw grpc.aio client sending the prompt's token
  ids (made once, as a client that tokenizes for itself would), through `smg` in gRPC mode
  (`--worker-urls grpc://...`, it renders the template and tokenizes) and through
  furnace-gateway with `upstream: vllm-grpc` (which does the same, and detokenizes).

- PD (`--paths PD`, not in the default run): prefill/decode disaggregation over two vLLM
  OpenAI servers with the NixlConnector (NIXL from the vLLM environment), one prefilling,
  one decoding: the two steps by hand (the baseline: a prefill, then the decode server's
  stream with where the blocks are), the decode server alone (no disaggregation: it
  prefills itself), furnace-gateway with `prefill_workers`, and the routers' PD modes
  (`vllm-router --vllm-pd-disaggregation --kv-connector nixl`, `smg launch
  --pd-disaggregation`). Each request has a fresh 150-word prompt, so every one is
  prefilled and its blocks moved.

Load: streamed chat completions, greedy, `max_tokens` 64 (the tiny model's junk rarely ends
early; tokens are counted from the final usage chunk, which every target sends), 1 stream
and 8 at once. On a 2-core machine the engine, the client and the gateways share the cores,
so the targets are interleaved (A B C D, A B C D, ...) over `--rounds` rounds and every
figure is given as the median of the rounds and their spread (min to max): a single round
moves by about a millisecond.

Columns: added TTFT p50 over the direct path's of the same round; tokens/s of the target
over the direct path's of the same round; the target's CPU (its process tree, /proc) per
request and per token streamed.

The routers are installed from PyPI into `.tools/peers` as `make bench-peers` does; a router
that cannot be installed or started is reported, not measured.

With `--stand-in STEP_MS` every target fronts the engines' stand-ins in place of vLLM
(`benchmarks/fake_openai.py` and `benchmarks/fake_vllm_grpc.py`, serving the same model's
tokens, one every STEP_MS milliseconds): no engine takes the cores, so what differs between
the targets is their own work, what a machine with cores for each process would show.

With `--relay` the HTTP path has two more targets, the floors of a gateway in Python:
`bench_edge_floor`'s bare TCP relay, a uvloop process that copies the bytes both ways and
parses nothing (what the extra hop costs before any work), and `openai_relay`, one that
parses the request and re-encodes each SSE event with nothing else (what parsing and
re-encoding add to the hop). With `--gateway-pythons PY[,PY]`
each path has the gateway run by those interpreters too (a venv of each with the project
installed: `python3.12 -m venv DIR && DIR/bin/pip install -e .`), beside this one's.
With `--processes N[,N]` each path has the gateway as N processes on one port too
(`processes: N`, SO_REUSEPORT): the Rust routers spread a load over every core by their
threads, a gateway in Python by its processes, so on a machine with cores to spare this
is the like-for-like row.

Run: `.venv/bin/python -m benchmarks.bench_vllm [--requests N] [--rounds R] [--quick]
[--paths HTTP,gRPC,PD] [--streams 1,8] [--no-peers] [--stand-in STEP_MS] [--relay]
[--gateway-pythons PY[,PY]] [--processes N[,N]] [--model-dir DIR] [--json PATH]`
(`make bench-vllm`;
10-30 minutes on a shared 2-core machine with the defaults, most of it the two vLLM
servers' start, up to 4 minutes each under load (`--start-timeout`, 600 s); `--quick` is
1 round of 8 requests; `--streams 1` measures the one-stream load alone). Each path's
table is printed as soon as it is measured. Not collected by
pytest.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_gateway import _gateway_ready, _spawn, _stop  # noqa: E402
from benchmarks.bench_peers import (  # noqa: E402
    HOST,
    PEERS,
    PEERS_VENV,
    install_peers,
    peer_version,
    router_command,
    tree_cpu,
)
from gateway.protocol.kv_transfer import PREFILL_TRANSFER  # noqa: E402
from gateway.tokenization.tokenizer import ModelTokenizer, load_tokenizer  # noqa: E402
from tests.support import vllm as vllm_support  # noqa: E402
from tests.support.processes import free_port  # noqa: E402
from tests.support.vllm import (  # noqa: E402
    VllmProcess,
    build_vllm_model,
    nixl_args,
    start_grpc_server,
    start_http_server,
    wait_grpc_serving,
    wait_http_ready,
)

MODEL = "tiny-vllm"
MAX_TOKENS = 64
MESSAGES = [{"role": "user", "content": "one two three"}]
DIRECT, FURNACE = "direct", "furnace-gateway"
#: The HTTP path's floors, with `--relay`: their names and modules (each served as
#: `python -m MODULE [--relay] PORT ENGINE_PORT`).
RELAYS = {
    "bare TCP relay": ["benchmarks.bench_edge_floor", "--relay"],
    "minimal OpenAI relay": ["benchmarks.openai_relay"],
    "minimal OpenAI relay, head at once": ["benchmarks.openai_relay", "--head-at-once"],
}
STARTUP_TIMEOUT = 90.0
LOADS = (1, 8)


# --- the clients -------------------------------------------------------------------------


def chat_body(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The benchmark's streamed chat request, greedy, with its usage (`extra`: more
    fields, or fields replaced)."""
    return {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }


async def one_chat(
    client: httpx.AsyncClient, url: str, extra: dict[str, Any] | None = None
) -> tuple[float, int]:
    """TTFT (seconds) and completion tokens of one streamed chat completion (`extra`:
    more fields of the request)."""
    body = chat_body(extra)
    start = time.perf_counter()
    ttft = None
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            choices = event.get("choices") or []
            if ttft is None and choices and (choices[0].get("delta") or {}).get("content"):
                ttft = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    if ttft is None or tokens == 0:
        raise RuntimeError(f"{url}: no content or no usage (ttft {ttft}, tokens {tokens})")
    return ttft, tokens


OneCall = Callable[[], Awaitable[tuple[float, int]]]
#: Fields of a request over the benchmark's own (`chat_body`), or what makes them anew for
#: each request (a fresh prompt), or None.
Body = dict[str, Any] | Callable[[], dict[str, Any]] | None


def fields_of(body: Body) -> dict[str, Any] | None:
    """One request's fields over the benchmark's own."""
    return body() if callable(body) else body


async def run_load(make_call: Callable[[], Any], streams: int, requests: int) -> Sample:
    """`requests` calls, `streams` at a time; `make_call` is an async context manager
    factory yielding the one-call coroutine function (a client per run)."""
    queue = list(range(requests))
    sample = Sample()
    async with make_call() as call:

        async def worker() -> None:
            while queue:
                queue.pop()
                ttft, count = await call()
                sample.ttfts.append(ttft)
                sample.tokens += count

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(streams)))
        sample.wall = time.perf_counter() - start
    sample.requests = requests
    return sample


class HttpCalls:
    """One pooled httpx client for a run against an OpenAI-shaped endpoint."""

    def __init__(self, url: str, extra: Body = None) -> None:
        self.url, self.extra = url, extra

    async def __aenter__(self) -> OneCall:
        limits = httpx.Limits(max_connections=64)
        self.client = httpx.AsyncClient(timeout=120, limits=limits)
        return lambda: one_chat(self.client, self.url, fields_of(self.extra))

    async def __aexit__(self, *exc: object) -> None:
        await self.client.aclose()


class DisaggregatedCalls(HttpCalls):
    """Prefill/decode disaggregation by hand, the floor of every router that drives it:
    the prefill as vLLM's proxy sends it (one token, whole, the blocks kept), then the
    decode server's stream with where the blocks are; TTFT from the prefill's start."""

    def __init__(self, prefill_url: str, decode_url: str, extra: Body) -> None:
        super().__init__(decode_url, extra)
        self.prefill_url = prefill_url

    async def __aenter__(self) -> OneCall:
        await super().__aenter__()

        async def call() -> tuple[float, int]:
            extra = fields_of(self.extra) or {}
            prefill = chat_body({**extra, "stream": False, "max_tokens": 1})
            del prefill["stream_options"]
            prefill["kv_transfer_params"] = PREFILL_TRANSFER
            start = time.perf_counter()
            url = self.prefill_url + "/v1/chat/completions"
            answer = await self.client.post(url, json=prefill)
            params = answer.json()["kv_transfer_params"]
            prefilled = time.perf_counter() - start
            decode = {**extra, "kv_transfer_params": params}
            ttft, tokens = await one_chat(self.client, self.url, decode)
            return prefilled + ttft, tokens

        return call


class GrpcCalls:
    """One channel to vLLM's gRPC server; each call sends the prompt's token ids and
    decodes the answer's as they come (as a client that tokenizes for itself would), its
    TTFT the first text, as the gateways' is: the tiny model's junk often begins with
    tokens that are pieces of a character, which show nothing."""

    def __init__(self, address: str, ids: list[int], tokenizer: ModelTokenizer) -> None:
        self.address, self.ids, self.tokenizer = address, ids, tokenizer

    async def __aenter__(self) -> OneCall:
        import grpc
        from smg_grpc_proto.generated import vllm_engine_pb2 as pb
        from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

        self.channel = grpc.aio.insecure_channel(self.address)
        stub = pb_grpc.VllmEngineStub(self.channel)

        async def call() -> tuple[float, int]:
            request = pb.GenerateRequest(
                request_id=f"bench-{time.perf_counter_ns()}",
                tokenized=pb.TokenizedInput(input_ids=self.ids),
                sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                stream=True,
            )
            start = time.perf_counter()
            ttft = None
            count = 0
            decoder = self.tokenizer.detokenizer()
            async for reply in stub.Generate(request, timeout=120):
                if reply.WhichOneof("response") == "chunk":
                    if decoder.feed(reply.chunk.token_ids) and ttft is None:
                        ttft = time.perf_counter() - start
                    count += len(reply.chunk.token_ids)
                else:  # the end, which may carry the last tokens
                    count = max(count, reply.complete.completion_tokens)
            if ttft is None:
                raise RuntimeError("vLLM's gRPC server sent no text")
            return ttft, count

        return call

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close()


# --- what is measured --------------------------------------------------------------------


@dataclass
class Sample:
    """One load against one target: TTFTs, tokens, wall seconds, CPU seconds."""

    ttfts: list[float] = field(default_factory=list)
    tokens: int = 0
    requests: int = 0
    wall: float = 0.0
    cpu: float | None = None

    @property
    def rate(self) -> float:
        return self.tokens / self.wall

    @property
    def p50(self) -> float:
        return statistics.median(self.ttfts)


@dataclass
class Target:
    """A way to reach the engine: its calls, the process whose CPU counts (None: the
    engine itself, the baseline), or why it is not measured."""

    name: str
    calls: Callable[[], Any] | None = None
    pid: int | None = None
    missing: str | None = None
    version: str = ""


def measure_round(targets: list[Target], streams: int, requests: int) -> dict[str, Sample]:
    """Each target in turn, the same load."""
    samples: dict[str, Sample] = {}
    for target in targets:
        if target.calls is None:
            continue
        cpu0 = tree_cpu(target.pid) if target.pid else None
        sample = asyncio.run(run_load(target.calls, streams, requests))
        cpu1 = tree_cpu(target.pid) if target.pid else None
        if cpu0 is not None and cpu1 is not None:
            sample.cpu = cpu1 - cpu0
        samples[target.name] = sample
    return samples


@dataclass
class Row:
    """A target at one load, over the rounds: each round's figure against that round's
    direct path."""

    path: str
    target: str
    streams: int
    added_ttft_ms: list[float]
    rate_ratio: list[float]
    cpu_per_request_us: list[float]
    cpu_per_token_us: list[float]
    direct_ttft_ms: list[float]


def measure_path(
    path: str, targets: list[Target], rounds: int, requests: int, loads: tuple[int, ...] = LOADS
) -> list[Row]:
    """Rounds of every load over every target, interleaved; rows per target and load."""
    print(f"  {path}: warming every target up", file=sys.stderr, flush=True)
    for streams in loads:  # warm every path once
        measure_round(targets, streams, max(8, streams * 2))
    rows = {
        (t.name, s): Row(path, t.name, s, [], [], [], [], [])
        for t in targets
        if t.calls is not None and t.name != DIRECT
        for s in loads
    }
    for round_ in range(rounds):
        for streams in loads:
            print(f"  {path}: round {round_ + 1}/{rounds}, {streams} streams", file=sys.stderr)
            samples = measure_round(targets, streams, requests)
            direct = samples[DIRECT]
            for name, sample in samples.items():
                if name == DIRECT:
                    continue
                row = rows[(name, streams)]
                row.direct_ttft_ms.append(direct.p50 * 1e3)
                row.added_ttft_ms.append((sample.p50 - direct.p50) * 1e3)
                row.rate_ratio.append(sample.rate / direct.rate)
                if sample.cpu is not None:
                    row.cpu_per_request_us.append(sample.cpu / sample.requests * 1e6)
                    row.cpu_per_token_us.append(sample.cpu / sample.tokens * 1e6)
    return list(rows.values())


# --- processes ---------------------------------------------------------------------------


def start_gateway(
    stack: ExitStack,
    work: Path,
    name: str,
    model: Mapping[str, object],
    body: Body = None,
    python: str = sys.executable,
    processes: int = 1,
) -> Target:
    """A furnace-gateway process serving `model`, ready (`body`: fields of the requests
    sent to it), run by `python` (another interpreter, with the project installed: the
    target is named by its version), as `processes` processes on its port."""
    label = FURNACE
    if processes > 1:
        label, name = f"{FURNACE}, {processes} processes", f"{name}-x{processes}"
    if python != sys.executable:
        version = subprocess.run(
            [python, "-c", "import platform; print(platform.python_version())"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        label, name = f"{FURNACE} (Python {version})", f"{name}-{version}"
    port = free_port()
    # start_timeout: a CPU engine's first event after a cold 2,000-token prefill takes
    # seconds, past the 10 s default on a loaded machine; the peers wait without a bound
    config = {
        "host": "127.0.0.1",
        "port": port,
        "log_level": "warning",
        "start_timeout": 300,
        "processes": processes,
        "models": [model],
    }
    (work / f"{name}.yaml").write_text(yaml.safe_dump(config))
    args = ["-m", "gateway", "serve", "--config", str(work / f"{name}.yaml")]
    gateway = _spawn(args, python)
    stack.callback(_stop, gateway)
    end = time.monotonic() + STARTUP_TIMEOUT
    while not _gateway_ready(port):
        if time.monotonic() > end or gateway.poll() is not None:
            return Target(label, missing="the gateway did not start")
        time.sleep(0.2)
    url = f"http://127.0.0.1:{port}"
    return Target(label, lambda: HttpCalls(url, body), gateway.pid)


def start_router(
    stack: ExitStack,
    name: str,
    executable: Path | str,
    work: Path,
    worker: str,
    extra: list[str],
    body: Body = None,
) -> Target:
    """A Rust router in front of `worker` (`extra`: more of its options), ready (it
    answers a chat), or why not (`body`: fields of the requests sent to it)."""
    if isinstance(executable, str):
        return Target(name, missing=executable)
    port = free_port()
    command = router_command(name, executable, port, free_port(), worker) + extra
    log = work / f"{name}-{port}.log"
    with log.open("wb") as output:
        process = subprocess.Popen(command, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)
    stack.callback(_stop, process)
    return _serving(name, process, port, log, body)


def start_relay(
    stack: ExitStack, work: Path, name: str, engine_port: int, body: Body = None
) -> Target:
    """The floor `name` of `RELAYS` in front of the engine's port, ready: a uvloop process
    that copies bytes both ways, or one that parses and re-encodes with nothing else."""
    port = free_port()
    command = [sys.executable, "-m", *RELAYS[name], str(port), str(engine_port)]
    log = work / f"relay-{port}.log"
    with log.open("wb") as output:
        process = subprocess.Popen(command, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)
    stack.callback(_stop, process)
    return _serving(name, process, port, log, body)


def _serving(
    name: str, process: subprocess.Popen[bytes], port: int, log: Path, body: Body
) -> Target:
    """The target at `port` once it answers a chat, or why not (it exited, or too slow)."""
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < end:
        if process.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:]
            return Target(name, missing=f"exited ({process.returncode}): {' '.join(tail)[:160]}")
        try:
            asyncio.run(run_load(lambda: HttpCalls(url, body), 1, 1))
            return Target(name, lambda: HttpCalls(url, body), process.pid)
        except (httpx.HTTPError, RuntimeError):
            time.sleep(0.5)
    return Target(name, missing=f"did not serve within {STARTUP_TIMEOUT:g} s")


@dataclass
class Engine:
    """What the gateways front: vLLM's CPU build, or (`step_ms` set) a stand-in of it
    that paces a token each `step_ms` and takes almost no CPU, so that what is left
    between the targets is their own work (the stand-ins of `profile_gateway`)."""

    model_dir: Path
    work: Path
    step_ms: float | None = None

    @property
    def http_body(self) -> Body:
        """Fields of the HTTP path's requests: the HTTP stand-in echoes the prompt's
        words, so it is given as many as an answer's tokens."""
        if self.step_ms is None:
            return None
        words = " ".join(f"w{i}" for i in range(MAX_TOKENS))
        return {"messages": [{"role": "user", "content": words}]}

    def http(self) -> VllmProcess:
        """vLLM's OpenAI server, or `benchmarks/fake_openai.py`, ready."""
        if self.step_ms is None:
            return start_http_server(self.model_dir, self.work, MODEL)
        command = ["-m", "benchmarks.fake_openai", "--model", MODEL]
        return self._stand_in([*command, "--step-ms", str(self.step_ms)], wait_http_ready)

    def grpc(self) -> VllmProcess:
        """vLLM's gRPC server, or `benchmarks/fake_vllm_grpc.py`, ready."""
        if self.step_ms is None:
            return start_grpc_server(self.model_dir, self.work, ("--served-model-name", MODEL))
        command = ["-m", "benchmarks.fake_vllm_grpc", "--model-dir", str(self.model_dir)]
        command += ["--served-model-name", MODEL, "--step-ms", str(self.step_ms)]
        return self._stand_in(command, wait_grpc_serving)

    def _stand_in(self, args: list[str], ready: Callable[[VllmProcess], None]) -> VllmProcess:
        port = free_port()
        command = [sys.executable, *args, "--port", str(port)]
        server = VllmProcess(command, port, self.work / f"stand-in-{port}.log").start()
        ready(server)
        return server


@contextmanager
def http_targets(
    engine: Engine,
    peers: dict[str, Path | str],
    relay: bool = False,
    pythons: Sequence[str] = (),
    processes: Sequence[int] = (),
) -> Iterator[list[Target]]:
    """vLLM's OpenAI server and everything in front of it (`relay`: the floors of
    `RELAYS` too; `pythons`: the gateway run by those interpreters too; `processes`: as
    that many processes too)."""
    work = engine.work
    with ExitStack() as stack:
        vllm = engine.http()
        stack.callback(vllm.stop)
        direct_url = f"http://127.0.0.1:{vllm.port}"
        body = engine.http_body
        targets = [Target(DIRECT, lambda: HttpCalls(direct_url, body))]
        upstream = {"name": MODEL, "upstream": "openai", "workers": [f"{direct_url}/v1"]}
        for python in (sys.executable, *pythons):
            targets.append(start_gateway(stack, work, "http", upstream, body, python))
        for count in processes:
            targets.append(start_gateway(stack, work, "http", upstream, body, processes=count))
        for name, executable in peers.items():
            targets.append(start_router(stack, name, executable, work, direct_url, [], body))
        if relay:
            targets += [start_relay(stack, work, name, vllm.port, body) for name in RELAYS]
        yield targets


@contextmanager
def grpc_targets(
    engine: Engine,
    peers: dict[str, Path | str],
    pythons: Sequence[str] = (),
    processes: Sequence[int] = (),
) -> Iterator[list[Target]]:
    """vLLM's gRPC server, a raw client, furnace's `vllm-grpc` (`pythons`: run by those
    interpreters too; `processes`: as that many processes too) and smg's gRPC mode."""
    from gateway.protocol.types import Message

    model_dir, work = engine.model_dir, engine.work
    with ExitStack() as stack:
        vllm = engine.grpc()
        stack.callback(vllm.stop)
        address = f"127.0.0.1:{vllm.port}"
        tokenizer = load_tokenizer(str(model_dir))
        ids = tokenizer.prompt_ids(None, [Message(m["role"], m["content"]) for m in MESSAGES])
        targets = [Target(DIRECT, lambda: GrpcCalls(address, ids, tokenizer))]
        upstream = {
            "name": MODEL,
            "upstream": "vllm-grpc",
            "tokenizer": str(model_dir),
            "workers": [address],
        }
        for python in (sys.executable, *pythons):
            targets.append(start_gateway(stack, work, "grpc", upstream, None, python))
        for count in processes:
            targets.append(start_gateway(stack, work, "grpc", upstream, processes=count))
        smg = peers.get("smg")
        if smg is not None:
            extra = ["--model-path", str(model_dir)]
            targets.append(start_router(stack, "smg", smg, work, f"grpc://{address}", extra))
        yield targets


#: The disaggregated path's prompt: a fresh head (no prefix cache to hit) and words enough
#: for a few dozen of vLLM's 16-token KV blocks to move (about 600 of the tiny model's
#: tokens, within its 1,024).
PD_WORDS = 150
COUNTING = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def fresh_prompts(model_dir: Path) -> Callable[[], dict[str, Any]]:
    """Requests' fields, each call's messages new to every server; every token of the
    answer one letter (a logit bias), so that each shows text from its first token: the
    tiny model's greedy answers to long prompts often hold no text at all."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    letter = tokenizer.encode("o", add_special_tokens=False).ids[0]
    words = " ".join(COUNTING[i % len(COUNTING)] for i in range(PD_WORDS))

    def fields() -> dict[str, Any]:
        content = f"{uuid.uuid4().hex} {words}"
        return {"messages": [{"role": "user", "content": content}], "logit_bias": {letter: 100}}

    return fields


def nixl_server(engine: Engine, role: str) -> VllmProcess:
    """vLLM's OpenAI server with the NixlConnector in `role` (`kv_producer`: prefills;
    `kv_consumer`: decodes), ready."""
    extra, env = nixl_args(role)
    return start_http_server(engine.model_dir, engine.work, MODEL, extra=extra, env=env)


def start_pd_router(
    stack: ExitStack,
    name: str,
    executable: Path | str,
    work: Path,
    prefill: str | Sequence[str],
    decode: str,
    body: Body,
    extra: Sequence[str] = (),
) -> Target:
    """A Rust router in its prefill/decode mode over the servers (one prefill server or
    several), ready, or why not; `extra`: more of its options (`--prefill-policy`)."""
    if isinstance(executable, str):
        return Target(name, missing=executable)
    port = free_port()
    prefills = [prefill] if isinstance(prefill, str) else prefill
    common = ["--host", HOST, "--port", str(port), "--decode", decode]
    common += [word for url in prefills for word in ("--prefill", url)]
    common += ["--policy", "round_robin", "--prometheus-host", HOST]
    common += ["--prometheus-port", str(free_port()), *extra]
    if name == "smg":
        command = [str(executable), "launch", "--pd-disaggregation", *common]
    else:
        command = [str(executable), "--vllm-pd-disaggregation", "--kv-connector", "nixl", *common]
    log = work / f"{name}-pd-{port}.log"
    with log.open("wb") as output:
        process = subprocess.Popen(command, cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)
    stack.callback(_stop, process)
    return _serving(name, process, port, log, body)


@contextmanager
def pd_targets(
    engine: Engine,
    peers: dict[str, Path | str],
    pythons: Sequence[str] = (),
    processes: Sequence[int] = (),
) -> Iterator[list[Target]]:
    """Two vLLM OpenAI servers, one prefilling, one decoding, the KV cache moved by the
    NixlConnector: the two steps by hand (the baseline), the decode server alone (it
    prefills itself), furnace with `prefill_workers`, and the routers' PD modes."""
    if engine.step_ms is not None:
        raise SystemExit("the PD path needs vLLM's KV transfer: no --stand-in")
    work = engine.work
    with ExitStack() as stack:
        prefill = nixl_server(engine, "kv_producer")
        stack.callback(prefill.stop)
        decode = nixl_server(engine, "kv_consumer")
        stack.callback(decode.stop)
        prefill_url, decode_url = (f"http://127.0.0.1:{s.port}" for s in (prefill, decode))
        fresh = fresh_prompts(engine.model_dir)
        targets = [
            Target(DIRECT, lambda: DisaggregatedCalls(prefill_url, decode_url, fresh)),
            Target("decode server alone", lambda: HttpCalls(decode_url, fresh)),
        ]
        upstream = {
            "name": MODEL,
            "upstream": "openai",
            "workers": [f"{decode_url}/v1"],
            "prefill_workers": [f"{prefill_url}/v1"],
        }
        for python in (sys.executable, *pythons):
            targets.append(start_gateway(stack, work, "pd", upstream, fresh, python))
        for count in processes:
            targets.append(start_gateway(stack, work, "pd", upstream, fresh, processes=count))
        for name, executable in peers.items():
            pd = (prefill_url, decode_url, fresh)
            targets.append(start_pd_router(stack, name, executable, work, *pd))
        yield targets


# --- the report --------------------------------------------------------------------------


def spread(values: list[float], fmt: str) -> str:
    """`median (min to max)` of a figure over the rounds."""
    if not values:
        return "n/a"
    median = format(statistics.median(values), fmt)
    if len(values) == 1:
        return median
    return f"{median} ({format(min(values), fmt)} to {format(max(values), fmt)})"


def report(rows: list[Row], missing: list[Target], rounds: int, requests: int) -> None:
    print(
        f"\n{requests} streamed chat completions per target, load and round; {rounds} rounds, "
        f"targets interleaved; {MAX_TOKENS}-token greedy answers; {os.cpu_count()} cores\n"
    )
    print(
        "| path | target | streams | direct TTFT p50 | added TTFT p50 | tokens/s ÷ direct "
        "| CPU per request | CPU per token |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print(
            f"| {row.path} | {row.target} | {row.streams} "
            f"| {spread(row.direct_ttft_ms, '.1f')} ms | {spread(row.added_ttft_ms, '+.1f')} ms "
            f"| {spread(row.rate_ratio, '.2f')} | {spread(row.cpu_per_request_us, '.0f')} µs "
            f"| {spread(row.cpu_per_token_us, '.1f')} µs |"
        )
    for target in missing:
        print(f"\nnot measured: {target.name}: {target.missing}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32, help="requests per target and round")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--no-peers", action="store_true", help="measure without the routers")
    parser.add_argument("--peers-venv", type=Path, default=PEERS_VENV)
    parser.add_argument("--quick", action="store_true", help="1 round of 8 requests")
    parser.add_argument(
        "--start-timeout", type=float, default=600.0, help="seconds a vLLM server may take to start"
    )
    parser.add_argument(
        "--paths", default="HTTP,gRPC", help="the paths to measure, of HTTP, gRPC and PD"
    )
    parser.add_argument(
        "--streams", default="1,8", help="the loads to measure: streams at once, comma-separated"
    )
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    parser.add_argument(
        "--model-dir",
        type=Path,
        help="this model folder (config, tokenizer, template) in place of the tiny one built",
    )
    parser.add_argument(
        "--relay",
        action="store_true",
        help="HTTP: two floors in Python too: a bare TCP relay, and one that parses and re-encodes",
    )
    parser.add_argument(
        "--gateway-pythons",
        default="",
        metavar="PY[,PY]",
        help="the gateway run by these interpreters too (each with the project installed)",
    )
    parser.add_argument(
        "--processes",
        default="",
        metavar="N[,N]",
        help="the gateway as N processes on its port too (`processes: N`), for machines with cores",
    )
    parser.add_argument(
        "--stand-in",
        type=float,
        metavar="STEP_MS",
        help="front the engines' stand-ins, a token every STEP_MS ms, in place of vLLM",
    )
    args = parser.parse_args()
    peers: dict[str, Path | str] = (
        dict.fromkeys(PEERS, "skipped (--no-peers)")
        if args.no_peers
        else install_peers(args.peers_venv)
    )
    versions = {
        name: peer_version(args.peers_venv, PEERS[name][0])
        for name, found in peers.items()
        if isinstance(found, Path)
    }
    if args.quick:
        args.rounds, args.requests = 1, 8
    loads = tuple(int(s) for s in args.streams.split(","))
    vllm_support.START_GUARD = args.start_timeout
    # a SIGTERM (a timeout's) unwinds like Ctrl-C, so the vLLM servers are stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows: list[Row] = []
    missing: list[Target] = []
    pythons = [p for p in args.gateway_pythons.split(",") if p]
    counts = [int(n) for n in args.processes.split(",") if n]
    paths = {
        "HTTP": functools.partial(
            http_targets, relay=args.relay, pythons=pythons, processes=counts
        ),
        "gRPC": functools.partial(grpc_targets, pythons=pythons, processes=counts),
        "PD": functools.partial(pd_targets, pythons=pythons, processes=counts),
    }
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        work = Path(tmp)
        model_dir = args.model_dir or build_vllm_model(work / "model")
        engine = Engine(model_dir.resolve(), work, args.stand_in)
        for path in args.paths.split(","):
            print(f"{path}: starting vLLM and the gateways", file=sys.stderr, flush=True)
            with paths[path](engine, peers) as targets:
                missing += [t for t in targets if t.missing]
                measured = measure_path(path, targets, args.rounds, args.requests, loads)
            report(measured, [], args.rounds, args.requests)  # as soon as it is measured
            rows += measured
    if versions:
        print("\nrouters: " + ", ".join(f"{n} {v}" for n, v in versions.items()))
    print("\nall paths:")
    report(rows, missing, args.rounds, args.requests)
    if args.json:
        args.json.write_text(json.dumps([row.__dict__ for row in rows], indent=2))


if __name__ == "__main__":
    main()
