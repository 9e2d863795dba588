"""What one read of a vLLM HTTP server's load record costs: `OpenAIHttpUpstream.engine_load`
against a real vLLM CPU server (the tiny model), the page filtered to the scheduler's gauges
(`/metrics/?name[]=...`, what the gateway asks for) against the whole page (`/metrics`,
~57 KB of mostly histograms, what it read before), each over the upstream's own kept-alive
connections (`gateway.protocol.http1.fetch`, what a plain http:// upstream uses) and over
httpx (what an https or proxied one uses, and what every read used before). A `kv_aware`
or `least_load` gateway makes one such read an engine every `routing.load_interval` (1 s),
busy or not, and a health poll as often: a cost per engine-second, not per request.

Columns: the gateway's CPU a read (this process, `time.process_time`) and the read's wall
time (most of it vLLM's API server rendering the page), the mean of `--reads` reads, for
`--rounds` rounds alternating the two. Run: `.venv/bin/python -m benchmarks.bench_load_scrape
[--reads 100] [--rounds 3]` (about a minute, most of it vLLM's start). Not collected by pytest.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gateway.upstreams.openai_http.upstream import OpenAIHttpUpstream  # noqa: E402
from tests.support.vllm import build_vllm_model, start_http_server  # noqa: E402


async def _reads(url: str, whole: bool, raw: bool, reads: int) -> tuple[float, float]:
    """CPU and wall seconds a read, the mean of `reads` after one to warm up."""
    async with httpx.AsyncClient() as http:
        upstream = OpenAIHttpUpstream(url, http, raw_http=raw)
        if whole:
            upstream.metrics_url = url.removesuffix("/v1") + "/metrics"
        if await upstream.engine_load(2.0) is None:
            raise RuntimeError(f"{upstream.metrics_url}: no load record")
        cpu, wall = time.process_time(), time.perf_counter()
        for _ in range(reads):
            await upstream.engine_load(2.0)
        return (time.process_time() - cpu) / reads, (time.perf_counter() - wall) / reads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reads", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-load-scrape-"))
    model = build_vllm_model(work / "model")
    with start_http_server(model, work) as server:
        url = f"http://127.0.0.1:{server.port}/v1"
        print("| round | client | page | gateway CPU a read | wall a read |")
        print("| ---: | --- | --- | ---: | ---: |")
        for round_ in range(1, args.rounds + 1):
            for client, raw in (("httpx", False), ("own connections", True)):
                for page, whole in (("whole", True), ("filtered", False)):
                    cpu, wall = asyncio.run(_reads(url, whole, raw, args.reads))
                    figures = f"{cpu * 1e3:.2f} ms | {wall * 1e3:.2f} ms"
                    print(f"| {round_} | {client} | {page} | {figures} |")


if __name__ == "__main__":
    main()
