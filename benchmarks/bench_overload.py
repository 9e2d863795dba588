"""Goodput under overload, queue off against queue on.

One process, one loop: a paced demo worker (each request `--tokens` tokens at
`--token-delay` seconds each, any number at once, a stand-in for a GPU's batch),
a gateway with `--slots` concurrency slots in front of it, and an open-loop
client sending Poisson arrivals at a fraction of the fleet's capacity
(slots / seconds per request) for `--seconds`. Goodput is the rate of requests
answered 200 within `--slo` seconds end to end; a refused request (503) is not
retried. With the queue (`max_wait` = `--max-wait`), a burst waits for a slot
instead of being refused, and what cannot make it is still refused at once.

    .venv/bin/python -m benchmarks.bench_overload [--quick]

prints a markdown table, one row per offered load and mode.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from dataclasses import replace

import httpx

from gateway.config import Config, ModelConfig, QueueConfig
from gateway.lifecycle import GatewayServer
from gateway.worker.demo import DemoEngine
from gateway.worker.server import WorkerServer

MODEL = "paced"


async def one(client: httpx.AsyncClient, prompt: str) -> tuple[int, float]:
    start = time.perf_counter()
    response = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
    return response.status_code, time.perf_counter() - start


async def run_load(
    url: str, rate: float, seconds: float, prompt: str, slo: float, seed: int
) -> dict[str, float]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        at = 0.0
        while at < seconds:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(client, prompt)))
            at += rng.expovariate(rate)
        results = await asyncio.gather(*tasks)
    ok = sorted(t for status, t in results if status == 200)
    good = sum(1 for t in ok if t <= slo)
    refused = sum(1 for status, _ in results if status == 503)
    return {
        "sent": len(results),
        "good": good,
        "goodput": good / seconds,
        "refused": refused,
        "p99": ok[min(len(ok) - 1, int(0.99 * len(ok)))] if ok else float("nan"),
    }


async def measure(args: argparse.Namespace) -> list[dict[str, object]]:
    engine = DemoEngine(MODEL, max_context=4096, token_delay=args.token_delay)
    worker = WorkerServer(engine)
    await worker.start()
    service = args.tokens * args.token_delay
    capacity = args.slots / service
    prompt = " ".join(["w"] * args.tokens)
    rows: list[dict[str, object]] = []
    try:
        for mode in ("off", "on"):
            queue = QueueConfig(max_wait=args.max_wait) if mode == "on" else None
            model = replace(ModelConfig(MODEL, workers=(worker.address,)), queue=queue)
            config = Config(
                host="127.0.0.1",
                port=0,
                log_level="warning",
                max_concurrent_requests=args.slots,
                models=(model,),
                queue=queue,
            )
            server = GatewayServer(config)
            await server.start()
            url = f"http://127.0.0.1:{server.port}"
            try:
                for i, load in enumerate(args.loads):
                    figures = await run_load(
                        url, load * capacity, args.seconds, prompt, args.slo, seed=i
                    )
                    rows.append({"load": load, "queue": mode, "capacity": capacity, **figures})
                    await asyncio.sleep(service * 2)  # the fleet empties between runs
            finally:
                await server.stop()
    finally:
        await worker.stop()
    return rows


def table(rows: list[dict[str, object]], slo: float) -> str:
    lines = [
        f"| offered load | queue | sent | answered within {slo:g} s | goodput (req/s) "
        "| refused (503) | p99 of answered (s) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        lines.append(
            f"| {row['load']:g}x | {row['queue']} | {row['sent']} | {row['good']} "
            f"| {row['goodput']:.1f} | {row['refused']} | {row['p99']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--token-delay", type=float, default=0.02)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--slo", type=float, default=2.0)
    parser.add_argument("--max-wait", type=float, default=1.0)
    parser.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.9, 1.2, 2.0, 3.0])
    parser.add_argument("--quick", action="store_true", help="3 s per load")
    args = parser.parse_args()
    if args.quick:
        args.seconds = 3.0
    rows = asyncio.run(measure(args))
    capacity = rows[0]["capacity"] if rows else 0
    print(
        f"capacity {capacity:g} req/s ({args.slots} slots, {args.tokens * args.token_delay:g} s "
        f"a request); SLO {args.slo:g} s; max_wait {args.max_wait:g} s"
    )
    print(table(rows, args.slo))


if __name__ == "__main__":
    main()
