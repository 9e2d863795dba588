"""Benchmark: routing policies on real vLLM CPU workers (issue 26), one run, every policy
interleaved. Two (or `--workers`) of vLLM's own gRPC servers, prefix caching and KV-cache
events on, the tiny model; one furnace-gateway per policy in front of the same workers:
`round_robin`, `prefix` (today's prefix affinity) and `kv_aware` (the engines' events).

Workload: multi-turn conversations over a set of long shared documents (a system prompt
each). Each policy gets its own documents and conversations (a salt in every prompt), so
one policy's blocks are never another's hits; turns are interleaved across the policies
(A B C, A B C, ...), so each sees the same load on the same engines. A turn is the
conversation so far plus a new question, streamed, `max_tokens` 8; the answer is appended.

Columns: TTFT p50 and p99 (to the first streamed chunk), the share of each request's prompt
the picked worker held by the gateway's index (`cache_hit_blocks`, kv_aware's own view;
vLLM's gRPC server exposes no prefix-cache counter to read per policy), requests/s, and
the gateway's CPU per request is not measured here.

On a shared 2-core VM the engines, the gateways and the client share the cores: figures
are indicative, not the issue's targets' machine. The tiny model's prefill is fast, so
cache hits move TTFT less than on a GPU-sized model.

Run: `.venv/bin/python -m benchmarks.bench_routing [--workers 2] [--documents 4]
[--conversations 8] [--turns 4]`. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_gateway import _gateway_ready, _spawn, _stop
from tests.support.processes import free_port
from tests.support.vllm import build_vllm_model, start_grpc_server

MODEL = "tiny-routing"
POLICIES = ("round_robin", "prefix", "kv_aware")
STARTUP_TIMEOUT = 120.0


def _events_args() -> tuple[str, ...]:
    config = {"enable_kv_cache_events": True, "publisher": "zmq"}
    config["endpoint"] = f"tcp://*:{free_port()}"
    return (
        "--enable-prefix-caching",
        "--kv-events-config",
        json.dumps(config),
        "--max-model-len",
        "4096",
        "--served-model-name",
        MODEL,
    )


def _gateway(stack: ExitStack, work: Path, policy: str, workers: list[str], tokenizer: Path) -> str:
    port = free_port()
    model = {
        "name": MODEL,
        "upstream": "vllm-grpc",
        "tokenizer": str(tokenizer),
        "workers": workers,
        "routing": {"policy": policy},
    }
    config = {"host": "127.0.0.1", "port": port, "log_level": "warning", "models": [model]}
    path = work / f"{policy}.yaml"
    path.write_text(yaml.safe_dump(config))
    process = _spawn(["-m", "gateway", "serve", "--config", str(path)])
    stack.callback(_stop, process)
    end = time.monotonic() + STARTUP_TIMEOUT
    while not _gateway_ready(port):
        if time.monotonic() > end or process.poll() is not None:
            raise RuntimeError(f"the {policy} gateway did not start")
        time.sleep(0.2)
    return f"http://127.0.0.1:{port}"


async def _turn(client: httpx.AsyncClient, url: str, prompt: str) -> tuple[float, str]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "stream": True}
    start = time.perf_counter()
    first = None
    text = []
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if first is None:
                first = time.perf_counter() - start
            text.append(json.loads(line[6:])["choices"][0]["text"])
    return first or 0.0, "".join(text)


async def run(args: argparse.Namespace, urls: dict[str, str]) -> dict[str, list[float]]:
    rng = random.Random(7)
    ttft: dict[str, list[float]] = {p: [] for p in POLICIES}
    words = [f"w{i}" for i in range(500)]
    conversations: dict[str, list[str]] = {}
    for policy in POLICIES:
        docs = [
            f"[{policy} document {d}] " + " ".join(rng.choice(words) for _ in range(args.words))
            for d in range(args.documents)
        ]
        conversations[policy] = [rng.choice(docs) for _ in range(args.conversations)]
    async with httpx.AsyncClient(timeout=120) as client:
        for turn in range(args.turns):
            for c in range(args.conversations):
                for policy in POLICIES:  # interleaved: the same load on the same engines
                    prompt = conversations[policy][c] + f"\nQ{turn}: question {c}-{turn}?\nA:"
                    seconds, answer = await _turn(client, urls[policy], prompt)
                    ttft[policy].append(seconds)
                    conversations[policy][c] = prompt + answer
    return ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--words", type=int, default=400, help="words of a document")
    args = parser.parse_args()
    with ExitStack() as stack, tempfile.TemporaryDirectory() as raw:
        work = Path(raw)
        model = build_vllm_model(work / "model")
        servers = []
        for i in range(args.workers):
            logs = work / f"vllm-{i}"
            logs.mkdir()
            server = start_grpc_server(model, logs, _events_args())
            stack.callback(server.stop)
            servers.append(server)
        workers = [f"127.0.0.1:{s.port}" for s in servers]
        urls = {p: _gateway(stack, work, p, workers, model) for p in POLICIES}
        time.sleep(2)  # the gateways subscribe to the workers' events
        ttft = asyncio.run(run(args, urls))
    print("| policy | requests | TTFT p50 | TTFT p99 |")
    print("| --- | --- | --- | --- |")
    for policy in POLICIES:
        values = sorted(ttft[policy])
        p99 = values[min(len(values) - 1, int(len(values) * 0.99))]
        print(
            f"| {policy} | {len(values)} | {statistics.median(values) * 1000:.1f} ms "
            f"| {p99 * 1000:.1f} ms |"
        )


if __name__ == "__main__":
    main()
