"""The gateway's peak memory under the three attacks of issue 25's High findings,
each against a fresh demo gateway (`furnace-gateway demo`, the gateway and its
embedded demo worker in one process), started as a subprocess:

    .venv/bin/python benchmarks/bench_attacks.py [--root TREE] [--seconds 15]

1. pipelining: one connection writes 1,000 `GET /v1/models` per write and never
   reads its answers, for `--seconds`;
2. multiplexing: 4 small streams run while `--big` (24) chat requests of 4 MB
   each arrive at once (together over gRPC's 64 MiB message cap), with the start,
   body and request timeouts raised to 300 s (on a loaded 2-core machine one 4 MB
   request takes 1-10 s to start); it reports how the streams and requests ended;
3. n x max_tokens x logprobs: one non-streamed request with `n` 128, `max_tokens`
   1,000 and `top_logprobs` 20; then one within the bound (`n` 8).

For each: the process's resident memory before (after one warm-up request) and
its peak (VmHWM, the kernel's high-water mark for the process), and what the
clients saw. `--root` runs another checkout's gateway (an older commit's, for a
before-and-after): the subprocess runs from that tree.

A benchmark, not a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
MIB = 1024 * 1024


def _status(pid: int, field: str) -> int:
    """A `VmRSS`/`VmHWM` line of /proc/PID/status, in bytes."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Demo:
    """A `furnace-gateway demo` process of the tree `root`."""

    def __init__(self, root: Path, *options: str, env: dict[str, str] | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(root), "FURNACE_LOG_LEVEL": "warning", **(env or {})}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gateway", "demo", "--port", str(self.port), *options],
            cwd=root,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        give_up = time.monotonic() + 60
        while time.monotonic() < give_up:
            try:
                if httpx.get(f"{self.url}/ready", timeout=1).is_success:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        else:
            self.stop()
            raise SystemExit("the demo gateway did not become ready in 60 s")
        body = {"messages": [{"role": "user", "content": "warm up"}]}
        httpx.post(f"{self.url}/v1/chat/completions", json=body, timeout=30)
        self.before = _status(self.process.pid, "VmRSS")

    def peak(self) -> int:
        return _status(self.process.pid, "VmHWM")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def pipelining(demo: Demo, args: argparse.Namespace) -> str:
    """One connection, 1,000 `GET /v1/models` per write, never read."""
    flood = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n\r\n" * 1000
    sock = socket.create_connection(("127.0.0.1", demo.port))
    sock.setblocking(False)
    written, closed = 0, "no"
    seconds = args.seconds
    give_up = time.monotonic() + seconds
    while time.monotonic() < give_up:
        try:
            written += sock.send(flood)
        except BlockingIOError:
            time.sleep(0.005)
        except (BrokenPipeError, ConnectionResetError):
            closed = f"after {time.monotonic() - give_up + seconds:.1f} s"
            break
    sock.close()
    return f"{written / MIB:.0f} MiB of requests written; connection closed: {closed}"


async def _multiplexing(url: str, count: int) -> str:
    small = {
        "messages": [{"role": "user", "content": "a b c"}],
        "stream": True,
        "max_tokens": 400,
        "ignore_eos": True,
    }
    big = {"messages": [{"role": "user", "content": "x" * 4_000_000}], "max_tokens": 1}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def stream() -> str:
            text = ""
            async with client.stream("POST", "/v1/chat/completions", json=small) as response:
                async for line in response.aiter_lines():
                    text += line
            if response.status_code != 200:
                return f"{response.status_code}"
            return "cut: engine_error" if "engine_error" in text else "whole"

        async def request() -> str:
            response = await client.post("/v1/chat/completions", json=big)
            if response.status_code == 200:
                return "200"
            return f"{response.status_code} {response.json()['error'].get('code')}"

        streams = [asyncio.create_task(stream()) for _ in range(4)]
        await asyncio.sleep(0.3)  # the streams run
        bigs = await asyncio.gather(*(request() for _ in range(count)))
        smalls = await asyncio.gather(*streams)
        after = await client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        )
    return (
        f"4 streams: {dict(Counter(smalls))}; {count} x 4 MB: {dict(Counter(bigs))}; "
        f"a request after: {after.status_code}"
    )


def multiplexing(demo: Demo, args: argparse.Namespace) -> str:
    return asyncio.run(_multiplexing(demo.url, args.big))


def logprobs(demo: Demo, args: argparse.Namespace) -> str:
    outcomes = []
    for n in (128, 8):
        body = {
            "messages": [{"role": "user", "content": "one two three"}],
            "n": n,
            "max_tokens": 1000,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 20,
        }
        started = time.monotonic()
        response = httpx.post(f"{demo.url}/v1/chat/completions", json=body, timeout=600)
        took = time.monotonic() - started
        if response.status_code == 200:
            outcomes.append(f"n {n}: 200, {len(response.content) / MIB:.0f} MiB in {took:.1f} s")
        else:
            error = response.json()["error"]
            outcomes.append(f"n {n}: {response.status_code} (param {error.get('param')})")
    return "; ".join(outcomes)


_SLOW_STARTS = {"FURNACE_START_TIMEOUT": "300", "FURNACE_BODY_TIMEOUT": "300"}
ATTACKS = {
    "pipelining": (pipelining, (), {}),
    "multiplexing": (
        multiplexing,
        ("--token-delay", "0.005", "--max-context", "100000"),
        _SLOW_STARTS,
    ),
    "n x max_tokens x logprobs": (logprobs, (), {}),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to run")
    parser.add_argument("--seconds", type=float, default=15.0, help="the pipelining flood's")
    parser.add_argument("--big", type=int, default=24, help="4 MB requests at once")
    parser.add_argument("--only", choices=list(ATTACKS), help="run one attack")
    args = parser.parse_args()
    rows = []
    for name, (attack, options, env) in ATTACKS.items():
        if args.only and name != args.only:
            continue
        demo = Demo(args.root.resolve(), *options, env=env)
        try:
            seen = attack(demo, args)
            time.sleep(0.5)
            rows.append((name, demo.before, demo.peak(), seen))
        finally:
            demo.stop()
        print(f"{name}: {demo.before / MIB:.0f} -> peak {rows[-1][2] / MIB:.0f} MiB; {seen}")
    print(json.dumps([{"attack": r[0], "rss_mib": r[1] // MIB, "peak_mib": r[2] // MIB,
                       "seen": r[3]} for r in rows]))  # fmt: skip


if __name__ == "__main__":
    main()
