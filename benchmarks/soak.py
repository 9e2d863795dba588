"""Soak: mixed good and hostile traffic against one gateway for a fixed time,
watching that what the gateway holds stays flat.

    .venv/bin/python benchmarks/soak.py --seconds 60

It starts the gateway and the demo workers in this process (the helpers of
tests/support/servers.py, on their own event loop thread) and runs, on loopback
only, for `--seconds`:

- good clients: streamed chat on the demo model, timing the first token (TTFT);
- slow-loris connections that send a header byte a second;
- stalled readers: streams on the slow model whose answer is never read;
- requests with oversized headers (431) and bad bodies (400);
- clients that disconnect after the first event of a slow stream;
- hostile stop strings: four of 1,024 characters that nearly match a long answer.

Every 10 s it prints this process's RSS and open fds (the gateway's, plus the
bounded, fixed number of client sockets) and the good clients' p50/p99 TTFT,
then a summary. Any 5xx is counted and fails the run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import contextlib

from gateway.bench.stats import percentile
from gateway.worker.demo import DEMO_MODEL
from tests.support.process_usage import MIB, open_fds, rss_bytes
from tests.support.servers import (
    ServerLoop,
    make_config,
    start_gateway,
    start_workers,
)

GOOD_CLIENTS = 8
HOSTILE_EACH = 4  # connections of each hostile kind at once
PRINT_EVERY = 10.0
BAD_BODIES = [
    b"[]",
    b'{"model": "furnace-demo", "messages": "hi"}',
    b'{"model": "furnace-demo", "prompt": "x", "temperature": "NaN"}',
    b'{"model": "furnace-demo", "prompt": "x", "max_tokens": 100000000000000000000}',
    b'{"model": "furnace-demo", "prompt": "x", "stop": [1, 2]}',
    b'{"model": "furnace-demo", "prompt": "\\ud800"}',
    b'{"model": [[[[]]]], "prompt": "x"}',
]
STOPS = ["a" * 1023 + end for end in "bcde"]


@dataclass
class Tally:
    """What the clients saw; the window's TTFTs are reset at each print."""

    ttft: list[float] = field(default_factory=list)
    all_ttft: list[float] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)


async def good_client(url: str, until: float, tally: Tally, rng: random.Random) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        while time.monotonic() < until:
            words = " ".join(f"w{rng.randrange(1000)}" for _ in range(20))
            body = {"model": DEMO_MODEL, "messages": [{"role": "user", "content": words}]}
            start = time.perf_counter()
            first: float | None = None
            async with http.stream(
                "POST", "/v1/chat/completions", json={**body, "stream": True}
            ) as response:
                tally.counts[f"good {response.status_code}"] += 1
                async for line in response.aiter_lines():
                    if first is None and '"content"' in line:
                        first = time.perf_counter() - start
            if first is not None:
                tally.ttft.append(first)
                tally.all_ttft.append(first)


async def _raw(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    return await asyncio.open_connection(host, int(port))


async def _closed(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def slow_loris(url: str, until: float, tally: Tally) -> None:
    while time.monotonic() < until:
        reader, writer = await _raw(url)
        try:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n")
            while time.monotonic() < until and not reader.at_eof():
                writer.write(b"x")
                await writer.drain()
                try:
                    await asyncio.wait_for(reader.read(4096), 1.0)
                except TimeoutError:
                    continue
            tally.counts["loris cut"] += 1
        except OSError:
            tally.counts["loris cut"] += 1
        finally:
            await _closed(writer)


def _request(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (
        b"POST %s HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"%scontent-length: %d\r\n\r\n%s" % (path.encode(), extra, len(body), body)
    )


async def stalled_reader(url: str, until: float, tally: Tally) -> None:
    prompt = " ".join(["word"] * 2000)
    body = json.dumps({"model": "furnace-slow", "prompt": prompt, "stream": True}).encode()
    while time.monotonic() < until:
        _, writer = await _raw(url)
        writer.write(_request("/v1/completions", body))
        await asyncio.sleep(min(5.0, max(0.0, until - time.monotonic())))  # read nothing
        tally.counts["stalled"] += 1
        await _closed(writer)


async def oversized_headers(url: str, until: float, tally: Tally) -> None:
    big = b"x-big: " + b"a" * (256 * 1024) + b"\r\n"
    while time.monotonic() < until:
        reader, writer = await _raw(url)
        try:
            writer.write(_request("/v1/completions", b"{}", big))
            status = (await asyncio.wait_for(reader.readline(), 30)).split(b" ")[1:2]
            tally.counts[f"big headers {status[0].decode() if status else 'closed'}"] += 1
        except (OSError, TimeoutError):
            tally.counts["big headers closed"] += 1
        finally:
            await _closed(writer)
        await asyncio.sleep(0.05)


async def bad_bodies(url: str, until: float, tally: Tally, rng: random.Random) -> None:
    headers = {"content-type": "application/json"}
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        while time.monotonic() < until:
            path = rng.choice(("/v1/completions", "/v1/chat/completions"))
            response = await http.post(path, content=rng.choice(BAD_BODIES), headers=headers)
            tally.counts[f"bad body {response.status_code}"] += 1
            await asyncio.sleep(0.01)


async def disconnecting(url: str, until: float, tally: Tally) -> None:
    body = {"model": "furnace-slow", "prompt": " ".join(["word"] * 400), "stream": True}
    while time.monotonic() < until:
        async with (
            httpx.AsyncClient(base_url=url, timeout=30) as http,
            http.stream("POST", "/v1/completions", json=body) as response,
        ):
            async for _ in response.aiter_lines():
                break  # go away after the first event
        tally.counts[f"disconnect {response.status_code}"] += 1


async def hostile_stops(url: str, until: float, tally: Tally) -> None:
    prompt = " ".join(["a" * 8000] * 40)
    body = {"model": DEMO_MODEL, "prompt": prompt, "stop": STOPS}
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        while time.monotonic() < until:
            response = await http.post("/v1/completions", json=body)
            tally.counts[f"stops {response.status_code}"] += 1


def _ms(values: list[float], q: float) -> str:
    return f"{percentile(values, q) * 1000:.1f}" if values else "-"


async def reporter(until: float, start: float, tally: Tally, rows: list[str]) -> None:
    while time.monotonic() < until:
        await asyncio.sleep(min(PRINT_EVERY, max(0.0, until - time.monotonic())))
        window, tally.ttft = tally.ttft, []
        row = (
            f"{time.monotonic() - start:6.0f} {rss_bytes() / MIB:8.1f} {open_fds():6d} "
            f"{len(window):7d} {_ms(window, 50):>9} {_ms(window, 99):>9}"
        )
        rows.append(row)
        print(row, flush=True)


async def soak(url: str, seconds: float) -> Tally:
    tally = Tally()
    rng = random.Random(1)
    start = time.monotonic()
    until = start + seconds
    rows: list[str] = []
    print("     s  RSS MiB    fds    good  p50 TTFT  p99 TTFT (ms)", flush=True)
    tasks = [good_client(url, until, tally, random.Random(i)) for i in range(GOOD_CLIENTS)]
    for _ in range(HOSTILE_EACH):
        tasks += [
            slow_loris(url, until, tally),
            stalled_reader(url, until, tally),
            oversized_headers(url, until, tally),
            bad_bodies(url, until, tally, rng),
            disconnecting(url, until, tally),
            hostile_stops(url, until, tally),
        ]
    await asyncio.gather(reporter(until, start, tally, rows), *tasks)
    return tally


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0, help="how long to run")
    args = parser.parse_args()
    server_loop = ServerLoop()
    workers = server_loop.call(start_workers())
    gateway = start_gateway(server_loop, make_config(workers))
    fds_before, rss_before = open_fds(), rss_bytes()
    try:
        tally = asyncio.run(soak(gateway.url, args.seconds))
    finally:
        gateway.stop()
        for server in (workers.demo, workers.slow, workers.scripted):
            server_loop.call(server.stop())
        server_loop.close()
    state = gateway.state
    errors_5xx = sum(n for k, n in tally.counts.items() if k.split()[-1].startswith("5"))
    print("summary:")
    print(
        f"  RSS {rss_before / MIB:.1f} -> {rss_bytes() / MIB:.1f} MiB, fds {fds_before} -> ", end=""
    )
    print(f"{open_fds()} (after stopping)")
    every = tally.all_ttft
    print(f"  good streams {len(every)}: TTFT p50 {_ms(every, 50)} ms, p99 {_ms(every, 99)} ms")
    for name, count in sorted(tally.counts.items()):
        print(f"  {name}: {count}")
    print(f"  slots in use at the end: {state.slots.in_use}; 5xx seen: {errors_5xx}")
    return 1 if errors_5xx else 0


if __name__ == "__main__":
    sys.exit(main())
