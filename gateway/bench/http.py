"""A small HTTP/1.1 client for load generation: asyncio protocols over httptools.

httpx spends about 2 ms of CPU per streamed request on a small machine, which a
benchmark on the same machine would count against the server. Here a response is
parsed by httptools inside the transport's callback and handed straight to the
request's `Sink`: no task switch, queue or copy per chunk. Connections are kept
alive and reused; http and https, nothing else (no redirects, no proxies).
"""

from __future__ import annotations

import asyncio
import ssl
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools


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


class Connection(asyncio.Protocol):
    """One keep-alive connection, one request at a time."""

    def __init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._sink: Sink | None = None
        self._done: asyncio.Future[None] | None = None
        self._keep_alive = True

    @classmethod
    async def open(cls, host: str, port: int, tls: ssl.SSLContext | None = None) -> Connection:
        """A new connection."""
        loop = asyncio.get_running_loop()
        server_hostname = host if tls is not None else None
        try:
            _, connection = await loop.create_connection(
                cls, host, port, ssl=tls, server_hostname=server_hostname
            )
        except OSError as error:
            raise TransportError(type(error).__name__, str(error)) from error
        return connection

    @property
    def usable(self) -> bool:
        """Open, kept alive, and not in the middle of a response."""
        transport = self._transport
        return (
            transport is not None
            and not transport.is_closing()
            and self._done is None
            and self._keep_alive
        )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except Exception as error:  # a bad response, or a bug in a sink: fail the request
            self._fail(TransportError("bad_response", f"{type(error).__name__}: {error}"))

    def on_headers_complete(self) -> None:
        if self._sink is not None:
            self._sink.start(self._parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self._sink is not None:
            self._sink.feed(body)

    def on_message_complete(self) -> None:
        self._keep_alive = self._parser.should_keep_alive()
        if self._done is not None and not self._done.done():
            self._done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        kind = type(exc).__name__ if exc else "closed"
        self._fail(TransportError(kind, str(exc or "the server closed the connection")))

    def _fail(self, error: BaseException) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(error)
        if self._transport is not None:
            self._transport.abort()

    async def send(self, request: bytes, sink: Sink) -> None:
        """Writes one whole request and waits for the whole response; a cancelled
        wait drops the connection, so the server sees the client leave."""
        assert self._transport is not None and self._done is None
        self._sink = sink
        self._done = asyncio.get_running_loop().create_future()
        self._transport.write(request)
        try:
            await self._done
        except BaseException:
            self._transport.abort()
            raise
        finally:
            self._sink = None
            self._done = None

    def close(self) -> None:
        """Drops the connection."""
        if self._transport is not None:
            self._transport.abort()


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
        self._tls = ssl.create_default_context() if url.scheme == "https" else None
        default_port = self.port == (443 if url.scheme == "https" else 80)
        host = self.host if default_port else f"{self.host}:{self.port}"
        lines = [f"Host: {host}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
        self._headers = "".join(f"{line}\r\n" for line in lines)
        self._idle: list[Connection] = []
        self._all: set[Connection] = set()

    def head(self, method: str, path: str, length: int | None = None, extra: str = "") -> bytes:
        """The request line and headers for `path` under the base URL; `extra`: more
        header lines, each ending in CRLF."""
        body = "" if length is None else f"Content-Length: {length}\r\n"
        head = f"{method} {self.path}{path} HTTP/1.1\r\n{self._headers}{extra}{body}\r\n"
        return head.encode()

    async def _connection(self) -> Connection:
        while self._idle:
            connection = self._idle.pop()
            if connection.usable:
                return connection
            self._all.discard(connection)
        connection = await Connection.open(self.host, self.port, self._tls)
        self._all.add(connection)
        return connection

    async def send(self, request: bytes, sink: Sink) -> None:
        """Sends `request` (from `head` and a body) on an idle connection, or a
        new one, and feeds the response to `sink`. Raises `TransportError`."""
        connection = await self._connection()
        try:
            await connection.send(request, sink)
        finally:
            if connection.usable:
                self._idle.append(connection)
            else:
                connection.close()
                self._all.discard(connection)

    async def get(self, path: str) -> tuple[int, bytes]:
        """A GET's status and body."""
        sink = Collect()
        await self.send(self.head("GET", path), sink)
        return sink.status, sink.body

    def close(self) -> None:
        """Drops every connection."""
        for connection in self._all:
            connection.close()
        self._all.clear()
        self._idle.clear()
