"""A small HTTP/1.1 client for load generation, over the gateway's own pooled
connections (`gateway.protocol.http1`: httptools inside the transport's callback).

httpx spends about 2 ms of CPU per streamed request on a small machine, which a
benchmark on the same machine would count against the server. Here a response is
handed straight to the request's `Sink`: no task switch, queue or copy per chunk.
Connections are kept alive and reused; http and https, nothing else (no redirects,
no proxies).
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Protocol
from urllib.parse import urlsplit

from gateway.protocol.http1 import Connection, Pool


class TransportError(Exception):
    """The request did not get a whole response: refused, reset, or malformed.
    `kind` names the failure without its details (`ConnectionRefusedError`)."""

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


class Sink(Protocol):
    """Where a response goes as it arrives."""

    def start(self, status: int) -> None:
        """The status line and headers are in."""

    def feed(self, data: bytes) -> None:
        """A piece of the body (chunked encoding already undone)."""


class Collect:
    """A `Sink` that keeps the whole body."""

    def __init__(self) -> None:
        self.status = 0
        self.chunks: list[bytes] = []

    def start(self, status: int) -> None:
        """Keeps the status."""
        self.status = status

    def feed(self, data: bytes) -> None:
        """Keeps the piece."""
        self.chunks.append(data)

    @property
    def body(self) -> bytes:
        """The body so far."""
        return b"".join(self.chunks)


class _Exchange:
    """One request's response: the connection's callbacks fed to its `Sink`, and
    its end told to the task that sent it."""

    __slots__ = ("done", "sink")

    def __init__(self, sink: Sink, done: asyncio.Future[None]) -> None:
        self.sink = sink
        self.done = done

    def head(self, status: int) -> None:
        self.sink.start(status)

    def body(self, data: bytes) -> None:
        self.sink.feed(data)

    def read(self) -> None:
        pass

    def complete(self, connection: Connection) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def broken(self, kind: str, detail: str) -> None:
        if not self.done.done():
            self.done.set_exception(TransportError(kind, detail))


class HttpClient:
    """Requests to one server over a pool of kept-alive connections (one per
    request in flight; idle ones are reused)."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None) -> None:
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http:// or https:// URL: {base_url!r}")
        self.host = url.hostname
        self.port = url.port or (443 if url.scheme == "https" else 80)
        self.path = url.path.rstrip("/")
        tls = ssl.create_default_context() if url.scheme == "https" else None
        default_port = self.port == (443 if url.scheme == "https" else 80)
        host = self.host if default_port else f"{self.host}:{self.port}"
        lines = [f"Host: {host}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
        self._headers = "".join(f"{line}\r\n" for line in lines)
        self._pool = Pool(self.host, self.port, tls)

    def head(self, method: str, path: str, length: int | None = None, extra: str = "") -> bytes:
        """The request line and headers for `path` under the base URL; `extra`: more
        header lines, each ending in CRLF."""
        body = "" if length is None else f"Content-Length: {length}\r\n"
        head = f"{method} {self.path}{path} HTTP/1.1\r\n{self._headers}{extra}{body}\r\n"
        return head.encode()

    async def send(self, request: bytes, sink: Sink) -> None:
        """Sends `request` (from `head` and a body) on an idle connection, or a
        new one, and feeds the response to `sink`. Raises `TransportError`; a
        cancelled wait drops the connection, so the server sees the client leave."""
        try:
            connection = await self._pool.take()
        except OSError as error:
            raise TransportError(type(error).__name__, str(error)) from error
        done = asyncio.get_running_loop().create_future()
        connection.send(request, _Exchange(sink, done))
        try:
            await done
        except BaseException:
            self._pool.drop(connection)
            raise
        self._pool.give_back(connection)

    async def get(self, path: str) -> tuple[int, bytes]:
        """A GET's status and body."""
        sink = Collect()
        await self.send(self.head("GET", path), sink)
        return sink.status, sink.body

    def close(self) -> None:
        """Drops every connection."""
        self._pool.close()
