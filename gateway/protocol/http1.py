"""HTTP/1.1 client connections over httptools, kept alive in a pool: the one client
under the raw OpenAI-HTTP upstream (`gateway.upstreams.openai_http.connections`) and
the benchmark's load generator (`gateway.bench.http`).

Why not httpx or aiohttp: a response is parsed by httptools inside the transport's
callback (the chunked encoding undone in C) and handed straight to its `Reader`, with no
task switch, queue or copy per chunk; a network read of many SSE events is one
`data_received`, one `Reader.body` (its pieces joined) and one `Reader.read`: no Python
runs per chunk. `benchmarks/bench_http_clients.py` measures the CPU per streamed
response of this client against httpx's and aiohttp's.

A connection carries one request at a time; its reader learns the status, the body a
read at a time, and then either that the response ended (`complete`, and whether the
connection may carry the next request: `Connection.reusable`) or that it broke
(`broken`: bad HTTP, or the connection lost). `Pool` keeps the idle connections of one
host and port. `fetch` sends one request and keeps its whole answer (a bounded read):
the polls of a worker's health and load, about ten times cheaper in CPU than httpx's.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import Protocol, cast

import httptools

#: Idle kept-alive connections a pool keeps at most.
MAX_IDLE = 256
#: The kind of a break where the server sent what is not HTTP.
BAD_RESPONSE = "bad_response"
#: The kind of a break where the pool was closed under the request (`Pool.close`).
POOL_CLOSED = "pool_closed"


class Reader(Protocol):
    """What a connection tells the request reading it, inside its callbacks."""

    def head(self, status: int) -> None:
        """The response's status line and headers have arrived."""

    def body(self, data: bytes) -> None:
        """The body that a network read brought (its pieces joined, the chunked
        encoding undone): told before `read`, `complete` or `broken`."""

    def read(self) -> None:
        """A network read has been parsed (whatever it held was told before this)."""

    def complete(self, connection: Connection) -> None:
        """The response ended whole; the connection is no longer this reader's."""

    def broken(self, kind: str, detail: str) -> None:
        """The response will not end: the server sent bad HTTP (`kind` is
        `BAD_RESPONSE`), the connection was lost (the exception's name, or
        "closed" when the server closed it), or its pool was closed (`POOL_CLOSED`)."""


class Connection(asyncio.Protocol):
    """One kept-alive HTTP/1.1 connection, one request at a time: `reader` is the
    request reading the response now."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._pieces: list[bytes] = []  # the body's pieces parsed off the read in progress
        # httptools calls `on_body` for each piece of a chunked body (an SSE event a
        # piece, often): the list's own `append` runs no Python for one; the reader
        # gets them joined, once a read (`_hand_body`). Set before the parser, which
        # looks its callbacks up once.
        self.on_body: Callable[[bytes], None] = self._pieces.append
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.reader: Reader | None = None
        self.reusable = False  # its last response ended whole, with keep-alive
        self.requests = 0  # sent on it so far: past 0, it was taken from the idle ones

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def send(self, request: bytes, reader: Reader) -> None:
        """Writes one whole request; its response goes to `reader`."""
        assert self.transport is not None and self.reader is None
        self.reader = reader
        self.requests += 1
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        reader = self.reader
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as error:
            if reader is not None:
                self._hand_body()  # what came before it goes first
                reader.broken(BAD_RESPONSE, str(error))
            else:
                self.abort()  # bytes on an idle connection: it is not usable
        pieces = self._pieces
        if pieces:  # `_hand_body`, written out: most reads of a body take this way
            current = self.reader  # None if the response ended in this read (handed then)
            if current is not None:
                current.body(b"".join(pieces))
            pieces.clear()
        if reader is not None:
            reader.read()

    def _hand_body(self) -> None:
        """The body's pieces parsed so far, as one, to the reader (if any: the pieces
        of no request are dropped)."""
        reader = self.reader
        if reader is not None and self._pieces:
            reader.body(b"".join(self._pieces))  # one piece: that piece, not a copy
        self._pieces.clear()

    def on_headers_complete(self) -> None:
        if self.reader is not None:
            self.reader.head(self._parser.get_status_code())

    def on_message_complete(self) -> None:
        self._hand_body()
        reader, self.reader = self.reader, None
        self.reusable = self._parser.should_keep_alive()
        if reader is not None:
            reader.complete(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        self._pool.forget(self)
        reader, self.reader = self.reader, None
        if reader is not None:
            kind = type(exc).__name__ if exc else "closed"
            reader.broken(kind, str(exc or "the server closed the connection"))
            reader.read()

    def abort(self) -> None:
        """Drops the connection: the server sees its client leave."""
        self.reusable = False
        self.reader = None
        if self.transport is not None:
            self.transport.abort()


class Pool:
    """One host's idle kept-alive connections; a request takes one or opens one."""

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> None:
        self.host, self.port, self.tls = host, port, tls
        self.idle: list[Connection] = []
        self.open: set[Connection] = set()
        self.closed = False

    async def take(self, connect_timeout: float | None = None, fresh: bool = False) -> Connection:
        """An idle connection that can carry a request, or a new one (`fresh`: always
        a new one); `OSError` or `TimeoutError` when none can be opened."""
        while self.idle and not fresh:
            connection = self.idle.pop()
            transport = connection.transport
            if connection.reusable and transport is not None and not transport.is_closing():
                connection.reusable = False
                return connection
            self.drop(connection)
        loop = asyncio.get_running_loop()
        hostname = self.host if self.tls is not None else None
        async with asyncio.timeout(connect_timeout):
            _, connection = await loop.create_connection(
                lambda: Connection(self),
                self.host,
                self.port,
                ssl=self.tls,
                server_hostname=hostname,
            )
        self.open.add(connection)
        return connection

    def give_back(self, connection: Connection) -> None:
        """A connection whose response ended: kept for the next request if it can
        be (up to `MAX_IDLE` of them)."""
        if connection.reusable and not self.closed and len(self.idle) < MAX_IDLE:
            self.idle.append(connection)
        else:
            self.drop(connection)

    def drop(self, connection: Connection) -> None:
        connection.abort()
        self.open.discard(connection)

    def forget(self, connection: Connection) -> None:
        """A connection the server (or we) closed."""
        self.open.discard(connection)
        if connection in self.idle:
            self.idle.remove(connection)

    def close(self) -> None:
        """Drops every connection, idle or not; a request still reading one learns it
        now (`POOL_CLOSED`), not at its deadline (a poll of a worker that left)."""
        self.closed = True
        for connection in list(self.open):
            reader = connection.reader
            connection.abort()
            if reader is not None:
                reader.broken(POOL_CLOSED, "the gateway closed its connections to the upstream")
                reader.read()
        self.open.clear()
        self.idle.clear()


class _Whole:
    """The reader of `fetch`: the status and up to `limit` bytes of the body. `done`
    holds the connection once the response ended whole, None once `limit` bytes came
    (the rest is not read) or the server closed a response it delimits by closing."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.status = 0
        self.parts: list[bytes] = []
        self.size = 0
        self.done: asyncio.Future[Connection | None] = asyncio.get_running_loop().create_future()

    def head(self, status: int) -> None:
        self.status = status

    def body(self, data: bytes) -> None:
        self.parts.append(data)
        self.size += len(data)
        if self.size >= self.limit and not self.done.done():
            self.done.set_result(None)

    def read(self) -> None:
        pass

    def complete(self, connection: Connection) -> None:
        if not self.done.done():
            self.done.set_result(connection)

    def broken(self, kind: str, detail: str) -> None:
        if self.done.done():
            return
        if kind == "closed" and self.status:  # HTTP/1.0's end of a body: the close
            self.done.set_result(None)
        else:
            self.done.set_exception(ConnectionError(f"{kind}: {detail}"))


async def fetch(pool: Pool, request: bytes, limit: int, timeout: float) -> tuple[int, bytes]:  # noqa: ASYNC109
    """`request` (whole, and safe to send twice: a GET) on one of `pool`'s
    connections, answered within `timeout` seconds: the status and at most `limit`
    bytes of the body. `TimeoutError`, or `OSError` (`ConnectionError` for a response
    that broke) when there is none. A kept-alive connection the server closed as the
    request went out (its idle timeout: uvicorn's is 5 s, as long as a poll's interval)
    breaks before any answer; the request goes again, once, on a new connection."""
    async with asyncio.timeout(timeout):
        fresh = False
        while True:
            reader = _Whole(limit)
            connection = await pool.take(fresh=fresh)
            connection.send(request, reader)
            try:
                ended = await reader.done
            except ConnectionError:
                pool.drop(connection)
                if fresh or connection.requests < 2 or reader.status or pool.closed:
                    raise
                fresh = True  # it had served before: the server's close crossed our send
                continue
            except BaseException:
                pool.drop(connection)
                raise
            break
    if ended is None:
        pool.drop(connection)
    else:
        pool.give_back(ended)
    return reader.status, b"".join(reader.parts)[:limit]
