"""The gateway's CPU for following a vLLM gRPC worker's KV-cache events (issue 26): one real
vLLM gRPC server (the tiny model, prefix caching and KV events on) and two gateway processes
in front of it, `routing.policy` `prefix` (no subscription) and `kv_aware` (it follows the
engine's `SubscribeKvEvents`), both sent the same requests at once, so the engine's load and
its stream are the same for both: streamed chats of a new ~300-token prompt each (its two
128-token blocks are stored: an event batch) and `--max-tokens` answers (`ignore_eos`).

Printed: each gateway's process CPU (/proc, every thread) per request and per second, busy
and over `--idle` seconds with no traffic; the engine's messages (counted by a tap, a bare
subscriber of the same stream in a process of its own: every batch, the `load_only` ones,
those with events) and the tap's CPU a message, the floor gRPC's Python client pays; the
kv_aware gateway's extra CPU a message. With `--py-spy DIR` the kv_aware gateway serves one
more round alone under `py-spy record --gil` and its top functions are printed.

Run: `python -m benchmarks.profile_kv_events [--requests 20] [--streams 1] [--max-tokens 64]
[--rounds 3] [--idle 10] [--py-spy DIR]` (4-8 minutes here, the engine's start included).
Not collected by pytest.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_gateway import process_cpu  # noqa: E402
from benchmarks.bench_vllm import MODEL, one_chat, start_gateway  # noqa: E402
from benchmarks.profile_gateway import top_functions  # noqa: E402
from tests.support.vllm import build_vllm_model, kv_events_args, start_grpc_server  # noqa: E402

POLICIES = ("prefix", "kv_aware")
WORDS = ("gateway", "engine", "token", "block", "cache", "prefix", "route", "worker", "stream")


class Tap:
    """A subscriber of the engine's KV events in a process of its own (`--tap`), counting
    the batches it receives: its CPU is what gRPC's Python client alone pays a message."""

    def __init__(self, address: str) -> None:
        command = [sys.executable, "-m", "benchmarks.profile_kv_events", "--tap", address]
        self.process = subprocess.Popen(
            command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def counts(self) -> tuple[int, int, int, float]:
        """Batches, `load_only` ones, ones with events, and the tap's CPU seconds."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        batches, load_only, events = map(int, self.process.stdout.readline().split())
        return batches, load_only, events, process_cpu(self.process.pid) or 0.0

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


def tap(address: str) -> None:
    """The tap's process: follows the stream as the gateway does (grpc.aio on uvloop),
    says its counts on each line of its input (read in a thread)."""
    import grpc
    import uvloop
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

    from gateway.upstreams.vllm_kv import subscribe_request

    counts = [0, 0, 0]

    def answer() -> None:
        for _ in sys.stdin:
            print(*counts, flush=True)

    async def follow() -> None:
        async with grpc.aio.insecure_channel(address) as channel:
            stream = pb_grpc.VllmEngineStub(channel).SubscribeKvEvents(subscribe_request())
            async for batch in stream:
                counts[0] += 1
                counts[1] += batch.load.load_only
                counts[2] += bool(batch.events)

    threading.Thread(target=answer, daemon=True).start()
    uvloop.run(follow())


def prompt(rng: random.Random) -> list[dict[str, str]]:
    """A new ~300-token prompt (random words: no block of it is cached before)."""
    return [{"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(150))}]


def bodies(count: int, max_tokens: int, rng: random.Random) -> list[dict[str, object]]:
    """`count` chats of new prompts, answers of `max_tokens` whatever the model says."""
    return [
        {"messages": prompt(rng), "max_tokens": max_tokens, "ignore_eos": True}
        for _ in range(count)
    ]


async def send(client: httpx.AsyncClient, url: str, share: list[dict[str, object]]) -> None:
    for body in share:
        await one_chat(client, url, body)


@dataclass
class Gateway:
    """One policy's gateway process, and what it used while the rounds ran."""

    policy: str
    pid: int
    url: str
    cpu: float = 0.0
    requests: int = 0


async def round_(gateways: list[Gateway], args: argparse.Namespace, rng: random.Random) -> None:
    """`--requests` a gateway, `--streams` at a time each, all gateways at once: the
    engine's load (and so its stream of load records) is the same for every row."""
    async with httpx.AsyncClient(timeout=300) as client:
        calls = []
        for gateway in gateways:
            chats = bodies(args.requests, args.max_tokens, rng)
            gateway.requests += len(chats)
            calls += [
                send(client, gateway.url, chats[i :: args.streams]) for i in range(args.streams)
            ]
        await asyncio.gather(*calls)


def cpu_of(gateways: list[Gateway], tap: Tap, action: Callable[[], object]) -> tuple[int, float]:
    """Runs `action`; adds each gateway's CPU meanwhile to it; the tap's messages and CPU."""
    before = [process_cpu(g.pid) or 0.0 for g in gateways]
    counts = tap.counts()
    action()
    for gateway, cpu in zip(gateways, before, strict=True):
        gateway.cpu += (process_cpu(gateway.pid) or 0.0) - cpu
    later = tap.counts()
    return later[0] - counts[0], later[3] - counts[3]


def profile(gateway: Gateway, out: Path, args: argparse.Namespace) -> None:
    """One round through the gateway alone under py-spy; its top functions printed."""
    py_spy = str(Path(sys.executable).parent / "py-spy")
    target = out / f"{gateway.policy}.txt"
    command = [py_spy, "record", "--pid", str(gateway.pid), "--rate", "1000", "--format", "raw"]
    command += ["--output", str(target), "--nonblocking", "--gil"]
    recorder = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.0)  # py-spy attaches
    asyncio.run(round_([Gateway(gateway.policy, gateway.pid, gateway.url)], args, random.Random()))
    recorder.send_signal(2)  # SIGINT: py-spy writes its file and exits
    recorder.wait(30)
    print(f"\n--- py-spy, the {gateway.policy} gateway (GIL held) ---")
    print(top_functions(target))


def gateway_model(model: Path, address: str, policy: str) -> dict[str, object]:
    return {
        "name": MODEL,
        "upstream": "vllm-grpc",
        "tokenizer": str(model),
        "workers": [address],
        "routing": {"policy": policy},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20, help="a gateway, a round")
    parser.add_argument("--streams", type=int, default=1, help="a gateway")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle", type=float, default=10.0)
    parser.add_argument("--py-spy", type=Path)
    parser.add_argument("--tap", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tap:
        tap(args.tap)
        return
    rng = random.Random(1)
    with tempfile.TemporaryDirectory(prefix="furnace-kv-events-") as tmp, ExitStack() as stack:
        work = Path(tmp)
        model = build_vllm_model(work / "model")
        vllm = start_grpc_server(model, work, (*kv_events_args(), "--served-model-name", MODEL))
        stack.callback(vllm.stop)
        address = f"127.0.0.1:{vllm.port}"
        tap_ = Tap(address)
        stack.callback(tap_.close)
        gateways = []
        for policy in POLICIES:
            target = start_gateway(stack, work, policy, gateway_model(model, address, policy))
            assert target.pid is not None, target.missing
            gateways.append(Gateway(policy, target.pid, target_url(work, policy)))
        asyncio.run(round_(gateways, argparse.Namespace(**{**vars(args), "requests": 2}), rng))
        for gateway in gateways:  # the warm-up is not counted
            gateway.cpu = gateway.requests = 0
        messages, tap_cpu, wall = 0, 0.0, 0.0
        for _ in range(args.rounds):
            start = time.perf_counter()
            n, cpu = cpu_of(gateways, tap_, lambda: asyncio.run(round_(gateways, args, rng)))
            messages, tap_cpu, wall = (
                messages + n,
                tap_cpu + cpu,
                wall + time.perf_counter() - start,
            )
        busy = {g.policy: (g.cpu, g.requests) for g in gateways}
        for gateway in gateways:
            gateway.cpu = 0.0
        idle_messages, _ = cpu_of(gateways, tap_, lambda: time.sleep(args.idle))
        print(
            f"\n{args.rounds} rounds of {args.requests} requests a gateway, {args.streams} at a "
            f"time each, both gateways at once; {args.max_tokens}-token answers; {wall:.0f} s"
        )
        print("| policy | gateway CPU/request | gateway CPU/s busy | gateway CPU/s idle |")
        print("| --- | --- | --- | --- |")
        for gateway in gateways:
            cpu, count = busy[gateway.policy]
            print(
                f"| {gateway.policy} | {cpu / count * 1e3:.1f} ms | {cpu / wall * 1e3:.1f} ms "
                f"| {gateway.cpu / args.idle * 1e3:.2f} ms |"
            )
        extra = busy["kv_aware"][0] - busy["prefix"][0]
        count = busy["kv_aware"][1] + busy["prefix"][1]
        print(
            f"the engine's stream: {messages} messages busy ({messages / wall:.1f}/s, "
            f"{messages / count:.1f} a request), {idle_messages} in {args.idle:g} s idle"
        )
        print(
            f"kv_aware - prefix: {extra * 1e3:.0f} ms of CPU, {extra / max(messages, 1) * 1e6:.0f} "
            f"µs a message; a bare subscriber (the tap): {tap_cpu / max(messages, 1) * 1e6:.0f} "
            "µs a message"
        )
        batches, load_only, events, _ = tap_.counts()
        print(
            f"the tap's whole stream: {batches} batches, {load_only} load_only, "
            f"{events} with events"
        )
        if args.py_spy:
            args.py_spy.mkdir(parents=True, exist_ok=True)
            profile(gateways[1], args.py_spy, args)


def target_url(work: Path, name: str) -> str:
    """The gateway's URL, from the config `start_gateway` wrote."""
    config = yaml.safe_load((work / f"{name}.yaml").read_text())
    return f"http://127.0.0.1:{config['port']}"


if __name__ == "__main__":
    main()
