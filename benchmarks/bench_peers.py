"""Side by side with the Rust routers: furnace-gateway, vLLM's router (`vllm-router`) and
SGLang's model gateway (`smg`), each in front of the same fast fake OpenAI engine, in
one run, against the engine served directly; then the gRPC path against a raw client.

What one run measures (issue 14's table, this run's figures):

- HTTP upstream mode, each of direct, vllm-router, smg and furnace-gateway (one process,
  and as `--processes N` processes on one port, `serve --workers N`, default 2) in front of
  `benchmarks/fake_openai.py` (one SSE event per token, echoing the prompt's words):
  TTFT p50 at 1 stream (16-token answers, the targets taking turns in blocks of 50
  requests, so a slow patch of the machine hits them alike); and at 32 streams of
  256-token answers back to back, the TTFT p50, the tokens per second and the
  end-to-end p50; tokens delivered against emitted for every finished request (the
  text, the words of the deltas and the usage against the prompt's words). The 32
  streams start together each round (a burst of 32 requests at once: the issue's
  row); the same load again with the streams staggered (stream i starts i/32 of an
  answer's time after the first) gives the TTFT of a request that starts among 31
  running answers, with no burst of starts before it; and the burst once more with the
  engine taking `PREFILL_MS` to each answer's first token (the requests' `user` asks
  the fake engine for it), as a GPU engine's prefill does: the gateways' starts then
  overlap the engine's own time to first token, as they would in front of a real one.
- The gRPC path: furnace-gateway against a raw grpc.aio client on the same worker
  (`benchmarks/bench_gateway.py`'s), as it runs by default (every request to a worker
  on one `GenerateMultiplexed` call) and with `multiplex_workers: false` (a `Generate`
  call per request, as the raw client makes): TTFT p50 at 1 and 32 streams on the demo
  engine (16-token answers), tokens per second at 32 streams from the echo worker that
  sends 1 token per event (per gRPC message on a call of its own; on the multiplexed
  call, one event of each request a step of its loop); the gateway's CPU per request
  (1 stream, 16 tokens) and per token (32 streams), from /proc.
- The gateway's resident memory per open stream, 1,000 streams held open on a worker
  that sends a token every 10 s, both ways.

The routers are installed from PyPI into `.tools/peers` (a virtualenv this script
makes when it is missing; `--peers-venv` points elsewhere). A router that cannot be
installed or started is reported as such in the table, never estimated.

Every process shares the machine: the engine, the gRPC workers, the routers, the
gateway (`python -m gateway serve`, uvloop and httptools as in production) and this
client (uvloop; the load generator's httptools client). Compare the ratios of one
run: other work on the machine moves the absolute figures.

Run: `python -m benchmarks.bench_peers [--quick] [--json PATH] [--processes N] [--no-peers]`
(`make bench-peers`); about a minute once the routers are installed, half with --quick.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from math import nan
from pathlib import Path
from typing import Any, TypeVar

import orjson
import uvloop
import yaml

from benchmarks.bench_gateway import (
    COALESCED,
    ECHO,
    MEMORY_STREAMS,
    SLOW,
    BenchError,
    Client,
    CpuClock,
    Delivery,
    GatewayClient,
    GrpcClient,
    GrpcMultiplexClient,
    LatencyRun,
    Prompt,
    Settings,
    Timings,
    _commit,
    _port_open,
    _spawn,
    _stop,
    _table,
    _wait_until,
    commit_label,
    cpu_used,
    free_ports,
    machine_busy,
    make_prompt,
    measure_flow,
    measure_memory,
    measure_ttft,
    process_cpu,
)
from benchmarks.fake_openai import MODEL as ENGINE_MODEL
from gateway.bench.client import Tally
from gateway.bench.stats import percentile

ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")
HOST = "127.0.0.1"
PEERS_VENV = ROOT / ".tools" / "peers"
#: The routers, by the name the table gives them: their PyPI package and command.
PEERS = {"vllm-router": ("vllm-router", "vllm-router"), "smg": ("smg", "smg")}
DIRECT, FURNACE = "direct", "furnace-gateway"
#: Milliseconds the engine takes to the first token in the prefill column's load.
PREFILL_MS = 5
#: The gateway with `multiplex_workers: false` (a Generate call per request), gRPC path only.
PER_CALL = "furnace-gateway, a call per request"
RAW, RAW_MUX = "raw gRPC", "raw gRPC, multiplexed"
STARTUP_TIMEOUT = 60.0
CALL_TIMEOUT = 120.0


@dataclass(frozen=True)
class PeerSettings:
    """How much of each measurement; the default run takes about a minute."""

    ttft_blocks: int = 8  # blocks of 50 sequential requests per target
    streams: int = 32
    short_words: int = 16
    long_words: int = 256
    load_per_stream: int = 2  # 256-token requests per stream, measured, in each round
    load_rounds: int = 6
    grpc: Settings = field(
        default_factory=lambda: Settings(
            ttft_requests=300, ttft_per_stream=20, warmup_s=1.0, window_s=4.0
        )
    )


DEFAULT = PeerSettings()
QUICK = PeerSettings(
    ttft_blocks=3,
    load_rounds=2,
    grpc=Settings(ttft_requests=150, ttft_per_stream=8, warmup_s=0.5, window_s=2.0),
)


def _progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


# --- the routers' environment ------------------------------------------------------------


def install_peers(venv: Path) -> dict[str, Path | str]:
    """Each router's executable, installed into `venv` when missing, or why it is not
    there (the reason goes in the table)."""
    found: dict[str, Path | str] = {}
    missing = [
        name for name, (_, command) in PEERS.items() if not (venv / "bin" / command).exists()
    ]
    if missing:
        if not (venv / "bin" / "pip").exists():
            where = venv.relative_to(ROOT) if venv.is_relative_to(ROOT) else venv
            _progress(f"making the routers' virtualenv in {where}")
            made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True)
            if made.returncode != 0:
                reason = f"no virtualenv: {made.stderr.decode(errors='replace')[-200:]}"
                return dict.fromkeys(PEERS, reason)
        for name in missing:
            package = PEERS[name][0]
            _progress(f"installing {package} from PyPI")
            pip = [str(venv / "bin" / "pip"), "install", "-q", package]
            done = subprocess.run(pip, capture_output=True)
            if done.returncode != 0:
                tail = done.stderr.decode(errors="replace").strip().splitlines()[-1:]
                found[name] = f"pip install {package} failed: {' '.join(tail)[:160]}"
    for name, (_, command) in PEERS.items():
        path = venv / "bin" / command
        if name not in found:
            found[name] = path if path.exists() else f"{command} not found after install"
    return found


def peer_version(venv: Path, package: str) -> str:
    """The installed version of `package`, for the report."""
    shown = subprocess.run(
        [str(venv / "bin" / "pip"), "show", package], capture_output=True, text=True
    )
    for line in shown.stdout.splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return "?"


def router_command(
    name: str, executable: Path, port: int, metrics_port: int, engine: str
) -> list[str]:
    """How each router fronts one OpenAI HTTP worker: its own command line, round robin
    over the one worker, logs quiet, its Prometheus listener on loopback."""
    common = ["--host", HOST, "--port", str(port), "--worker-urls", engine]
    common += ["--policy", "round_robin", "--prometheus-host", HOST]
    common += ["--prometheus-port", str(metrics_port)]
    if name == "smg":
        return [str(executable), "launch", *common, "--log-level", "warn"]
    return [str(executable), *common, "--log-level", "warning"]


# --- processes ---------------------------------------------------------------------------


def tree_cpu(pid: int) -> float | None:
    """CPU seconds of a process and its children (a gateway of several processes)."""
    total = process_cpu(pid)
    if total is None:
        return None
    for child in children(pid):
        total += process_cpu(child) or 0.0
    return total


def children(pid: int) -> list[int]:
    """The direct children of a process (/proc/PID/task/*/children)."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.scandir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"{task.path}/children") as listed:
                found += [int(p) for p in listed.read().split()]
    return found


class TreeClock(CpuClock):
    """`CpuClock` over a target's whole process tree; the gateway's slot is the target
    (None for the engine served directly), the worker's the engine."""

    def __init__(self, target_pid: int | None, worker_pid: int) -> None:
        super().__init__(target_pid or 0, worker_pid)
        self.target_pid = target_pid

    def read(self) -> dict[str, float | None]:
        return {
            "gateway": None if self.target_pid is None else tree_cpu(self.target_pid),
            "worker": process_cpu(self.worker_pid),
            "client": time.process_time(),
            "machine": machine_busy(),
        }


def _popen(args: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
    output = log.open("wb")
    return subprocess.Popen(list(args), cwd=ROOT, stdout=output, stderr=subprocess.STDOUT)


def _ready(url: str, body: bytes) -> bool:
    """A short streamed answer came back whole."""
    request = urllib.request.Request(
        url, data=body, headers={"content-type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            return response.status == 200 and b"[DONE]" in response.read()
    except OSError:
        return False


def wait_serving(name: str, process: subprocess.Popen[bytes], port: int, log: Path) -> str | None:
    """None once `port` answers a streamed chat; else why not (it exited, or too slow)."""
    probe = make_prompt(ENGINE_MODEL, 3, random.Random(0)).http_body
    end = time.monotonic() + STARTUP_TIMEOUT
    while not _ready(f"http://{HOST}:{port}/v1/chat/completions", probe):
        if process.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:]
            return f"{name} exited ({process.returncode}): {' '.join(tail)[:160]}"
        if time.monotonic() > end:
            return f"{name} did not serve within {STARTUP_TIMEOUT:g} s"
        time.sleep(0.1)
    return None


@dataclass
class Target:
    """One thing measured in HTTP mode: a port, the process serving it (None: the
    engine itself), or why it is not there."""

    name: str
    port: int = 0
    pid: int | None = None
    missing: str | None = None
    version: str = ""


@dataclass
class Setup:
    """Every process of the run."""

    engine_pid: int
    workers_pid: int
    gateway_pid: int
    gateway_port: int
    worker_ports: dict[str, int]
    targets: list[Target]
    #: The gRPC path's gateways by name: (port, pid); the one-process gateway's workers
    #: multiplexed (the default), and the same gateway with a call per request.
    grpc_gateways: dict[str, tuple[int, int]] = field(default_factory=dict)


@contextlib.contextmanager
def start_all(venv: Path, processes: int, skip_peers: bool) -> Iterator[Setup]:
    """The engine, the gRPC workers, the gateway and the routers; all stopped on exit."""
    grpc_models = [COALESCED, *ECHO.values(), SLOW]  # what the workers process serves
    ports = free_ports(len(grpc_models) + 4 + 2 * len(PEERS))
    engine_port, gateway_port, several_port, per_call_port, *rest = ports
    worker_ports = dict(zip(grpc_models, rest[: len(grpc_models)], strict=True))
    peer_ports = rest[len(grpc_models) :]
    engine_url = f"http://{HOST}:{engine_port}"
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="furnace-peers-")))
        engine_log = logs / "engine.log"
        command = [sys.executable, "-m", "benchmarks.fake_openai", "--port", str(engine_port)]
        engine = _popen(command, engine_log)
        stack.callback(_stop, engine)
        workers = _spawn(
            [
                str(ROOT / "benchmarks" / "bench_gateway.py"),
                "--worker-process",
                ",".join(f"{m}={p}" for m, p in worker_ports.items()),
            ]
        )
        stack.callback(_stop, workers)
        if reason := wait_serving("the engine", engine, engine_port, engine_log):
            raise RuntimeError(reason)
        _wait_until(lambda: all(map(_port_open, worker_ports.values())), "the workers", workers)

        config = {
            "host": HOST,
            "port": gateway_port,
            "log_level": "warning",
            "max_concurrent_requests": 2 * MEMORY_STREAMS,
            "models": [
                {"name": ENGINE_MODEL, "upstream": "openai", "workers": [f"{engine_url}/v1"]},
                *({"name": m, "workers": [f"{HOST}:{p}"]} for m, p in worker_ports.items()),
            ],
        }
        config_path = logs / "gateway.yaml"
        config_path.write_text(yaml.safe_dump(config))
        serve = [sys.executable, "-m", "gateway", "serve", "--config", str(config_path)]
        gateway_log = logs / "gateway.log"
        gateway = _popen(serve, gateway_log)
        stack.callback(_stop, gateway)
        if reason := wait_serving(FURNACE, gateway, gateway_port, gateway_log):
            raise RuntimeError(reason)
        per_call_path = logs / "per-call.yaml"
        per_call_config = {**config, "port": per_call_port, "multiplex_workers": False}
        per_call_path.write_text(yaml.safe_dump(per_call_config))
        per_call_log = logs / "per-call.log"
        serve_per_call = [sys.executable, "-m", "gateway", "serve", "--config", str(per_call_path)]
        per_call = _popen(serve_per_call, per_call_log)
        stack.callback(_stop, per_call)
        if reason := wait_serving(PER_CALL, per_call, per_call_port, per_call_log):
            raise RuntimeError(reason)
        several: Target | None = None
        if processes > 1:  # the same gateway as N processes on one port, HTTP mode only
            several_path = logs / "several.yaml"
            several_path.write_text(yaml.safe_dump({**config, "port": several_port}))
            name = f"{FURNACE}, {processes} processes"
            serve = [sys.executable, "-m", "gateway", "serve", "--config", str(several_path)]
            several_log = logs / "several.log"
            process = _popen([*serve, "--workers", str(processes)], several_log)
            stack.callback(_stop, process)
            reason = wait_serving(name, process, several_port, several_log)
            several = Target(name, several_port, process.pid, reason)

        targets = [Target(DIRECT, engine_port, None)]
        found = (
            {name: "skipped (--no-peers)" for name in PEERS} if skip_peers else install_peers(venv)
        )
        for index, (name, executable) in enumerate(found.items()):
            if isinstance(executable, str):
                targets.append(Target(name, missing=executable))
                continue
            port, metrics_port = peer_ports[2 * index], peer_ports[2 * index + 1]
            log = logs / f"{name}.log"
            process = _popen(router_command(name, executable, port, metrics_port, engine_url), log)
            stack.callback(_stop, process)
            reason = wait_serving(name, process, port, log)
            version = peer_version(venv, PEERS[name][0])
            targets.append(Target(name, port, process.pid, reason, version))
        targets.append(Target(FURNACE, gateway_port, gateway.pid))
        if several is not None:
            targets.append(several)
        grpc_gateways = {
            FURNACE: (gateway_port, gateway.pid),
            PER_CALL: (per_call_port, per_call.pid),
        }
        yield Setup(
            engine.pid, workers.pid, gateway.pid, gateway_port, worker_ports, targets, grpc_gateways
        )


# --- HTTP mode ---------------------------------------------------------------------------


class TargetClient(GatewayClient):
    """The load generator's client on a target's port, named for the report."""

    def __init__(self, name: str, port: int) -> None:
        super().__init__(port)
        self.name = name


@dataclass
class LoadSample:
    """One round of `streams` streams of long answers back to back, on one target."""

    ttfts: list[float] = field(default_factory=list)
    e2es: list[float] = field(default_factory=list)
    tokens: int = 0
    elapsed: float = 0.0
    cpu: float | None = 0.0  # the target's CPU seconds (None: the engine served directly)
    delivery: Delivery = field(default_factory=Delivery)

    def merge(self, other: LoadSample) -> None:
        """Adds another round."""
        self.ttfts += other.ttfts
        self.e2es += other.e2es
        self.tokens += other.tokens
        self.elapsed += other.elapsed
        self.cpu = None if self.cpu is None or other.cpu is None else self.cpu + other.cpu
        self.delivery.merge(other.delivery)


@dataclass
class LoadRun:
    """`streams` streams of long answers back to back, on one target, every round."""

    target: str
    streams: int
    requests: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    e2e_p50_ms: float
    tokens_per_s: float
    cpu_us_per_token: float | None  # the target's (None: the engine served directly)
    delivery: Delivery

    @classmethod
    def of(cls, target: str, streams: int, sample: LoadSample) -> LoadRun:
        """The summary of a target's rounds."""
        return cls(
            target=target,
            streams=streams,
            requests=len(sample.ttfts),
            ttft_p50_ms=percentile(sample.ttfts, 50) * 1e3,
            ttft_p99_ms=percentile(sample.ttfts, 99) * 1e3,
            e2e_p50_ms=percentile(sample.e2es, 50) * 1e3,
            tokens_per_s=sample.tokens / sample.elapsed,
            cpu_us_per_token=None if sample.cpu is None else sample.cpu / sample.tokens * 1e6,
            delivery=sample.delivery,
        )


async def measure_load(
    client: Client,
    prompt: Prompt,
    streams: int,
    per_stream: int,
    clock: TreeClock,
    staggered: bool = False,
) -> LoadSample:
    """TTFT, E2E, tokens and time of `per_stream` answers on each of `streams` streams,
    from the moment each stream has done one unmeasured request. The streams start
    together (a burst of `streams` requests at once, then as their answers end), or
    `staggered`: stream i waits i/`streams` of its unmeasured request's time first, so
    each request starts among the others' running answers."""
    await client.open(streams)
    tally = Tally()
    sample = LoadSample()
    ready = asyncio.Barrier(streams + 1)

    async def stream(index: int) -> None:
        warm = await client.request(prompt, tally)
        await ready.wait()
        if staggered:
            await asyncio.sleep(warm.latency * index / streams)
        for _ in range(per_stream):
            result = await client.request(prompt, tally)
            assert result.ttft is not None
            sample.ttfts.append(result.ttft)
            sample.e2es.append(result.latency)
            sample.delivery.add(prompt, result)

    tasks = [asyncio.create_task(stream(index)) for index in range(streams)]
    try:
        await ready.wait()
        before, t0 = clock.read(), time.perf_counter()
        await asyncio.gather(*tasks)
        sample.elapsed, after = time.perf_counter() - t0, clock.read()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
        await clock.settle()
    sample.tokens = prompt.words * len(sample.ttfts)
    sample.cpu = cpu_used(before, after).get("gateway")
    return sample


@dataclass
class HttpResults:
    """The HTTP-mode figures of every target that ran."""

    ttft: dict[str, LatencyRun] = field(default_factory=dict)
    load: dict[str, LoadRun] = field(default_factory=dict)
    staggered: dict[str, LoadRun] = field(default_factory=dict)  # starts among running answers
    prefill: dict[str, LoadRun] = field(default_factory=dict)  # the engine's PREFILL_MS first


def with_first_token_wait(prompt: Prompt, ms: int) -> Prompt:
    """`prompt` asking the fake engine to wait `ms` before its first token (its `user`)."""
    body = orjson.loads(prompt.http_body)
    body["user"] = f"first-token-ms={ms}"
    return replace(prompt, http_body=orjson.dumps(body))


async def measure_http(setup: Setup, settings: PeerSettings) -> HttpResults:
    """Every serving target: TTFT at 1 stream (taking turns), then the 32-stream load.
    A target whose request fails is marked failed and measured no further."""
    rng = random.Random(11)
    short = make_prompt(ENGINE_MODEL, settings.short_words, rng)
    long = make_prompt(ENGINE_MODEL, settings.long_words, rng)
    serving = [t for t in setup.targets if t.missing is None]
    clients = {t.name: TargetClient(t.name, t.port) for t in serving}
    clocks = {t.name: TreeClock(t.pid, setup.engine_pid) for t in serving}
    results = HttpResults()
    sequential = {t.name: Timings() for t in serving}

    async def guarded(target: Target, measure: Coroutine[Any, Any, T]) -> T | None:
        try:
            return await measure
        except (BenchError, AssertionError) as error:
            target.missing = f"failed during the run: {error}"[:200]
            await clients[target.name].close()
            return None

    for _ in range(settings.ttft_blocks):
        for target in [t for t in serving if t.missing is None]:
            measure = measure_ttft(clients[target.name], short, 1, 50, clocks[target.name])
            if (block := await guarded(target, measure)) is not None:
                sequential[target.name].merge(block)
    for target in [t for t in serving if t.missing is None]:
        await clients[target.name].close()
        results.ttft[target.name] = LatencyRun.of(target.name, 1, sequential[target.name])
    _progress("HTTP mode, TTFT at 1 stream: done")
    # The load in rounds, the targets taking turns in each, so a slow patch of the
    # machine (other work on it) falls on all of them rather than on one.
    samples = {t.name: LoadSample() for t in serving}
    staggered = {t.name: LoadSample() for t in serving}
    prefill = {t.name: LoadSample() for t in serving}
    prefilled = with_first_token_wait(long, PREFILL_MS)
    loads = ((long, False, samples), (long, True, staggered), (prefilled, False, prefill))
    for round_ in range(settings.load_rounds):
        for target in [t for t in serving if t.missing is None]:
            name = target.name
            for prompt, stagger, into in loads:
                measure = measure_load(
                    clients[name],
                    prompt,
                    settings.streams,
                    settings.load_per_stream,
                    clocks[name],
                    stagger,
                )
                if (sample := await guarded(target, measure)) is not None:
                    into[name].merge(sample)
        _progress(
            f"HTTP mode, {settings.streams} streams x {settings.long_words}: round {round_ + 1}"
        )
    for target in serving:
        if target.missing is None:
            name = target.name
            results.load[name] = LoadRun.of(name, settings.streams, samples[name])
            results.staggered[name] = LoadRun.of(name, settings.streams, staggered[name])
            results.prefill[name] = LoadRun.of(name, settings.streams, prefill[name])
        else:
            results.ttft.pop(target.name, None)
    return results


# --- the gRPC path -----------------------------------------------------------------------


@dataclass
class GrpcResults:
    """The gateway against a raw grpc.aio client on the same workers."""

    ttft: dict[tuple[str, int], LatencyRun] = field(default_factory=dict)
    tokens_per_s: dict[str, float] = field(default_factory=dict)
    cpu_us_per_token: dict[str, float] = field(default_factory=dict)  # by gateway
    tokens_per_message: dict[str, float] = field(default_factory=dict)
    delivery: dict[str, Delivery] = field(default_factory=dict)
    kib_per_stream: dict[str, float] = field(default_factory=dict)  # by gateway
    memory_kib: dict[str, tuple[int, int]] = field(default_factory=dict)  # by gateway


async def measure_grpc(setup: Setup, settings: PeerSettings) -> GrpcResults:
    """Each gateway of the gRPC path (workers multiplexed, and a call per request)
    against a raw client: TTFT at 1 and 32 streams, tokens/s at 32 streams
    (1 token per event), and the memory of open streams."""
    s = settings.grpc
    clocks = {
        name: TreeClock(pid, setup.workers_pid) for name, (_, pid) in setup.grpc_gateways.items()
    }
    results = GrpcResults()
    for name, (port, pid) in setup.grpc_gateways.items():
        memory = await measure_memory(port, pid, s.memory_streams, clocks[name])
        results.kib_per_stream[name] = memory.kib_per_stream
        results.memory_kib[name] = (memory.before_kib, memory.during_kib)
    _progress(f"gRPC path, memory of {s.memory_streams} open streams: done")

    rng = random.Random(7)
    raw_clock = TreeClock(None, setup.workers_pid)
    gateways = [TargetClient(name, port) for name, (port, _) in setup.grpc_gateways.items()]
    coalesced = setup.worker_ports[COALESCED]
    clients: list[Client] = [*gateways, GrpcClient(coalesced), GrpcMultiplexClient(coalesced)]
    clock_of = {c.name: clocks.get(c.name, raw_clock) for c in clients}
    short = make_prompt(COALESCED, settings.short_words, rng)
    sequential = {c.name: Timings() for c in clients}
    for _ in range(max(1, s.ttft_requests // 50)):
        for client in clients:
            sequential[client.name].merge(
                await measure_ttft(client, short, 1, 50, clock_of[client.name])
            )
    for name, timings in sequential.items():
        results.ttft[name, 1] = LatencyRun.of(name, 1, timings)
        results.delivery[name] = Delivery()
        results.delivery[name].merge(timings.delivery)
    for client in clients:
        await client.close()
        clock = clock_of[client.name]
        timings = await measure_ttft(client, short, s.streams, s.ttft_per_stream, clock)
        results.ttft[client.name, s.streams] = LatencyRun.of(client.name, s.streams, timings)
        results.delivery[client.name].merge(timings.delivery)
        await client.close()
    _progress("gRPC path, TTFT at 1 and 32 streams: done")

    echo = ECHO[1]
    prompts = [make_prompt(echo, rng.randint(s.min_words, s.max_words), rng) for _ in range(24)]
    echo_port = setup.worker_ports[echo]
    for client in [*gateways, GrpcClient(echo_port), GrpcMultiplexClient(echo_port)]:
        clock = clock_of[client.name]
        run = await measure_flow(client, prompts, "1 token/message", s.streams, s, clock)
        results.tokens_per_s[client.name] = run.tokens_per_s
        results.tokens_per_message[client.name] = run.tokens_per_message
        results.delivery[client.name].merge(run.delivery)
        if client.name in clocks:
            cpu = run.cpu_us_per_token.get("gateway", float("nan"))
            results.cpu_us_per_token[client.name] = cpu
    _progress("gRPC path, tokens/s at 32 streams: done")
    return results


# --- the report --------------------------------------------------------------------------


@dataclass
class Report:
    """Everything one run measured, and where."""

    environment: dict[str, Any]
    targets: list[Target]
    http: HttpResults
    grpc: GrpcResults

    def delivered_ok(self) -> bool:
        """Every finished request of every path whole."""
        http = self.http
        runs = [
            *http.ttft.values(),
            *http.load.values(),
            *http.staggered.values(),
            *http.prefill.values(),
        ]
        deliveries = [run.delivery for run in runs]
        return all(d.ok for d in [*deliveries, *self.grpc.delivery.values()])


def _ms(value: float) -> str:
    return f"{value:.2f} ms"


def _times(run: LoadRun, direct: LoadRun | None) -> str:
    """A run's TTFT p50 as a multiple of the engine's served directly."""
    return "-" if direct is None else f"{run.ttft_p50_ms / direct.ttft_p50_ms:.1f}x"


def http_table(report: Report) -> str:
    """Issue 14's side-by-side table, this run's figures."""
    http = report.http
    direct_ttft = http.ttft[DIRECT].p50_ms if DIRECT in http.ttft else None
    direct_load = http.load.get(DIRECT)
    direct_staggered = http.staggered.get(DIRECT)
    direct_prefill = http.prefill.get(DIRECT)
    header = [
        "gateway (HTTP upstream mode)",
        "TTFT p50, 1 stream",
        "added TTFT p50, 1 stream",
        "CPU per request, 1 stream",
        "tokens/s, 32 streams",
        "/ direct",
        "TTFT p50, 32 streams",
        "/ direct's",
        "TTFT p50, 32 staggered",
        "/ direct's",
        f"TTFT p50, 32 streams, {PREFILL_MS} ms prefill",
        "/ direct's",
        "E2E p50, 32 streams",
        "CPU per token",
        "delivered / emitted",
    ]
    rows: list[list[str]] = []
    for target in report.targets:
        label = target.name + (f" {target.version}" if target.version else "")
        if target.missing is not None:
            rows.append([label, f"not measured: {target.missing}", *[""] * (len(header) - 2)])
            continue
        ttft, load = http.ttft[target.name], http.load[target.name]
        staggered, prefill = http.staggered[target.name], http.prefill[target.name]
        direct = target.name == DIRECT
        added = "-" if direct or direct_ttft is None else f"{ttft.p50_ms - direct_ttft:+.2f} ms"
        ratio = (
            "-"
            if direct or direct_load is None
            else f"{load.tokens_per_s / direct_load.tokens_per_s:.2f}"
        )

        delivery = Delivery()
        for run in (ttft, load, staggered, prefill):
            delivery.merge(run.delivery)
        cpu = "-" if load.cpu_us_per_token is None else f"{load.cpu_us_per_token:.1f} µs"
        rows.append(
            [
                label,
                _ms(ttft.p50_ms),
                added,
                _request_cpu(ttft, direct),
                f"{load.tokens_per_s:,.0f}",
                ratio,
                _ms(load.ttft_p50_ms),
                "-" if direct else _times(load, direct_load),
                _ms(staggered.ttft_p50_ms),
                "-" if direct else _times(staggered, direct_staggered),
                _ms(prefill.ttft_p50_ms),
                "-" if direct else _times(prefill, direct_prefill),
                _ms(load.e2e_p50_ms),
                cpu,
                _delivered(delivery),
            ]
        )
    return _table(header, rows)


def _request_cpu(run: LatencyRun, direct: bool) -> str:
    """A target's CPU per request at 1 stream; the engine's own in the direct row."""
    cpu = run.cpu_us_per_request.get("worker" if direct else "gateway")
    if cpu is None:
        return "-"
    return f"{cpu:.0f} µs" + (" (engine)" if direct else "")


def _delivered(delivery: Delivery) -> str:
    if not delivery.requests:
        return "none finished"
    ratio = delivery.counted / delivery.emitted if delivery.emitted else 0.0
    return f"{ratio:.4f}" + ("" if delivery.ok else f" ({delivery.wrong} wrong)")


#: Issue 14's figures to reach: (measure, the bar, the aim).
def goals_table(report: Report) -> str:
    """The issue's figures to reach, with this run's value."""
    http, grpc = report.http, report.grpc
    rows: list[list[str]] = []

    def add(measure: str, value: str, bar: str, aim: str) -> None:
        rows.append([measure, value, bar, aim])

    if FURNACE in http.ttft and DIRECT in http.ttft:
        added = http.ttft[FURNACE].p50_ms - http.ttft[DIRECT].p50_ms
        add("HTTP mode: added TTFT p50, 1 stream", f"{added:+.2f} ms", "≤ +0.5 ms", "≤ +0.25 ms")
        f, d = http.load[FURNACE], http.load[DIRECT]
        add(
            "HTTP mode: tokens/s at 32 streams / direct",
            f"{f.tokens_per_s / d.tokens_per_s:.2f}",
            "≥ 0.65",
            "≥ 0.85",
        )
        add(
            "HTTP mode: TTFT p50 at 32 streams / direct's",
            _times(f, d),
            "≤ 2x",
            "≤ 1.3x",
        )
        f, d = http.staggered[FURNACE], http.staggered[DIRECT]
        add(
            "HTTP mode: TTFT p50 at 32 staggered streams / direct's (not an issue row)",
            _times(f, d),
            "-",
            "-",
        )
        f, d = http.prefill[FURNACE], http.prefill[DIRECT]
        add(
            f"HTTP mode: TTFT p50 at 32 streams, {PREFILL_MS} ms prefill / direct's "
            "(not an issue row)",
            _times(f, d),
            "-",
            "-",
        )
    streams = DEFAULT.streams
    if grpc.tokens_per_s:

        def both(figure: Callable[[str], float], unit: str) -> str:
            """The multiplexed gateway's figure (the call-per-request one's)."""
            return f"{figure(FURNACE):{unit}} ({figure(PER_CALL):{unit}})"

        add(
            "gRPC: tokens/s at 32 streams, 1 token/message / raw client",
            both(lambda g: grpc.tokens_per_s[g] / grpc.tokens_per_s[RAW], ".2f"),
            "≥ 0.85",
            "≥ 0.95",
        )
        raw_ttft = grpc.ttft[RAW, streams].p50_ms
        add(
            "gRPC: added TTFT p50 at 32 streams (ms)",
            both(lambda g: grpc.ttft[g, streams].p50_ms - raw_ttft, "+.2f"),
            "≤ +2 ms",
            "≤ +0.5 ms",
        )
        same_call = grpc.tokens_per_s[FURNACE] / grpc.tokens_per_s[RAW_MUX]
        added_mux = grpc.ttft[FURNACE, streams].p50_ms - grpc.ttft[RAW_MUX, streams].p50_ms
        add(
            "gRPC, multiplexed: tokens/s / a raw client on the same kind of call",
            f"{same_call:.2f}",
            "-",
            "-",
        )
        over_it = f"{added_mux:+.2f} ms"
        add("gRPC, multiplexed: added TTFT p50 at 32 streams over it", over_it, "-", "-")
        add(
            "gateway CPU per request, 16-token answer (ms)",
            both(lambda g: grpc.ttft[g, 1].cpu_us_per_request.get("gateway", nan) / 1e3, ".2f"),
            "≤ 0.4 ms",
            "≤ 0.2 ms",
        )
        add(
            "gateway CPU per token at 1 token/message (µs)",
            both(lambda g: grpc.cpu_us_per_token[g], ".1f"),
            "≤ 25 µs",
            "≤ 10 µs",
        )
        add(
            "RSS per open stream (KiB)",
            both(lambda g: grpc.kib_per_stream[g], ".1f"),
            "≤ 48 KiB",
            "≤ 32 KiB",
        )
    add("tokens delivered / emitted", "1" if report.delivered_ok() else "NOT 1", "1", "1")
    return _table(["measure", "this run", "bar", "aim"], rows)


def grpc_table(report: Report) -> str:
    """The gRPC path's own figures."""
    grpc, rows = report.grpc, []
    for (name, streams), run in sorted(grpc.ttft.items(), key=lambda kv: kv[0][1]):
        cpu = run.cpu_us_per_request.get("gateway")
        cells = [_ms(run.p50_ms), _ms(run.p99_ms), f"{run.requests_per_s:,.0f} req/s"]
        cells.append("-" if cpu is None or name in (RAW, RAW_MUX) else f"{cpu:.0f} µs/request")
        rows.append([f"TTFT, {streams} stream{'s' * (streams > 1)}, 16 tokens", name, *cells])
    for name, rate in grpc.tokens_per_s.items():
        per = f"{grpc.tokens_per_message[name]:.2f} tokens/message"
        token_cpu = grpc.cpu_us_per_token.get(name)
        cpu = "-" if token_cpu is None else f"{token_cpu:.1f} µs/token"
        rows.append(
            ["tokens/s, 32 streams, 1 token/message", name, f"{rate:,.0f} tokens/s", per, "", cpu]
        )
    header = ["run", "path", "p50 or rate", "p99 or size", "rate", "gateway CPU"]
    return _table(header, rows)


def render(report: Report) -> str:
    """The markdown report."""
    env = report.environment
    before, during = report.grpc.memory_kib.get(FURNACE, (0, 0))
    notes = (
        f"{commit_label(env['commit'])}; {env['cpus']} CPUs "
        "shared by the engine, the workers, the routers, the gateways and the client; Python "
        f"{env['python']}. The gRPC path, CPU and memory: the one-process gateway.\n"
        "TTFT: from writing the request to the first content; CPU per token: the router's "
        "(the gateway's) CPU seconds from /proc over the 32-stream run's tokens; delivered / "
        "emitted: the words of the deltas over the words the engine echoed, every finished "
        "request also checked for its text and usage.\n"
        f"memory: the gateway's VmRSS {before:,} → {during:,} KiB while "
        f"{env['memory_streams']:,} streams wait on a worker."
    )
    return (
        f"HTTP upstream mode, the same fake OpenAI engine (one SSE event per token)\n\n"
        f"{http_table(report)}\n\nThe gRPC path: furnace-gateway against a raw grpc.aio client\n\n"
        f"{grpc_table(report)}\n\nIssue 14's figures to reach\n\n{goals_table(report)}\n\n{notes}"
    )


# --- the command -------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="furnace-gateway side by side with vllm-router and smg, and its gRPC path."
    )
    parser.add_argument("--quick", action="store_true", help="a shorter run (~30 s)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    parser.add_argument(
        "--processes",
        type=int,
        default=2,
        metavar="N",
        help="also measure the gateway as N processes (serve --workers N) in HTTP mode; "
        "0 or 1: not",
    )
    parser.add_argument(
        "--peers-venv", type=Path, default=PEERS_VENV, help="the routers' virtualenv"
    )
    parser.add_argument("--no-peers", action="store_true", help="measure without the routers")
    return parser


async def run_bench(setup: Setup, settings: PeerSettings) -> tuple[HttpResults, GrpcResults]:
    """HTTP mode, then the gRPC path."""
    http = await measure_http(setup, settings)
    grpc = await measure_grpc(setup, settings)
    return http, grpc


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark; 1 if a token was lost, or the engine or the gateway failed."""
    args = _parser().parse_args(argv)
    settings = QUICK if args.quick else DEFAULT
    started = time.monotonic()
    _progress("starting the engine, the workers, the gateway and the routers")
    with start_all(args.peers_venv, args.processes, args.no_peers) as setup:
        http, grpc = uvloop.run(run_bench(setup, settings))
    environment = {
        "commit": _commit(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "processes": args.processes,
        "memory_streams": settings.grpc.memory_streams,
    }
    report = Report(environment, setup.targets, http, grpc)
    print(render(report))
    print(f"\n(run took {time.monotonic() - started:.0f} s)")
    if args.json:
        data = asdict(report)
        data["grpc"]["ttft"] = {f"{k[0]} x{k[1]}": v for k, v in data["grpc"]["ttft"].items()}
        Path(args.json).write_text(orjson.dumps(data, option=orjson.OPT_INDENT_2).decode())
    ours_failed = any(
        t.missing is not None and t.name not in PEERS for t in setup.targets
    )  # the engine itself, or the gateway, failed a request
    return 0 if report.delivered_ok() and not ours_failed else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
