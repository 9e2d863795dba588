"""Benchmark: the gateway in front of vLLM, against vLLM alone, in one run.

Starts vLLM's OpenAI HTTP server on the tiny model (tests/support/vllm.py, from the
.tools/vllm environment) and a gateway process (`python -m gateway serve`, uvloop and
httptools) with `upstream: openai` in front of it, then sends the same load straight to
vLLM and through the gateway, alternating, and prints per concurrency: TTFT p50/p99 of
each path and the gateway's addition, the tokens/s ratio (gateway / direct), and the
gateway process's CPU per token streamed (/proc, as benchmarks/bench_gateway.py). The same
for vLLM's native gRPC server: straight to it with a raw grpc.aio client (the prompt's ids
made once, as a client that tokenizes for itself would), and through a gateway with
`upstream: vllm-grpc` (which tokenizes, detokenizes and encodes SSE itself).

Load: streamed /v1/completions, temperature 0, `max_tokens` 64 (the tiny model's greedy
junk hits no EOS, so every answer is 64 tokens), 1 stream and 8 streams at once.

Run: `.venv/bin/python benchmarks/bench_vllm.py [--requests N]` (about 3 minutes, most of it
the two vLLM servers' start). Not collected by pytest.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_gateway import _gateway_ready, _spawn, _stop, process_cpu  # noqa: E402
from tests.support.processes import free_port  # noqa: E402
from tests.support.vllm import (  # noqa: E402
    build_vllm_model,
    start_grpc_server,
    start_http_server,
)

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


async def run_grpc_load(
    address: str, ids: list[int], streams: int, requests: int
) -> tuple[list[float], int, float]:
    """The same load straight to vLLM's gRPC server: one channel, token ids in and out."""
    import grpc
    from smg_grpc_proto.generated import vllm_engine_pb2 as pb
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as pb_grpc

    queue = list(range(requests))
    ttfts: list[float] = []
    tokens = 0
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.VllmEngineStub(channel)

        async def worker() -> None:
            nonlocal tokens
            while queue:
                n = queue.pop()
                request = pb.GenerateRequest(
                    request_id=f"bench-{streams}-{n}-{time.perf_counter_ns()}",
                    tokenized=pb.TokenizedInput(input_ids=ids),
                    sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                    stream=True,
                )
                start = time.perf_counter()
                ttft = None
                count = 0
                async for reply in stub.Generate(request, timeout=120):
                    if reply.WhichOneof("response") == "chunk":
                        if ttft is None and reply.chunk.token_ids:
                            ttft = time.perf_counter() - start
                        count += len(reply.chunk.token_ids)
                assert ttft is not None and count == MAX_TOKENS, (ttft, count)
                ttfts.append(ttft)
                tokens += count

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(streams)))
        return ttfts, tokens, time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def start_gateway(work: Path, name: str, model: dict[str, object]) -> tuple[Any, int]:
    """A gateway process serving `model`, ready."""
    port = free_port()
    config = {"host": "127.0.0.1", "port": port, "log_level": "warning", "models": [model]}
    (work / f"{name}.yaml").write_text(yaml.safe_dump(config))
    gateway = _spawn(["-m", "gateway", "serve", "--config", str(work / f"{name}.yaml")])
    end = time.monotonic() + 60
    while not _gateway_ready(port):
        if time.monotonic() > end or gateway.poll() is not None:
            _stop(gateway)
            raise RuntimeError("the gateway did not start")
        time.sleep(0.2)
    return gateway, port


Row = tuple[str, int, float, float, float, float, float, float, "float | None"]
Load = Callable[[int, int], tuple[list[float], int, float]]


def measure(label: str, gateway: Any, direct: Load, through: Load, requests: int) -> list[Row]:
    """Rows for 1 and 8 streams: `direct(streams, n)` and `through(streams, n)` run loads."""
    for warm in (direct, through, direct):  # warm both paths
        warm(8, 16)
    rows: list[Row] = []
    for streams in (1, 8):
        d_ttft, d_tokens, d_wall = direct(streams, requests)
        cpu0 = process_cpu(gateway.pid)
        g_ttft, g_tokens, g_wall = through(streams, requests)
        cpu1 = process_cpu(gateway.pid)
        cpu = None if cpu0 is None or cpu1 is None else (cpu1 - cpu0) / g_tokens * 1e6
        rows.append(
            (
                label,
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
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=48, help="requests per run")
    args = parser.parse_args()
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp:
        work = Path(tmp)
        model_dir = build_vllm_model(work / "model")
        # vLLM's OpenAI HTTP server, and a gateway with `upstream: openai`
        vllm = start_http_server(model_dir, work)
        gateway, port = start_gateway(
            work,
            "http",
            {"name": MODEL, "upstream": "openai", "workers": [f"http://127.0.0.1:{vllm.port}/v1"]},
        )
        try:
            direct, through = f"http://127.0.0.1:{vllm.port}", f"http://127.0.0.1:{port}"
            rows += measure(
                "HTTP (upstream: openai)",
                gateway,
                lambda s, n: asyncio.run(run_load(direct, s, n)),
                lambda s, n: asyncio.run(run_load(through, s, n)),
                args.requests,
            )
        finally:
            _stop(gateway)
            vllm.stop()
        # vLLM's native gRPC server, and a gateway with `upstream: vllm-grpc`
        vllm = start_grpc_server(model_dir, work)
        gateway, port = start_gateway(
            work,
            "grpc",
            {
                "name": MODEL,
                "upstream": "vllm-grpc",
                "tokenizer": str(model_dir),
                "workers": [f"127.0.0.1:{vllm.port}"],
            },
        )
        try:
            from tokenizers import Tokenizer

            ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode("one two three").ids
            address, through = f"127.0.0.1:{vllm.port}", f"http://127.0.0.1:{port}"
            rows += measure(
                "gRPC (upstream: vllm-grpc)",
                gateway,
                lambda s, n: asyncio.run(run_grpc_load(address, ids, s, n)),
                lambda s, n: asyncio.run(run_load(through, s, n)),
                args.requests,
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
