"""The fleet benchmark: what a second worker adds, and what more workers cost.

Run: `.venv/bin/python -m benchmarks.bench_fleet [--quick]` (`make bench-fleet`).

1. Streamed tokens per second with two workers against one, in the same run.
   Each demo worker stands in for a GPU: a fixed pace per token and a fixed
   number of sequences at once (`--capacity`), so one worker has a ceiling and a
   second one should double it if the gateway spreads the load well.
2. The gateway's CPU per request with 1 worker against 8: the fleet's own
   bookkeeping (balancing, health watches, channels) as the fleet grows.

Workers, the gateway and the load generator (`furnace-gateway bench`) are
separate processes; the gateway's CPU is read from /proc.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

import httpx

from tests.support.processes import free_port, running, wait_ready, worker_process

PACE = 0.01  # seconds per token: 100 tokens/s per sequence
CAPACITY = 8  # sequences per worker at once


def cpu_seconds(pid: int) -> float:
    """User plus system CPU of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench(url: str, **options: object) -> dict:
    """One `furnace-gateway bench` run; its JSON report."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        args = [sys.executable, "-m", "gateway", "bench", "--base-url", url, "--json", out.name]
        args += ["--no-progress"]
        for name, value in options.items():
            flag = "--" + name.replace("_", "-")
            args += [flag] if value is True else [flag, str(value)]
        subprocess.run(args, check=True, stdout=subprocess.DEVNULL)
        return json.loads(Path(out.name).read_text())


def fleet(stack: ExitStack, workers: int, tmp: Path, *worker_args: str) -> tuple[str, int]:
    """Starts `workers` demo workers and a gateway over them; its URL and pid."""
    ports = [free_port() for _ in range(workers)]
    for port in ports:
        stack.enter_context(worker_process(port, "--model", "m", *worker_args))
    port = free_port()
    config = tmp / f"fleet-{workers}-{port}.yaml"
    addresses = ", ".join(f"'127.0.0.1:{p}'" for p in ports)
    config.write_text(
        f"host: 127.0.0.1\nport: {port}\nlog_level: warning\n"
        f"models:\n  - name: m\n    workers: [{addresses}]\n"
    )
    gateway = stack.enter_context(running("serve", "--config", str(config)))
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, gateway)
    return url, gateway.pid


def scaling(tmp: Path, requests: int) -> list[dict]:
    """Tokens per second through one paced worker, then two."""
    rows = []
    for workers in (1, 2):
        with ExitStack() as stack:
            paced = ("--token-delay", str(PACE), "--capacity", str(CAPACITY))
            url, _ = fleet(stack, workers, tmp, *paced)
            report = bench(
                url,
                concurrency=CAPACITY * workers,
                num_requests=requests * workers,
                input_len=100,
                output_len=100,
            )
            rows.append({"workers": workers, **report})
    return rows


def cpu_per_request(tmp: Path, requests: int) -> list[dict]:
    """The gateway's CPU per short request with 1 worker, then 8."""
    rows = []
    for workers in (1, 8):
        with ExitStack() as stack:
            url, pid = fleet(stack, workers, tmp)
            bench(url, concurrency=16, num_requests=50, input_len=16, output_len=16)  # warm up
            before = cpu_seconds(pid)
            report = bench(url, concurrency=16, num_requests=requests, input_len=16, output_len=16)
            used = cpu_seconds(pid) - before
            spread = httpx.get(url + "/admin/workers").json()["models"][0]["workers"]
            rows.append(
                {
                    "workers": workers,
                    "cpu_ms_per_request": 1000 * used / requests,
                    "errors": report.get("errors", {}),
                    "workers_used": sum(1 for w in spread if w["state"] == "healthy"),
                }
            )
    return rows


def main() -> None:
    """Runs both parts and prints a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests (~30 s)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args()
    n = 40 if args.quick else 120
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        scale = scaling(tmp, n)
        cpu = cpu_per_request(tmp, n * 10)
    one, two = (row["output_throughput"] for row in scale)
    print("| measure | 1 worker | 2 workers | ratio |")
    print("| --- | --- | --- | --- |")
    print(f"| streamed tokens/s (paced workers, {CAPACITY} sequences each) "
          f"| {one:,.0f} | {two:,.0f} | x{two / one:.2f} |")  # fmt: skip
    print()
    print("| measure | 1 worker | 8 workers | ratio |")
    print("| --- | --- | --- | --- |")
    a, b = (row["cpu_ms_per_request"] for row in cpu)
    print(f"| gateway CPU per request (ms) | {a:.3f} | {b:.3f} | x{b / a:.2f} |")
    errors = [row.get("errors") for row in scale + cpu if row.get("errors")]
    if errors:
        print(f"\nerrors: {errors}")
    if args.json:
        Path(args.json).write_text(json.dumps({"scaling": scale, "cpu": cpu}, indent=2))


if __name__ == "__main__":
    main()
