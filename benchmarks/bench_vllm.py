"""Benchmark: the gateway in front of vLLM, against vLLM alone, in one run.

Starts vLLM's OpenAI HTTP server on the tiny model (tests/support/vllm.py, from the
.tools/vllm environment) and a gateway process (`python -m gateway serve`, uvloop and
httptools) with `upstream: openai` in front of it, then sends the same load straight to
vLLM and through the gateway, alternating, and prints per concurrency: TTFT p50/p99 of
each path and the gateway's addition, the tokens/s ratio (gateway / direct), and the
gateway process's CPU per token streamed (/proc, as benchmarks/bench_gateway.py).

Load: streamed /v1/completions, temperature 0, `max_tokens` 64 (the tiny model's greedy
junk hits no EOS, so every answer is 64 tokens), 1 stream and 8 streams at once. vLLM's
native gRPC server behind `upstream: vllm-grpc` is not measured here yet.

Run: `.venv/bin/python benchmarks/bench_vllm.py [--requests N]` (about 90 s, most of it
vLLM's start). Not collected by pytest.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import orjson
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_gateway import _gateway_ready, _spawn, _stop, process_cpu  # noqa: E402
from tests.support.processes import free_port  # noqa: E402
from tests.support.vllm import build_vllm_model, start_http_server  # noqa: E402

MODEL = "tiny-vllm"
MAX_TOKENS = 64


async def one_stream(client: httpx.AsyncClient, url: str) -> tuple[float, int]:
    """TTFT (seconds) and completion tokens of one streamed completion."""
    body = {
        "model": MODEL,
        "prompt": "one two three",
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = None
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            if ttft is None and event["choices"] and event["choices"][0]["text"]:
                ttft = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    assert ttft is not None and tokens == MAX_TOKENS, (ttft, tokens)
    return ttft, tokens


async def run_load(url: str, streams: int, requests: int) -> tuple[list[float], int, float]:
    """`requests` completions, `streams` at a time: TTFTs, tokens, wall seconds."""
    queue = list(range(requests))
    ttfts: list[float] = []
    tokens = 0
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as client:

        async def worker() -> None:
            nonlocal tokens
            while queue:
                queue.pop()
                ttft, count = await one_stream(client, url)
                ttfts.append(ttft)
                tokens += count

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(streams)))
        return ttfts, tokens, time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=48, help="requests per run")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        work = Path(tmp)
        vllm = start_http_server(build_vllm_model(work / "model"), work)
        port = free_port()
        config = {
            "host": "127.0.0.1",
            "port": port,
            "log_level": "warning",
            "models": [
                {
                    "name": MODEL,
                    "upstream": "openai",
                    "workers": [f"http://127.0.0.1:{vllm.port}/v1"],
                }
            ],
        }
        (work / "gateway.yaml").write_text(yaml.safe_dump(config))
        gateway = _spawn(["-m", "gateway", "serve", "--config", str(work / "gateway.yaml")])
        try:
            end = time.monotonic() + 60
            while not _gateway_ready(port):
                if time.monotonic() > end or gateway.poll() is not None:
                    raise RuntimeError("the gateway did not start")
                time.sleep(0.2)
            direct, through = f"http://127.0.0.1:{vllm.port}", f"http://127.0.0.1:{port}"
            for url in (direct, through, direct):  # warm both paths
                asyncio.run(run_load(url, 8, 16))
            rows = []
            for streams in (1, 8):
                d_ttft, d_tokens, d_wall = asyncio.run(run_load(direct, streams, args.requests))
                cpu0 = process_cpu(gateway.pid)
                g_ttft, g_tokens, g_wall = asyncio.run(run_load(through, streams, args.requests))
                cpu1 = process_cpu(gateway.pid)
                cpu = None if cpu0 is None or cpu1 is None else (cpu1 - cpu0) / g_tokens * 1e6
                rows.append(
                    (
                        "HTTP (upstream: openai)",
                        streams,
                        pct(d_ttft, 0.5) * 1e3,
                        pct(d_ttft, 0.99) * 1e3,
                        (pct(g_ttft, 0.5) - pct(d_ttft, 0.5)) * 1e3,
                        (pct(g_ttft, 0.99) - pct(d_ttft, 0.99)) * 1e3,
                        d_tokens / d_wall,
                        (g_tokens / g_wall) / (d_tokens / d_wall),
                        cpu,
                    )
                )
        finally:
            _stop(gateway)
            vllm.stop()
    print(f"\n{args.requests} streamed completions per run, {MAX_TOKENS} tokens each\n")
    print(
        "| vLLM server | streams | direct TTFT p50 / p99 | added TTFT p50 / p99 "
        "| direct tokens/s | gateway / direct tokens/s | gateway CPU per token |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, streams, p50, p99, a50, a99, rate, ratio, cpu in rows:
        cpu_text = "n/a" if cpu is None else f"{cpu:.0f} µs"
        print(
            f"| {name} | {streams} | {p50:.1f} / {p99:.1f} ms | {a50:+.1f} / {a99:+.1f} ms "
            f"| {rate:.0f} | {ratio:.2f} | {cpu_text} |"
        )
    print(f"\nmedian direct TTFT: {statistics.median([r[2] for r in rows]):.1f} ms")


if __name__ == "__main__":
    main()
