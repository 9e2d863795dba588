"""The HTTP client under raw upstreams and the load generator (`gateway.protocol.http1`,
httptools in the transport's callback) against httpx and aiohttp, to decide whether the
project keeps its own: the client's CPU per streamed answer and per SSE event.

Run: `.venv/bin/python -m benchmarks.bench_http_clients [--requests N --tokens T
--concurrency C --rounds R]` (about a minute with the defaults).

The engine is `benchmarks/fake_openai.py` in its own process (an SSE event per token,
each in its own send, as an engine writes them); this process only reads, so its CPU
time (`time.process_time`) is the client's. Each client streams the same completions,
`C` at a time, and counts the events of each answer (the bytes' `data:`), nothing
more; rounds are interleaved so that the machine's load falls on every client alike.
Printed: microseconds of CPU per answer and per event, each client's best round, and
its ratio to the project's client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager

import httpx
import orjson

from gateway.bench.http import HttpClient

Client = Callable[[bytes], Awaitable[int]]
Maker = Callable[[str], AbstractAsyncContextManager[Client]]
JSON_HEADER = "Content-Type: application/json\r\n"


def _body(tokens: int) -> bytes:
    words = " ".join(["tok"] * tokens)
    return orjson.dumps(
        {"model": "fake-engine", "prompt": words, "max_tokens": tokens, "stream": True}
    )


class _Count:
    """A `gateway.bench.http.Sink` that counts the events of an answer."""

    __slots__ = ("events", "status")

    def __init__(self) -> None:
        self.status = 0
        self.events = 0

    def start(self, status: int) -> None:
        self.status = status

    def feed(self, data: bytes) -> None:
        self.events += data.count(b"data:")


@contextlib.asynccontextmanager
async def http1(url: str) -> AsyncIterator[Client]:
    client = HttpClient(url)

    async def one(body: bytes) -> int:
        count = _Count()
        head = client.head(
            "POST", "/v1/completions", len(body), "Content-Type: application/json\r\n"
        )
        await client.send(head + body, count)
        assert count.status == 200, count.status
        return count.events

    try:
        yield one
    finally:
        client.close()


@contextlib.asynccontextmanager
async def httpx_client(url: str) -> AsyncIterator[Client]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:

        async def one(body: bytes) -> int:
            events = 0
            headers = {"Content-Type": "application/json"}
            async with client.stream("POST", "/v1/completions", content=body, headers=headers) as r:
                assert r.status_code == 200, r.status_code
                async for chunk in r.aiter_raw():
                    events += chunk.count(b"data:")
            return events

        yield one


@contextlib.asynccontextmanager
async def aiohttp_client(url: str) -> AsyncIterator[Client]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    async with aiohttp.ClientSession(url, connector=connector) as session:

        async def one(body: bytes) -> int:
            events = 0
            headers = {"Content-Type": "application/json"}
            async with session.post("/v1/completions", data=body, headers=headers) as r:
                assert r.status == 200, r.status
                async for chunk in r.content.iter_any():
                    events += chunk.count(b"data:")
            return events

        yield one


CLIENTS: dict[str, Maker] = {
    "furnace http1": http1,
    "httpx": httpx_client,
    "aiohttp": aiohttp_client,
}


async def _round(
    make: Maker, url: str, body: bytes, requests: int, concurrency: int
) -> tuple[float, int]:
    """CPU seconds of this process and events read, for `requests` answers."""
    async with make(url) as one:
        await one(body)  # a warm connection and code path
        left = requests
        events = 0

        async def worker() -> None:
            nonlocal left, events
            while left > 0:
                left -= 1
                answered = await one(body)  # before the sum: `events` moves meanwhile
                events += answered

        start = time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.process_time() - start, events


def _available() -> dict[str, Maker]:
    clients = dict(CLIENTS)
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        print("aiohttp is not installed (pip install aiohttp): its row is left out")
        del clients["aiohttp"]
    return clients


@contextlib.contextmanager
def _engine(port: int) -> Iterator[str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.fake_openai", "--port", str(port)],
        stdout=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        yield url
    finally:
        process.terminate()
        process.wait(10)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def main(requests: int, tokens: int, concurrency: int, rounds: int) -> None:
    clients = _available()
    body = _body(tokens)
    best: dict[str, tuple[float, float]] = {}
    with _engine(_free_port()) as url:
        for number in range(rounds):
            for name, make in clients.items():
                cpu, events = await _round(make, url, body, requests, concurrency)
                per_answer, per_event = cpu / requests * 1e6, cpu / max(events, 1) * 1e6
                print(
                    f"round {number + 1} {name:14} {per_answer:8.1f} us/answer "
                    f"{per_event:6.2f} us/event ({events / requests:.0f} events an answer)"
                )
                if name not in best or per_answer < best[name][0]:
                    best[name] = (per_answer, per_event)
    base = best["furnace http1"][0]
    print(f"\n{requests} streamed answers of {tokens} tokens, {concurrency} at a time; best round:")
    print("| client | CPU us per answer | CPU us per event | ÷ furnace http1 |")
    print("| --- | --- | --- | --- |")
    for name, (per_answer, per_event) in best.items():
        print(f"| {name} | {per_answer:.0f} | {per_event:.2f} | {per_answer / base:.2f} |")


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.tokens, args.concurrency, args.rounds))


if __name__ == "__main__":
    cli()
