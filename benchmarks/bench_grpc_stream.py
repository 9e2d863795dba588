"""The gateway's CPU a message of a server stream: grpc.aio's reader against the
gateway's own HTTP/2 client (`gateway.protocol.grpc_h2`, how `upstream: vllm-grpc`
reads `Generate`), in one run, rounds interleaved.

A grpc.aio server in a process of its own streams small messages (30 bytes, a
token's message of vLLM's) paced like an engine's steps (`--interval`, 10 ms by
default), to 1 and to 8 concurrent streams; each client runs on uvloop, as the
gateway does, and counts its process's CPU over the whole run. At one stream most of
a message's cost is waking the loop after the pause (a bare asyncio read of the same
pacing is printed as the floor); at eight the wake-ups are shared. With `--tls` the
server serves TLS (a certificate of a CA made for the run) and both clients trust it, as
with `worker_tls`.

    .venv/bin/python -m benchmarks.bench_grpc_stream [--messages 64] [--rounds 3] [--tls]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import uvloop

from gateway.protocol.grpc_h2 import ServerStream, StreamChannel
from gateway.protocol.tls import WorkerCredentials, client_credentials

METHOD = "/bench.Stream/Tokens"
PAYLOAD = b"\x12\x1c" + b"x" * 28


def serve(port: int, messages: int, interval: float, cert: str = "", key: str = "") -> None:
    """The paced grpc.aio server (run in a child process); over TLS with `cert`."""

    async def tokens(request: bytes, context: Any) -> AsyncIterator[bytes]:
        for _ in range(messages):
            await asyncio.sleep(interval)
            yield PAYLOAD

    async def main() -> None:
        server = grpc.aio.server()
        handler = grpc.method_handlers_generic_handler(
            "bench.Stream", {"Tokens": grpc.unary_stream_rpc_method_handler(tokens)}
        )
        server.add_generic_rpc_handlers((handler,))
        if cert:
            pair = (Path(key).read_bytes(), Path(cert).read_bytes())  # noqa: ASYNC240
            server.add_secure_port(f"127.0.0.1:{port}", grpc.ssl_server_credentials([pair]))
        else:
            server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    uvloop.run(main())


async def _measure(
    start: Callable[[], ServerStream[bytes]], streams: int, requests: int
) -> tuple[int, float]:
    """Messages read and the process's CPU over `requests` rounds of `streams` calls."""

    async def one() -> int:
        call, count = start(), 0
        while await call.read() is not grpc.aio.EOF:
            count += 1
        return count

    await one()
    begin, total = time.process_time(), 0
    for _ in range(requests):
        total += sum(await asyncio.gather(*(one() for _ in range(streams))))
    return total, time.process_time() - begin


Tls = WorkerCredentials | None


async def _aio(address: str, tls: Tls, streams: int, requests: int) -> tuple[int, float]:
    channel = (
        grpc.aio.insecure_channel(address)
        if tls is None
        else grpc.aio.secure_channel(address, tls.credentials, tls.options)
    )
    async with channel:
        method: Any = channel.unary_stream(METHOD)
        return await _measure(lambda: method(b""), streams, requests)


async def _native(address: str, tls: Tls, streams: int, requests: int) -> tuple[int, float]:
    channel = StreamChannel(address, None if tls is None else tls.context)
    try:
        return await _measure(
            lambda: channel.unary_stream(METHOD, b"", bytes, 60.0), streams, requests
        )
    finally:
        await channel.close()


def _pace(sock: socket.socket, messages: int, interval: float) -> None:
    """The floor's writer (a child process): the payload every `interval` s."""
    for _ in range(messages):
        time.sleep(interval)
        sock.send(PAYLOAD)
    time.sleep(0.2)


async def _read_bare(sock: socket.socket, messages: int) -> tuple[int, float]:
    arrived: asyncio.Queue[int] = asyncio.Queue()

    class Reader(asyncio.Protocol):
        def data_received(self, data: bytes) -> None:
            arrived.put_nowait(len(data))

    transport, _ = await asyncio.get_running_loop().create_connection(Reader, sock=sock)
    start, got, reads = time.process_time(), 0, 0
    while got < messages * len(PAYLOAD):
        got += await arrived.get()
        reads += 1
    spent = time.process_time() - start
    transport.close()
    return reads, spent


def bare(messages: int, interval: float) -> tuple[int, float]:
    """The floor: a plain asyncio protocol reading the same pacing from a socket pair."""
    mine, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child only writes
        mine.close()
        _pace(theirs, messages, interval)
        os._exit(0)
    theirs.close()
    try:
        return uvloop.run(_read_bare(mine, messages))
    finally:
        os.waitpid(pid, 0)


CLIENTS = {"grpc.aio": _aio, "furnace h2": _native}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=64, help="messages a stream")
    parser.add_argument("--interval", type=float, default=0.01, help="seconds between them")
    parser.add_argument("--requests", type=int, default=6, help="calls a client, per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tls", action="store_true", help="the calls over TLS")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        tls, served = _certificates(Path(folder)) if args.tls else (None, ("", ""))
        _run(args, tls, served)


def _certificates(folder: Path) -> tuple[WorkerCredentials, tuple[str, str]]:
    """The clients' TLS and the server's certificate and key, of a CA made for the run."""
    from tests.support.certs import CertificateAuthority

    ca = CertificateAuthority(folder, "bench-ca")
    server = ca.issue("server", ips=("127.0.0.1",))
    return client_credentials(ca.ca_file), (server.cert_file, server.key_file)


def _run(args: argparse.Namespace, tls: Tls, served: tuple[str, str]) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = (
        "import sys; from benchmarks.bench_grpc_stream import serve; "
        "serve(int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), *sys.argv[4:])"
    )
    server = subprocess.Popen(
        [sys.executable, "-c", code, str(port), str(args.messages), str(args.interval), *served]
    )
    address = f"127.0.0.1:{port}"
    try:
        time.sleep(1.5)
        results: dict[tuple[str, int], list[float]] = {}
        for _ in range(args.rounds):
            for streams in (1, 8):
                for name, client in CLIENTS.items():
                    total, cpu = uvloop.run(client(address, tls, streams, args.requests))
                    results.setdefault((name, streams), []).append(cpu / total * 1e6)
            reads, cpu = bare(args.messages * args.requests, args.interval)
            results.setdefault(("bare asyncio read", 1), []).append(cpu / reads * 1e6)
    finally:
        server.terminate()
        server.wait()
    print(f"{args.messages} messages a stream, one every {args.interval * 1000:g} ms, ", end="")
    print(f"{args.rounds} rounds, {'TLS' if tls else 'cleartext'}, ", end="")
    print(f"load {os.getloadavg()[0]:.1f}")
    print("| client | streams | CPU µs a message, median | rounds |")
    print("| --- | ---: | ---: | --- |")
    for (name, streams), values in results.items():
        rounds = ", ".join(f"{v:.0f}" for v in values)
        print(f"| {name} | {streams} | {statistics.median(values):.0f} | {rounds} |")
    for streams in (1, 8):
        ratio = statistics.median(results[("grpc.aio", streams)]) / statistics.median(
            results[("furnace h2", streams)]
        )
        print(f"{streams} stream(s): grpc.aio's CPU a message is {ratio:.2f}x ours")


if __name__ == "__main__":
    main()
