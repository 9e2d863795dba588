"""Benchmark: what the gateway adds on top of calling the worker directly.

One run measures the same work two ways: through the gateway (HTTP streaming POST
/v1/chat/completions) and with a raw grpc.aio client calling the same worker's Generate
(the baseline: the best a gateway could do is add nothing), and checks the results
against the targets:

- time to first token (TTFT), p50 and p99, one request at a time and 32 at once, on
  the demo engine as shipped; the gateway's overhead is its percentile minus the raw
  client's (targets: p50 +1 ms, p99 +3 ms at most);
- streamed tokens per second, one stream and 32 streams, from an echo servicer
  without the SDK that sends 1 token per gRPC message (the mode where the per-message
  cost of every layer shows; target: 0.75 of the raw client's at least) or 8;
- the gateway's CPU seconds per thousand tokens streamed, in those runs;
- the gateway's memory per open stream: the growth of its resident set (VmRSS) while
  1,000 streams wait on a slow worker (a token every few seconds), over 1,000
  (target: 64 KiB at most);
- that nothing is lost: for every finished request, the tokens delivered (the words of
  the deltas, and `usage.completion_tokens`) equal the tokens the engine emitted.

Three processes share the machine, as on a small node: the workers (this script re-run
with `--worker-process`: one gRPC server per model, on one loop), the gateway (`python
-m gateway serve`, with uvloop and httptools as in production), and this process, the
load client (uvloop too). The client's CPU counts against both paths alike and is
printed. The HTTP client is the load generator's (`gateway.bench`: a small asyncio
protocol over httptools that parses SSE inside the transport's callback); httpx costs
several times more CPU per chunk, which on two cores would be measured as gateway
slowness (`--client httpx` compares).

Run: `python benchmarks/bench_gateway.py [--quick] [--json PATH] [--client raw|httpx]`
(`make bench`); about 60 s, or 20 s with --quick. Not collected by pytest: it lives
outside tests/.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import itertools
import math
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import grpc
import httpx
import orjson
import uvloop
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from gateway.bench.client import OpenAIClient, Recorder, Result, Tally
from gateway.bench.stats import percentile
from gateway.bench.workload import ENDPOINTS, VOCABULARY, WorkloadSpec, body
from gateway.protocol.convert import request_from_proto
from gateway.protocol.types import Finished, GenerateRequest, Text
from gateway.protocol.v1 import engine_pb2 as pb
from gateway.protocol.v1 import engine_pb2_grpc as pb_grpc
from gateway.upstreams.furnace_grpc import FurnaceGrpcUpstream
from gateway.worker import multiplex
from gateway.worker.demo import DEMO_MODEL, DemoEngine
from gateway.worker.server import WorkerServer

ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
# The workers, by the model name each is served as.
COALESCED = DEMO_MODEL  # the demo engine as shipped (every token ready at once): TTFT
ECHO = {1: "furnace-echo-1", 8: "furnace-echo-8"}  # no SDK: N tokens per gRPC message
SLOW = "furnace-slow"  # the demo engine at a token every few seconds: streams held open
MODES = {model: f"{n} token{'s' * (n > 1)}/message" for n, model in ECHO.items()}
SLOW_TOKEN_DELAY = 10.0  # seconds
MEMORY_STREAMS = 1000
CALL_TIMEOUT = 120.0  # seconds; a guard against hanging, never reached in a healthy run
STARTUP_TIMEOUT = 30.0
PATH = ENDPOINTS["chat"]


# --- settings -------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """How much of each measurement to do; the default run takes about 60 s."""

    ttft_requests: int  # sequential requests per path, at concurrency 1
    ttft_per_stream: int  # requests per stream, at concurrency `streams`
    warmup_s: float  # of each throughput run, not counted
    window_s: float  # of each throughput run, counted
    streams: int = 32
    ttft_words: int = 16  # a short answer: TTFT is about the path, not the length
    min_words: int = 500  # answers of the throughput runs
    max_words: int = 2000
    memory_streams: int = MEMORY_STREAMS


DEFAULT = Settings(ttft_requests=400, ttft_per_stream=40, warmup_s=1.0, window_s=4.0)
QUICK = Settings(ttft_requests=150, ttft_per_stream=10, warmup_s=0.3, window_s=1.0)


# --- the worker process ----------------------------------------------------------------


class EchoService(pb_grpc.EngineServicer):
    """An echo worker without the SDK: every `per_message` tokens are one `Text`, sent
    as soon as gRPC has sent the one before. No coalescing, at the worker's full
    speed: the mode where the per-message cost of every layer (gRPC, the gateway, SSE)
    shows."""

    def __init__(self, model: str, per_message: int) -> None:
        self.model = model
        self.per_message = per_message

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateEvent]:
        """Started, the words of the last message `per_message` at a time, Finished."""
        messages = request.chat.messages
        words = messages[-1].content.split() if messages else request.text.split()
        prompt_tokens = sum(len(m.content.split()) for m in messages) or len(words)
        yield pb.GenerateEvent(started=pb.Started(prompt_tokens=prompt_tokens))
        n = self.per_message
        for i in range(0, len(words), n):
            text = " ".join(words[i : i + n])
            text = text if i == 0 else " " + text
            yield pb.GenerateEvent(text=pb.Text(text=text, tokens=len(words[i : i + n])))
        finished = pb.Finished(reason=pb.FINISH_REASON_STOP, completion_tokens=len(words))
        yield pb.GenerateEvent(finished=finished)

    async def GenerateMultiplexed(
        self, requests: AsyncIterator[pb.MultiplexRequest], context: grpc.aio.ServicerContext
    ) -> None:
        """The same answers on one call, through the SDK's multiplexer (as a worker
        offers it), one message of each request a step of the worker's loop, as an
        engine steps: the requests stepped together share a gRPC message, one
        request's messages never do (so "N tokens/message" holds per request)."""

        async def stepped(start: pb.MultiplexStart) -> AsyncIterator[pb.GenerateEvent]:
            async for event in self.Generate(start.request, context):
                yield event
                await asyncio.sleep(0)

        await multiplex.serve(stepped, requests, context)  # type: ignore[arg-type]

    async def Describe(
        self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> pb.DescribeResponse:
        """The model, as the SDK would describe it."""
        return pb.DescribeResponse(
            models=[pb.ModelInfo(name=self.model, max_context=4096)], capacity=256, multiplex=True
        )


async def serve_echo(model: str, per_message: int, port: int) -> grpc.aio.Server:
    """`EchoService` with the standard health service, as a worker serves it."""
    server = grpc.aio.server()
    pb_grpc.add_EngineServicer_to_server(EchoService(model, per_message), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"{HOST}:{port}")
    await server.start()
    for name in ("", "furnace.engine.v1.Engine"):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server


async def serve_workers(ports: dict[str, int]) -> None:
    """A worker for each model, all on one loop (only one is busy at a time), until
    the process is terminated."""
    sdk_workers = [
        WorkerServer(DemoEngine(COALESCED), HOST, ports[COALESCED]),
        WorkerServer(
            DemoEngine(SLOW, token_delay=SLOW_TOKEN_DELAY, capacity=4 * MEMORY_STREAMS),
            HOST,
            ports[SLOW],
        ),
    ]
    for worker in sdk_workers:
        await worker.start()
    servers = [await serve_echo(model, n, ports[model]) for n, model in ECHO.items()]
    # What the start built, out of the cyclic collector's reach, as a served worker's is
    # (gateway.worker.serve): unfrozen, a full collection of this process took 22 ms in
    # the middle of the 32-stream TTFT run, every request on the worker waiting on it.
    gc.freeze()
    await servers[0].wait_for_termination()  # SIGTERM ends the process; nothing to save


# --- the gateway and worker processes --------------------------------------------------


def _die_with_parent() -> None:
    """In a child: ask Linux to SIGTERM us when the bench dies, even by SIGKILL."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def free_ports(count: int) -> list[int]:
    """Ports free right now on loopback (all held at once, so they differ)."""
    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for sock in sockets:
            sock.bind((HOST, 0))
        return [sock.getsockname()[1] for sock in sockets]


def _wait_until(check: Callable[[], bool], what: str, process: subprocess.Popen[bytes]) -> None:
    end = time.monotonic() + STARTUP_TIMEOUT
    while not check():
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with status {process.returncode} while starting")
        if time.monotonic() > end:
            raise RuntimeError(f"{what} did not start within {STARTUP_TIMEOUT:g} s")
        time.sleep(0.05)


def _port_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex((HOST, port)) == 0


def _gateway_ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}/ready", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


@dataclass
class Servers:
    """The worker and gateway processes under test, and where they listen."""

    worker: subprocess.Popen[bytes]
    gateway: subprocess.Popen[bytes]
    worker_ports: dict[str, int]
    gateway_port: int


def _spawn(args: Sequence[str], python: str = sys.executable) -> subprocess.Popen[bytes]:
    preexec = _die_with_parent if sys.platform == "linux" else None
    return subprocess.Popen([python, *args], cwd=ROOT, preexec_fn=preexec)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it lingers (a graceful shutdown may wait on streams)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def start_servers() -> Iterator[Servers]:
    """Starts the workers, then the gateway pointing at them; stops both on any exit."""
    models = [COALESCED, *ECHO.values(), SLOW]
    *worker_ports, gateway_port = free_ports(len(models) + 1)
    ports = dict(zip(models, worker_ports, strict=True))
    with contextlib.ExitStack() as stack:
        worker = _spawn(
            [__file__, "--worker-process", ",".join(f"{m}={p}" for m, p in ports.items())]
        )
        stack.callback(_stop, worker)
        _wait_until(lambda: all(map(_port_open, ports.values())), "the worker", worker)

        config_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="furnace-bench-"))
        config_path = Path(config_dir) / "gateway.yaml"
        config = {
            "host": HOST,
            "port": gateway_port,
            "log_level": "warning",
            "max_concurrent_requests": 2 * MEMORY_STREAMS,  # the memory run holds 1,000
            "models": [{"name": m, "workers": [f"{HOST}:{p}"]} for m, p in ports.items()],
        }
        config_path.write_text(yaml.safe_dump(config))
        gateway = _spawn(["-m", "gateway", "serve", "--config", str(config_path)])
        stack.callback(_stop, gateway)  # runs before the worker's: the gateway goes first
        _wait_until(lambda: _gateway_ready(gateway_port), "the gateway", gateway)
        yield Servers(worker, gateway, ports, gateway_port)


# --- CPU and memory accounting ---------------------------------------------------------


def process_cpu(pid: int) -> float | None:
    """CPU seconds a process has used, all its threads, at nanosecond resolution
    (/proc/PID/task/*/schedstat); None where /proc does not tell."""
    try:
        tasks = list(os.scandir(f"/proc/{pid}/task"))
    except OSError:
        return None
    total = 0
    for task in tasks:
        try:
            with open(f"{task.path}/schedstat") as stat:
                total += int(stat.read().split()[0])
        except FileNotFoundError:
            continue  # a thread that ended meanwhile (its time is lost: microseconds)
        except (OSError, ValueError, IndexError):
            return None
    return total / 1e9


def machine_busy() -> float | None:
    """CPU seconds the whole machine has been busy (/proc/stat), None where unknown."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[1:9])
    except (OSError, ValueError):
        return None
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def resident_kib(pid: int) -> int | None:
    """A process's resident set in KiB (VmRSS of /proc/PID/status), None where unknown."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


OURS = ("gateway", "worker", "client")


@dataclass
class CpuClock:
    """CPU seconds of the gateway, the worker, this client and the whole machine (to
    see what other processes took from the measurement), read together."""

    gateway_pid: int
    worker_pid: int

    def read(self) -> dict[str, float | None]:
        """The counters now."""
        return {
            "gateway": process_cpu(self.gateway_pid),
            "worker": process_cpu(self.worker_pid),
            "client": time.process_time(),
            "machine": machine_busy(),
        }

    async def settle(self, limit: float = 5.0) -> None:
        """Waits until the servers are idle (cancelled streams wound down), so one
        measurement's tail does not eat into the next one's CPU."""
        end = time.monotonic() + limit
        before = self.read()
        while time.monotonic() < end:
            await asyncio.sleep(0.1)
            now = self.read()
            busy = sum((now[k] or 0.0) - (before[k] or 0.0) for k in ("gateway", "worker"))
            if busy < 0.005:  # under 5 % of a core
                return
            before = now


def cpu_used(before: dict[str, float | None], after: dict[str, float | None]) -> dict[str, float]:
    """CPU seconds used between two readings (where both are known)."""
    return {
        k: after[k] - before[k]  # type: ignore[operator]
        for k in before
        if before[k] is not None and after[k] is not None
    }


def per_unit(cpu: dict[str, float], units: int) -> dict[str, float]:
    """Our processes' CPU in microseconds per request or per token."""
    return {k: cpu[k] / units * 1e6 for k in OURS if k in cpu} if units else {}


def other_load(cpu: dict[str, float], elapsed: float) -> float | None:
    """Cores that other processes of the machine kept busy meanwhile: noise, if not 0."""
    if "machine" not in cpu or not all(k in cpu for k in OURS):
        return None
    return max(0.0, cpu["machine"] - sum(cpu[k] for k in OURS)) / elapsed


# --- the requests ----------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    """One request, encoded once for both paths, and what its answer must be."""

    model: str
    text: str
    words: int
    http_body: bytes
    grpc_request: pb.GenerateRequest


def make_prompt(model: str, words: int, rng: random.Random) -> Prompt:
    """A chat request whose last message has `words` words (the demo echoes them all:
    max_tokens is the word count)."""
    text = " ".join(rng.choice(VOCABULARY) for _ in range(words))
    http_body = body(WorkloadSpec(model=model, endpoint="chat"), text, max_tokens=words)
    request = pb.GenerateRequest(
        request_id="bench",
        model=model,
        chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="user", content=text)]),
        sampling=pb.SamplingParams(max_tokens=words),
    )
    return Prompt(model, text, words, http_body, request)


def words_in(text: str) -> int:
    """The demo's tokens are words."""
    return len(text.split())


class BenchError(RuntimeError):
    """A request failed: the bench measures only healthy runs."""


def checked(result: Result) -> Result:
    """`result`, if it succeeded."""
    if not result.ok or result.ttft is None:
        raise BenchError(f"a request failed: {result.error or 'no content'}")
    return result


# --- the three clients -----------------------------------------------------------------


class Client(Protocol):
    """One way to run a request: through the gateway, or straight to the worker."""

    name: str

    async def open(self, streams: int) -> None:
        """Prepares `streams` concurrent streams (connections, channels)."""

    async def request(self, prompt: Prompt, tally: Tally) -> Result:
        """Runs one request to its end; raises `BenchError` if it fails."""

    async def close(self) -> None:
        """Releases everything."""


class GatewayClient:
    """The gateway, through the load generator's client: a kept-alive connection per
    stream, responses parsed as they arrive."""

    name = "gateway"

    def __init__(self, port: int) -> None:
        self.url = f"http://{HOST}:{port}/v1"
        self._client: OpenAIClient | None = None

    async def open(self, streams: int) -> None:
        if self._client is None:
            self._client = OpenAIClient(self.url, timeout=CALL_TIMEOUT)

    async def request(self, prompt: Prompt, tally: Tally) -> Result:
        assert self._client is not None
        recorder = Recorder(stream=True, tally=tally, tokens_in=words_in)
        return checked(await self._client.post(PATH, prompt.http_body, recorder))

    async def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


class HttpxGatewayClient:
    """The gateway, through one httpx.AsyncClient with a pool for every stream."""

    name = "gateway"

    def __init__(self, port: int) -> None:
        self.url = f"http://{HOST}:{port}/v1{PATH}"
        self._client: httpx.AsyncClient | None = None

    async def open(self, streams: int) -> None:
        if self._client is None:
            limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams)
            self._client = httpx.AsyncClient(limits=limits, timeout=CALL_TIMEOUT)

    async def request(self, prompt: Prompt, tally: Tally) -> Result:
        assert self._client is not None
        recorder = Recorder(stream=True, tally=tally, tokens_in=words_in)
        headers = {"content-type": "application/json"}
        recorder.sent = time.perf_counter()
        async with self._client.stream(
            "POST", self.url, content=prompt.http_body, headers=headers
        ) as response:
            recorder.start(response.status_code)
            async for data in response.aiter_raw():
                recorder.feed(data)
        return checked(recorder.result())

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


class _Answer:
    """One answer as a raw client reads it: its text pieces, timing and counts."""

    def __init__(self, tally: Tally) -> None:
        self.tally = tally
        self.sent = self.last = time.perf_counter()
        self.first: float | None = None
        self.itl: list[float] = []
        self.messages = self.tokens = 0
        self.reported: int | None = None
        self.pieces: list[str] = []

    def text(self, text: str, tokens: int) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.itl.append(now - self.last)
        self.last = now
        self.messages += 1
        self.tokens += tokens
        self.tally.chunks += 1
        self.tally.tokens += tokens
        self.pieces.append(text)

    def result(self) -> Result:
        self.tally.done += 1
        ttft = None if self.first is None else self.first - self.sent
        text = "".join(self.pieces)
        end = time.perf_counter()
        counts = (self.messages, self.tokens, None, self.reported)
        return checked(Result(self.sent, end, ttft, self.itl, *counts, text))


class GrpcClient:
    """The worker itself, through one grpc.aio channel (as the gateway holds one)
    read with `call.read()` (as the gateway reads it): the baseline."""

    name = "raw gRPC"

    def __init__(self, port: int) -> None:
        self.address = f"{HOST}:{port}"
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.EngineStub | None = None

    async def open(self, streams: int) -> None:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(self.address)
            await asyncio.wait_for(self._channel.channel_ready(), STARTUP_TIMEOUT)
            self._stub = pb_grpc.EngineStub(self._channel)

    async def request(self, prompt: Prompt, tally: Tally) -> Result:
        assert self._stub is not None
        answer = _Answer(tally)
        call = self._stub.Generate(prompt.grpc_request, timeout=CALL_TIMEOUT)
        try:
            while (message := await call.read()) is not grpc.aio.EOF:
                kind = message.WhichOneof("event")
                if kind == "text":
                    answer.text(message.text.text, message.text.tokens)
                elif kind == "finished":
                    answer.reported = message.finished.completion_tokens
        except BaseException:
            call.cancel()
            raise
        return answer.result()

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None


class GrpcMultiplexClient:
    """The worker itself on one GenerateMultiplexed call, through the gateway's own
    upstream (`FurnaceGrpcUpstream`, nothing of the gateway above it): the baseline of
    the multiplexed path, as `GrpcClient` is of a call per request."""

    name = "raw gRPC, multiplexed"

    def __init__(self, port: int) -> None:
        self.address = f"{HOST}:{port}"
        self._upstream: FurnaceGrpcUpstream | None = None
        self._requests: dict[int, GenerateRequest] = {}  # by id(prompt)

    async def open(self, streams: int) -> None:
        if self._upstream is None:
            self._upstream = FurnaceGrpcUpstream(self.address)
            await self._upstream.describe(STARTUP_TIMEOUT)  # it offers the call

    async def request(self, prompt: Prompt, tally: Tally) -> Result:
        assert self._upstream is not None
        request = self._requests.get(id(prompt))
        if request is None:
            request = self._requests[id(prompt)] = request_from_proto(prompt.grpc_request)
        answer = _Answer(tally)
        call = self._upstream.call(request, CALL_TIMEOUT)
        try:
            async for event in call:
                if type(event) is Text:
                    answer.text(event.text, event.tokens)
                elif type(event) is Finished:
                    answer.reported = event.completion_tokens
        except BaseException:
            call.cancel()
            raise
        return answer.result()

    async def close(self) -> None:
        if self._upstream is not None:
            await self._upstream.close()
            self._upstream = None


# --- checks and statistics -------------------------------------------------------------


@dataclass
class Delivery:
    """Delivered against emitted, over every finished request of a run."""

    requests: int = 0
    emitted: int = 0  # tokens the engine emitted (the demo echoes every word)
    reported: int = 0  # usage.completion_tokens, or Finished.completion_tokens
    counted: int = 0  # words of the deltas, or the sum of Text.tokens
    wrong: int = 0  # requests whose text or counts differ from what was emitted

    def add(self, prompt: Prompt, result: Result) -> None:
        """Checks one finished request."""
        self.requests += 1
        self.emitted += prompt.words
        reported = -1 if result.completion_tokens is None else result.completion_tokens
        self.reported += reported
        self.counted += result.counted
        whole = result.counted == reported == prompt.words
        if not (whole and result.text == prompt.text):
            self.wrong += 1

    def merge(self, other: Delivery) -> None:
        """Adds another run's requests."""
        self.requests += other.requests
        self.emitted += other.emitted
        self.reported += other.reported
        self.counted += other.counted
        self.wrong += other.wrong

    @property
    def ok(self) -> bool:
        """Every finished request whole: delivered == emitted."""
        return self.wrong == 0

    def verdict(self) -> str:
        """For the report."""
        if not self.requests:
            return "none finished"
        counts = f"{self.counted}/{self.reported}/{self.emitted} tokens"
        return (
            f"{self.requests}: "
            + ("yes" if self.ok else f"NO ({self.wrong} wrong)")
            + f", {counts}"
        )


@dataclass
class Timings:
    """Raw TTFTs of one path at one concurrency, with the time and CPU they took."""

    ttfts: list[float] = field(default_factory=list)
    elapsed: float = 0.0
    cpu: dict[str, float] = field(default_factory=dict)
    delivery: Delivery = field(default_factory=Delivery)

    def merge(self, other: Timings) -> None:
        """Adds another block of the same measurement."""
        self.ttfts += other.ttfts
        self.elapsed += other.elapsed
        for name, seconds in other.cpu.items():
            self.cpu[name] = self.cpu.get(name, 0.0) + seconds
        self.delivery.merge(other.delivery)


@dataclass
class LatencyRun:
    """TTFT of one path at one concurrency, summarised."""

    path: str
    concurrency: int
    requests: int
    p50_ms: float
    p99_ms: float
    requests_per_s: float
    cpu_us_per_request: dict[str, float]
    other_load: float | None
    delivery: Delivery

    @classmethod
    def of(cls, path: str, concurrency: int, timings: Timings) -> LatencyRun:
        """The summary of `timings`."""
        count = len(timings.ttfts)
        return cls(
            path=path,
            concurrency=concurrency,
            requests=count,
            p50_ms=percentile(timings.ttfts, 50) * 1e3,
            p99_ms=percentile(timings.ttfts, 99) * 1e3,
            requests_per_s=count / timings.elapsed,
            cpu_us_per_request=per_unit(timings.cpu, count),
            other_load=other_load(timings.cpu, timings.elapsed),
            delivery=timings.delivery,
        )


@dataclass
class FlowRun:
    """Streamed tokens per second of one path, in one worker mode, at one concurrency."""

    path: str
    mode: str
    streams: int
    tokens_per_s: float
    tokens_per_message: float  # per gRPC Text (raw gRPC) or per SSE chunk (gateway)
    cpu_us_per_token: dict[str, float]
    other_load: float | None
    delivery: Delivery


@dataclass
class MemoryRun:
    """The gateway's resident set before and while `streams` streams are open."""

    streams: int
    before_kib: int
    during_kib: int

    @property
    def kib_per_stream(self) -> float:
        """The growth, per stream."""
        return (self.during_kib - self.before_kib) / self.streams


# --- the measurements ------------------------------------------------------------------


async def _watch(tasks: Sequence[asyncio.Task[Any]], seconds: float) -> None:
    """Sleeps `seconds`, but raises at once if one of `tasks` fails."""
    done, _ = await asyncio.wait(tasks, timeout=seconds, return_when=asyncio.FIRST_EXCEPTION)
    for task in done:
        task.result()


async def _cancel(tasks: Sequence[asyncio.Future[Any]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def measure_ttft(
    client: Client, prompt: Prompt, concurrency: int, per_stream: int, clock: CpuClock
) -> Timings:
    """TTFT of `per_stream` requests on each of `concurrency` streams, timed from the
    moment every stream has done a few unmeasured requests (connections, caches)."""
    await client.open(concurrency)
    tally = Tally()
    timings = Timings()
    warmup = max(3, per_stream // 10)
    ready = asyncio.Barrier(concurrency + 1)

    async def stream() -> None:
        for _ in range(warmup):
            await client.request(prompt, tally)
        await ready.wait()
        for _ in range(per_stream):
            result = await client.request(prompt, tally)
            assert result.ttft is not None
            timings.ttfts.append(result.ttft)
            timings.delivery.add(prompt, result)

    tasks = [asyncio.create_task(stream()) for _ in range(concurrency)]
    all_ready = asyncio.ensure_future(ready.wait())
    try:
        await asyncio.wait([all_ready, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            if task.done():
                task.result()  # a warm-up request failed: raise its error
        cpu_before, t0 = clock.read(), time.perf_counter()
        await asyncio.gather(*tasks)
        timings.elapsed = time.perf_counter() - t0
        timings.cpu = cpu_used(cpu_before, clock.read())
    finally:
        await _cancel([*tasks, all_ready])
    return timings


async def measure_flow(
    client: Client,
    prompts: Sequence[Prompt],
    mode: str,
    streams: int,
    settings: Settings,
    clock: CpuClock,
) -> FlowRun:
    """Tokens per second received over a window in steady state: `streams` streams run
    long answers back to back, and what arrives inside the window counts, whichever
    request it belongs to. The streams are then cut (the gateway and the worker see
    the client leave) and the servers left to go idle before the next run.

    Stream i opens with a shorter answer, (i + 1) / streams of an average one, so the
    streams do not start and finish in lockstep and some answers finish (and are
    checked) even where one answer takes longer than the window."""
    await client.open(streams)
    tally = Tally()
    delivery = Delivery()
    average = sum(p.words for p in prompts) // len(prompts)
    rng = random.Random(streams)
    openers = [
        make_prompt(prompts[0].model, max(1, average * (i + 1) // streams), rng)
        for i in range(streams)
    ]

    async def stream(index: int) -> None:
        rest = itertools.islice(itertools.cycle(prompts), index, None)
        for prompt in itertools.chain([openers[index]], rest):
            delivery.add(prompt, await client.request(prompt, tally))

    tasks = [asyncio.create_task(stream(i)) for i in range(streams)]
    try:
        await _watch(tasks, settings.warmup_s)
        before, cpu_before, t0 = replace(tally), clock.read(), time.perf_counter()
        await _watch(tasks, settings.window_s)
        after, cpu_after, t1 = replace(tally), clock.read(), time.perf_counter()
    finally:
        await _cancel(tasks)
        await client.close()
        await clock.settle()
    tokens = after.tokens - before.tokens
    messages = after.chunks - before.chunks
    cpu = cpu_used(cpu_before, cpu_after)
    return FlowRun(
        path=client.name,
        mode=mode,
        streams=streams,
        tokens_per_s=tokens / (t1 - t0),
        tokens_per_message=tokens / messages if messages else 0.0,
        cpu_us_per_token=per_unit(cpu, tokens),
        other_load=other_load(cpu, t1 - t0),
        delivery=delivery,
    )


@contextlib.asynccontextmanager
async def open_streams(client: OpenAIClient, prompt: Prompt, count: int) -> AsyncIterator[None]:
    """`count` streams, open once each has its status (the gateway sends it with the
    worker's first event) until the block ends; then they are dropped."""
    recorders = [Recorder(stream=True) for _ in range(count)]
    tasks = [asyncio.create_task(client.post(PATH, prompt.http_body, r)) for r in recorders]
    try:
        end = time.monotonic() + STARTUP_TIMEOUT
        while not all(r.status for r in recorders):
            if any(task.done() for task in tasks) or time.monotonic() > end:
                failed = [task.result().error for task in tasks if task.done()]
                raise BenchError(f"streams did not all open: {failed[:3]}")
            await asyncio.sleep(0.05)
        if any(r.status != 200 for r in recorders):
            raise BenchError(f"streams refused: {sorted({r.status for r in recorders})}")
        yield
    finally:
        await _cancel(tasks)
        client.close()


async def measure_memory(port: int, pid: int, streams: int, clock: CpuClock) -> MemoryRun:
    """The gateway's resident set before and while `streams` streams wait on the slow
    worker. A few streams are opened and dropped first, so code and caches that the
    first requests load do not count as per-stream memory."""
    client = OpenAIClient(f"http://{HOST}:{port}/v1", timeout=CALL_TIMEOUT)
    prompt = make_prompt(SLOW, 4, random.Random(1))
    async with open_streams(client, prompt, 32):
        pass
    await clock.settle()
    await asyncio.sleep(0.5)
    before = resident_kib(pid)
    async with open_streams(client, prompt, streams):
        await asyncio.sleep(0.5)  # whatever the gateway does after the status, done
        during = resident_kib(pid)
    await clock.settle()
    if before is None or during is None:
        raise BenchError("/proc does not tell the gateway's resident set")
    return MemoryRun(streams, before, during)


# --- a run -----------------------------------------------------------------------------


@dataclass
class Results:
    """Everything one run measured."""

    settings: dict[str, Any]
    environment: dict[str, Any]
    latency: list[LatencyRun] = field(default_factory=list)
    flow: list[FlowRun] = field(default_factory=list)
    memory: MemoryRun | None = None


def _commit() -> str:
    """The checkout's commit (with a + if it has changes), to tell runs apart."""
    try:
        git = ["git", "-C", str(ROOT)]
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True)
        dirty = subprocess.run([*git, "diff", "--quiet", "HEAD", "--", "gateway"]).returncode
    except OSError:
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.decode().strip() + ("+" if dirty == 1 else "")


def commit_label(commit: str) -> str:
    """How a report names the commit it ran (`_commit`'s), saying what a + means only
    where there is one."""
    changed = " (+: gateway/ had uncommitted changes)" if commit.endswith("+") else ""
    return f"commit {commit}{changed}"


def _progress(message: str) -> None:
    print(f"  {message}", file=sys.stderr, flush=True)


async def run_bench(servers: Servers, settings: Settings, client_kind: str) -> Results:
    """Every measurement, each on both paths, against the running servers."""
    clock = CpuClock(servers.gateway.pid, servers.worker.pid)
    gateway_type = GatewayClient if client_kind == "raw" else HttpxGatewayClient
    gateway: Client = gateway_type(servers.gateway_port)
    direct: dict[str, Client] = {m: GrpcClient(p) for m, p in servers.worker_ports.items()}
    results = Results(
        settings=asdict(settings),
        environment={
            "http_client": "asyncio+httptools" if client_kind == "raw" else "httpx",
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "grpcio": grpc.__version__,
            "commit": _commit(),
        },
    )
    rng = random.Random(7)
    try:
        # 1. Memory first, while the gateway's heap holds nothing of earlier runs.
        pid, streams = servers.gateway.pid, settings.memory_streams
        results.memory = await measure_memory(servers.gateway_port, pid, streams, clock)
        _progress(f"memory, {streams} open streams: done")

        # 2. TTFT. At concurrency 1 the two paths take turns in blocks, so a slow
        # patch of the machine (another process, a timer) hits both alike.
        short = make_prompt(COALESCED, settings.ttft_words, rng)
        pair = (gateway, direct[COALESCED])
        sequential = {client.name: Timings() for client in pair}
        for _ in range(max(1, settings.ttft_requests // 50)):
            for client in pair:
                sequential[client.name].merge(await measure_ttft(client, short, 1, 50, clock))
        results.latency += [LatencyRun.of(name, 1, t) for name, t in sequential.items()]
        _progress("TTFT, 1 stream: done")
        for client in pair:
            await client.close()
            await clock.settle()
            streams, per_stream = settings.streams, settings.ttft_per_stream
            timings = await measure_ttft(client, short, streams, per_stream, clock)
            results.latency.append(LatencyRun.of(client.name, streams, timings))
        _progress(f"TTFT, {settings.streams} streams: done")

        # 3. Streamed tokens per second: long answers, in each worker mode.
        for model, mode in MODES.items():
            prompts = [
                make_prompt(model, rng.randint(settings.min_words, settings.max_words), rng)
                for _ in range(24)
            ]
            for streams in (1, settings.streams):
                for client in (gateway, direct[model]):
                    run = await measure_flow(client, prompts, mode, streams, settings, clock)
                    results.flow.append(run)
                _progress(f"tokens/s, {mode}, {streams} stream(s): done")
    finally:
        await gateway.close()
        for client in direct.values():
            await client.close()
    return results


# --- the report ------------------------------------------------------------------------


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), rule, *map(line, rows)])


def _streams(n: int) -> str:
    return f"{n:,} stream" + ("s" if n > 1 else "")


def _cpu_cells(values: dict[str, float], other: float | None) -> list[str]:
    cells = [f"{values[k]:.1f}" if k in values else "?" for k in OURS]
    return [*cells, "?" if other is None else f"{other:.2f}"]


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("pass" if ok else "FAIL")


# The targets: TTFT overhead (ms) at most, tokens/s ratio at least, KiB per stream.
TTFT_TARGETS = {"p50": 1.0, "p99": 3.0}
RATIO_TARGET = 0.75
RATIO_MODE = MODES[ECHO[1]]
MEMORY_TARGET_KIB = 64.0


def target_rows(results: Results) -> list[list[str]]:
    """The comparison, one row per figure: gateway, raw gRPC, the figure, the target,
    and whether it is met."""
    latency = {(r.path, r.concurrency): r for r in results.latency}
    flow = {(r.path, r.mode, r.streams): r for r in results.flow}
    rows: list[list[str]] = []
    for concurrency in sorted({c for _, c in latency}):
        gw, raw = latency["gateway", concurrency], latency["raw gRPC", concurrency]
        for q, limit in TTFT_TARGETS.items():
            g, r = getattr(gw, f"{q}_ms"), getattr(raw, f"{q}_ms")
            label = f"TTFT {q}, {_streams(concurrency)} (ms)"
            cells = [f"{g:.2f}", f"{r:.2f}", f"{g - r:+.2f} ms", f"≤ +{limit:g} ms"]
            rows.append([label, *cells, _verdict(g - r <= limit)])
    for mode in dict.fromkeys(r.mode for r in results.flow):
        for streams in sorted({r.streams for r in results.flow}):
            g = flow["gateway", mode, streams].tokens_per_s
            r = flow["raw gRPC", mode, streams].tokens_per_s
            ratio = g / r
            label = f"tokens/s, {mode}, {_streams(streams)}"
            target, ok = "-", None
            if mode == RATIO_MODE:
                target, ok = f"≥ x{RATIO_TARGET:g}", ratio >= RATIO_TARGET
            rows.append([label, f"{g:,.0f}", f"{r:,.0f}", f"x{ratio:.2f}", target, _verdict(ok)])
    for mode in dict.fromkeys(r.mode for r in results.flow):
        run = flow["gateway", mode, max(r.streams for r in results.flow)]
        seconds = run.cpu_us_per_token.get("gateway", math.nan) / 1e3  # us/token -> s/1k
        label = f"gateway CPU s per 1,000 tokens, {mode}, {_streams(run.streams)}"
        rows.append([label, f"{seconds:.3f}", "", "", "-", "-"])
    if results.memory is not None:
        memory = results.memory
        label = f"gateway memory per open stream, {_streams(memory.streams)} (KiB)"
        per = memory.kib_per_stream
        cells = [f"{per:.1f}", "", f"{memory.before_kib:,} → {memory.during_kib:,} KiB RSS"]
        rows.append([label, *cells, f"≤ {MEMORY_TARGET_KIB:g}", _verdict(per <= MEMORY_TARGET_KIB)])
    for path in ("gateway", "raw gRPC"):
        total = Delivery()
        for run in [*results.latency, *results.flow]:
            if run.path == path:
                total.merge(run.delivery)
        ratio = total.counted / total.emitted if total.emitted else math.nan
        label = f"tokens delivered ÷ emitted, {path}"
        cells = [f"{ratio:.6f}", "", f"{total.counted:,} / {total.emitted:,} tokens"]
        rows.append([label, *cells, "= 1", _verdict(total.ok and ratio == 1)])
    return rows


def render(results: Results) -> str:
    """The markdown report: the comparison against the targets, then where the CPU went."""
    header = ["measure", "gateway", "raw gRPC", "gateway vs raw", "target", "result"]
    summary = _table(header, target_rows(results))

    detail: list[list[str]] = []
    for lat in results.latency:
        label = f"TTFT, {_streams(lat.concurrency)}"
        cells = _cpu_cells(lat.cpu_us_per_request, lat.other_load)
        rate = f"{lat.requests_per_s:,.0f} req/s"
        detail.append([label, lat.path, rate, *cells, "us/request", lat.delivery.verdict()])
    for run in results.flow:
        label = f"tokens/s, {run.mode}, {_streams(run.streams)}"
        per_message = f"{run.tokens_per_message:.2f} tokens/message"
        cells = [per_message, *_cpu_cells(run.cpu_us_per_token, run.other_load)]
        detail.append([label, run.path, *cells, "us/token", run.delivery.verdict()])
    header = ["run", "path", "rate or size", "gateway CPU", "worker CPU", "client CPU"]
    header += ["other load", "CPU unit", "finished requests: delivered == emitted"]
    env = results.environment
    notes = (
        f"HTTP client: {env['http_client']}. {env['cpus']} CPUs shared by the worker, the "
        f"gateway and the client; Python {env['python']}, grpcio {env['grpcio']}; "
        f"{commit_label(env['commit'])}.\n"
        "TTFT: from writing the request to the first content chunk (gateway) or the first "
        "Text message (raw gRPC); answers of "
        f"{results.settings['ttft_words']} tokens; overhead = gateway percentile - raw "
        "percentile.\n"
        "tokens/message: tokens per gRPC Text message (raw gRPC) or per SSE content chunk "
        "(gateway), inside the window.\n"
        "memory: the gateway's VmRSS before and while the streams wait on a worker that "
        f"sends a token every {SLOW_TOKEN_DELAY:g} s.\n"
        "other load: cores kept busy by other processes meanwhile; above ~0.1 the numbers "
        "of that run are disturbed.\n"
        "delivered == emitted: for every finished request, the delta text equals the echoed "
        "prompt and the counts agree (delta words / usage.completion_tokens / words emitted; "
        "raw gRPC: sum of Text.tokens / Finished.completion_tokens / words emitted)."
    )
    return f"{summary}\n\nWhere the CPU went\n\n{_table(header, detail)}\n\n{notes}"


# --- the command -----------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Measure what furnace-gateway adds over calling the worker directly."
    )
    parser.add_argument("--quick", action="store_true", help="a ~20 s run instead of ~60 s")
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    parser.add_argument(
        "--client",
        choices=("raw", "httpx"),
        default="raw",
        help="HTTP client: asyncio+httptools (default, cheap) or httpx (to compare)",
    )
    parser.add_argument("--worker-process", metavar="MODEL=PORT,...", help=argparse.SUPPRESS)
    return parser


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the cleanup of the servers


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark (or, with --worker-process, the bench's worker)."""
    args = _parser().parse_args(argv)
    if args.worker_process:
        ports = dict(item.split("=") for item in args.worker_process.split(","))
        uvloop.run(serve_workers({m: int(p) for m, p in ports.items()}))  # as production does
        return 0
    signal.signal(signal.SIGTERM, _terminate)
    settings = QUICK if args.quick else DEFAULT
    started = time.monotonic()
    _progress("starting the worker and the gateway")
    with start_servers() as servers:
        results = uvloop.run(run_bench(servers, settings, args.client))
    print(render(results))
    print(f"\n(run took {time.monotonic() - started:.0f} s)")
    if args.json:
        Path(args.json).write_text(
            orjson.dumps(asdict(results), option=orjson.OPT_INDENT_2).decode()
        )
    failed = any(not r.delivery.ok for r in [*results.latency, *results.flow])
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
