"""Scripted HTTP/2 peers for the specs of our gRPC client (`gateway.protocol.grpc_h2`):
raw frames, and a loopback TCP server that answers a connection with given bytes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame: its 9-byte head, then `payload`."""
    return (
        len(payload).to_bytes(3, "big") + bytes((kind, flags)) + stream.to_bytes(4, "big") + payload
    )


@asynccontextmanager
async def scripted(answer: bytes, delay: float = 0.1) -> AsyncIterator[int]:
    """A TCP server on loopback (its port) that answers any connection with `answer`, in
    one write `delay` seconds after the client's first bytes (its preface: its call starts
    right after), then holds the connection open."""
    writers: list[asyncio.StreamWriter] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        await reader.read(1)
        await asyncio.sleep(delay)
        writer.write(answer)
        await writer.drain()
        await reader.read(1 << 20)

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()
