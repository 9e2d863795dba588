"""The floor under the gateway's HTTP edge: how fast can any gateway on uvicorn be?

Run: `.venv/bin/python -m benchmarks.bench_edge_floor [--rounds N] [--json PATH]`
(about 10 s).

Four servers, each its own process, measured by one uvloop client in one run:

- `direct`: the fake OpenAI engine of bench_peers (`benchmarks/fake_openai.py`);
- `bare TCP relay`: a uvloop process that pairs each client connection with one
  of its own to the engine and copies the bytes both ways, parsing nothing: what
  the extra hop costs (a read and a write each way, in Python) before any work;
- `uvicorn, no app work`: uvicorn with the gateway's own HTTP protocol and
  settings (`gateway.lifecycle.uvicorn_config`) serving an ASGI app that reads the
  body and answers one SSE chunk at once: no validation, no upstream. What it
  costs is what any gateway on this stack costs before it does anything;
- `furnace-gateway`: the gateway in front of that engine (`upstream: openai`).

Two figures each: the first data of a burst (32 kept-alive connections each send a
streamed chat request at the same moment, as each round of bench_peers' 32-stream
load does; p50 and p99 over the rounds), and the server's CPU per request over
sequential requests on one connection (from /proc). The ratios are against direct.
Issue 14 asks for TTFT at 32 streams within 2x of direct's: the second and third
rows show how much of that the hop and the HTTP server alone take on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, cast

import uvicorn
import uvloop
import yaml

from benchmarks.bench_gateway import _commit, _stop, free_ports, process_cpu
from benchmarks.bench_peers import HOST, _popen, wait_serving
from benchmarks.fake_openai import MODEL
from gateway.bench.stats import percentile
from gateway.config import Config
from gateway.lifecycle import uvicorn_config

STREAMS = 32
SEQUENTIAL = 2000
_CHUNK = (
    b'data: {"id":"chatcmpl-floor","object":"chat.completion.chunk","created":1,'
    b'"model":"fake-engine","choices":[{"index":0,"delta":{"content":"hi"},'
    b'"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n'
)
_BODY = json.dumps(
    {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "max_tokens": 1,
    }
).encode()
REQUEST = (
    b"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
    b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(_BODY), _BODY)
)
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]


async def no_work(
    scope: dict[str, Any],
    receive: Callable[[], Awaitable[dict[str, Any]]],
    send: Callable[[dict[str, Any]], Awaitable[None]],
) -> None:
    """Reads the body and answers one chunk: the least a streamed answer takes."""
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
    await send({"type": "http.response.body", "body": _CHUNK})


class _Upstream(asyncio.Protocol):
    """The relay's connection to the engine: what it reads goes to its client."""

    def __init__(self, client: asyncio.Transport) -> None:
        self.client = client

    def data_received(self, data: bytes) -> None:
        self.client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.close()


class _Relayed(asyncio.Protocol):
    """A client's connection to the relay: what it reads goes to its engine connection."""

    def __init__(self, engine_port: int) -> None:
        self.engine_port = engine_port
        self.upstream: asyncio.Transport | None = None
        self.early: list[bytes] = []  # read before the engine connection was up

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.opening = asyncio.get_running_loop().create_task(self._open())

    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        upstream, _ = await loop.create_connection(
            lambda: _Upstream(self.transport), HOST, self.engine_port
        )
        self.upstream = upstream
        for data in self.early:
            upstream.write(data)
        self.early.clear()

    def data_received(self, data: bytes) -> None:
        if self.upstream is None:
            self.early.append(data)
        else:
            self.upstream.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.upstream is not None:
            self.upstream.close()


async def _relay(port: int, engine_port: int) -> None:
    server = await asyncio.get_running_loop().create_server(
        lambda: _Relayed(engine_port), HOST, port
    )
    await server.serve_forever()


def serve_relay(port: int, engine_port: int) -> None:
    """The relay of the second row: bytes both ways, one engine connection per client's."""
    uvloop.run(_relay(port, engine_port))


def serve_no_work(port: int) -> None:
    """The uvicorn server of the third row, as the gateway configures it."""
    config = Config(host=HOST, port=port, log_level="warning")
    server = uvicorn.Server(uvicorn_config(config, no_work, HOST, port))
    uvloop.run(server.serve())


# --- the client ----------------------------------------------------------------------


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _answer(connection: Connection) -> float:
    """Sends the request; the seconds to its first data, after reading it whole."""
    reader, writer = connection
    start = time.perf_counter()
    writer.write(REQUEST)
    await reader.readuntil(b"data:")
    first = time.perf_counter() - start
    await reader.readuntil(b"0\r\n\r\n")  # the end of the chunked body
    return first


async def measure(port: int, pid: int | None, rounds: int) -> dict[str, float]:
    """Burst first-data p50/p99 (ms) and, for a process, its CPU per request (µs)."""
    connections = [await asyncio.open_connection(HOST, port) for _ in range(STREAMS)]
    try:
        for _ in range(3):  # warm: connections, caches, the gateway's pools
            await asyncio.gather(*map(_answer, connections))
        firsts: list[float] = []
        for _ in range(rounds):
            firsts += await asyncio.gather(*map(_answer, connections))
            await asyncio.sleep(0.01)  # the burst's streams end together; so does the round
        result = {"p50_ms": percentile(firsts, 50) * 1e3, "p99_ms": percentile(firsts, 99) * 1e3}
        if pid is not None:
            before = process_cpu(pid)
            for _ in range(SEQUENTIAL):
                await _answer(connections[0])
            after = process_cpu(pid)
            if before is not None and after is not None:
                result["cpu_us_per_request"] = (after - before) / SEQUENTIAL * 1e6
    finally:
        for _, writer in connections:
            writer.close()
    return result


# --- the run --------------------------------------------------------------------------


@contextlib.contextmanager
def servers() -> Iterator[dict[str, tuple[int, int]]]:
    """The four servers by row name: (port, pid); all stopped on exit."""
    engine_port, relay_port, floor_port, gateway_port = free_ports(4)
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="furnace-floor-")))
        started: dict[str, tuple[int, int]] = {}
        gateway_config = logs / "gateway.yaml"
        upstream = {
            "name": MODEL,
            "upstream": "openai",
            "workers": [f"http://{HOST}:{engine_port}/v1"],
        }
        gateway_config.write_text(
            yaml.safe_dump(
                {"host": HOST, "port": gateway_port, "log_level": "warning", "models": [upstream]}
            )
        )
        commands = {
            "direct": (engine_port, ["-m", "benchmarks.fake_openai", "--port", str(engine_port)]),
            "bare TCP relay": (
                relay_port,
                ["-m", "benchmarks.bench_edge_floor", "--relay", str(relay_port), str(engine_port)],
            ),
            "uvicorn, no app work": (
                floor_port,
                ["-m", "benchmarks.bench_edge_floor", "--serve", str(floor_port)],
            ),
            "furnace-gateway": (
                gateway_port,
                ["-m", "gateway", "serve", "--config", str(gateway_config)],
            ),
        }
        for name, (port, args) in commands.items():
            log = logs / f"{len(started)}.log"
            process = _popen([sys.executable, *args], log)
            stack.callback(_stop, process)
            if reason := wait_serving(name, process, port, log):
                raise RuntimeError(reason)
            started[name] = (port, process.pid)
        yield started


def render(results: dict[str, dict[str, float]]) -> str:
    direct = results["direct"]
    rows = [
        "| server | first data p50, burst of 32 | / direct's | p99 | CPU per request |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, figures in results.items():
        ratio = "-" if name == "direct" else f"{figures['p50_ms'] / direct['p50_ms']:.2f}x"
        cpu = figures.get("cpu_us_per_request")
        rows.append(
            f"| {name} | {figures['p50_ms']:.2f} ms | {ratio} | {figures['p99_ms']:.2f} ms | "
            f"{'-' if cpu is None else f'{cpu:.0f} µs'} |"
        )
    note = f"commit {_commit()}; CPU per request over {SEQUENTIAL:,} sequential requests"
    return "\n".join(rows) + f"\n\n{note} on one connection.\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=100, help="bursts per server")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--relay", type=int, nargs=2, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve_no_work(args.serve)
        return 0
    if args.relay is not None:
        serve_relay(*args.relay)
        return 0
    with servers() as started:
        results = {
            name: uvloop.run(measure(port, pid, args.rounds))
            for name, (port, pid) in started.items()
        }
    print(render(results))
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
