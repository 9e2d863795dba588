"""What the Batch API costs against the same requests sent by a client: N chat requests
run as one batch (`/v1/files` + `/v1/batches`, polled until `completed`) against the same
N sent by an httpx client at the same concurrency (`batch_concurrency`), on one gateway
and one demo worker in processes of their own, rounds interleaved.

    .venv/bin/python -m benchmarks.bench_batches [--lines 2000] [--concurrency 16] [--rounds 3]

Reported per round and as the median: requests a second (the batch's from its creation
to `completed` as its poll sees it, every 50 ms), and the gateway process's CPU a request
(/proc), each with its ratio to the client's run. The batch's own work is reading and
checking its input, the lines' in-process calls and each answer's line written to the
store (memory here); the client's is HTTP in and out of the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import yaml

from benchmarks.bench_gateway import (
    HOST,
    _gateway_ready,
    _port_open,
    _spawn,
    _stop,
    _wait_until,
    free_ports,
    process_cpu,
)

MODEL = "bench-demo"


@contextlib.contextmanager
def _servers(concurrency: int) -> Iterator[tuple[int, int]]:
    """A demo worker and a gateway in front of it; the gateway's port and pid."""
    worker_port, port = free_ports(2)
    with contextlib.ExitStack() as stack:
        worker = _spawn(
            [
                *("-m", "gateway", "worker", "--engine", "demo"),
                "--port",
                str(worker_port),
                "--model",
                MODEL,
            ]
        )
        stack.callback(_stop, worker)
        _wait_until(lambda: _port_open(worker_port), "the worker", worker)
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="furnace-bench-"))
        config = Path(folder) / "gateway.yaml"
        settings = {
            "host": HOST,
            "port": port,
            "log_level": "warning",
            "max_concurrent_requests": 4 * concurrency,
            "batch_concurrency": concurrency,
            "models": [{"name": MODEL, "workers": [f"{HOST}:{worker_port}"]}],
        }
        config.write_text(yaml.safe_dump(settings))
        gateway = _spawn(["-m", "gateway", "serve", "--config", str(config)])
        stack.callback(_stop, gateway)
        _wait_until(lambda: _gateway_ready(port), "the gateway", gateway)
        yield port, gateway.pid


def _body(i: int) -> dict[str, object]:
    content = f"request {i} asks for a short answer of a few words"
    return {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": content}]}


async def _client(url: str, lines: int, concurrency: int) -> float:
    """The requests sent by a client, `concurrency` at a time; seconds taken."""
    todo = iter(range(lines))
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:

        async def sender() -> None:
            for i in todo:
                answer = await http.post("/v1/chat/completions", json=_body(i))
                answer.raise_for_status()

        start = time.perf_counter()
        await asyncio.gather(*(sender() for _ in range(concurrency)))
        return time.perf_counter() - start


async def _batch(url: str, lines: int) -> float:
    """The requests as one batch; seconds from its creation to `completed`."""
    content = b"".join(
        orjson.dumps(
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions"}
            | {"body": _body(i)}
        )
        + b"\n"
        for i in range(lines)
    )
    headers = {"authorization": "Bearer none"}
    async with httpx.AsyncClient(base_url=url, timeout=60, headers=headers) as http:
        upload = await http.post(
            "/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"}
        )
        upload.raise_for_status()
        start = time.perf_counter()
        created = await http.post(
            "/v1/batches",
            json={
                "input_file_id": upload.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
            },
        )
        created.raise_for_status()
        batch_id = created.json()["id"]
        while True:
            await asyncio.sleep(0.05)
            batch = (await http.get(f"/v1/batches/{batch_id}")).json()
            if batch["status"] in ("completed", "failed", "expired", "cancelled"):
                break
        seconds = time.perf_counter() - start
        counts = batch["request_counts"]
        if batch["status"] != "completed" or counts["completed"] != lines:
            raise RuntimeError(f"the batch ended {batch['status']}: {counts}")
        return seconds


def _cpu(pid: int) -> float:
    used = process_cpu(pid)
    if used is None:
        raise RuntimeError("no CPU figures in /proc for the gateway")
    return used


async def main(lines: int, concurrency: int, rounds: int) -> None:
    with _servers(concurrency) as (port, pid):
        url = f"http://{HOST}:{port}"
        await _client(url, 200, concurrency)  # warm up both paths
        await _batch(url, 200)
        results: dict[str, list[tuple[float, float]]] = {"client": [], "batch": []}
        for round_ in range(1, rounds + 1):
            for name in ("client", "batch"):
                before = _cpu(pid)
                if name == "client":
                    seconds = await _client(url, lines, concurrency)
                else:
                    seconds = await _batch(url, lines)
                cpu = (_cpu(pid) - before) / lines
                results[name].append((lines / seconds, cpu))
                print(
                    f"round {round_} {name:>6}: {lines / seconds:8.0f} requests/s, "
                    f"gateway CPU {cpu * 1e6:6.0f} µs a request"
                )
    rate = {n: statistics.median(r for r, _ in v) for n, v in results.items()}
    cpu = {n: statistics.median(c for _, c in v) for n, v in results.items()}
    print(
        f"\nmedian of {rounds} rounds, {lines} requests, {concurrency} at a time:\n"
        f"  client: {rate['client']:.0f} requests/s, {cpu['client'] * 1e6:.0f} µs a request\n"
        f"  batch:  {rate['batch']:.0f} requests/s, {cpu['batch'] * 1e6:.0f} µs a request\n"
        f"  batch ÷ client: requests/s x{rate['batch'] / rate['client']:.2f}, "
        f"CPU a request x{cpu['batch'] / cpu['client']:.2f}"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.lines, args.concurrency, args.rounds))
