"""The floor under a gateway in Python that does an OpenAI gateway's least work: a
uvloop process that, for each streamed chat, parses the request's head (httptools) and
body (orjson), checks its `model` and `messages`, writes a body of its own to the engine
on a kept-alive connection, and re-encodes each SSE event of the answer (parsed and
dumped again with orjson) in one chunked write a read. No keys, limits, admission,
telemetry, timeouts or cancellation: what is left is what parsing and re-encoding cost
in Python on this machine, beside `bench_edge_floor`'s bare TCP relay (the hop alone).

furnace-gateway does this and everything it leaves out; the Rust routers parse the
request and forward the answer's bytes. So where this relay's added TTFT lands says
how much of the gap between furnace and the routers any Python gateway of this design
pays, and how much is furnace's own structure.

Run: `.venv/bin/python -m benchmarks.openai_relay PORT ENGINE_PORT` (a server, until
stopped); `benchmarks.bench_vllm --relay` starts one beside the bare relay. Not
collected by pytest.
"""

from __future__ import annotations

import asyncio
import sys
from typing import cast

import httptools
import orjson
import uvloop

HOST = "127.0.0.1"
_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"cache-control: no-cache\r\ntransfer-encoding: chunked\r\n\r\n"
)
_BAD = b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
_DONE = b"[DONE]"


class _Engine(asyncio.Protocol):
    """The kept-alive connection to the engine: each answer's body to its client."""

    def __init__(self, client: _Client) -> None:
        self.client = client
        self.parser = httptools.HttpResponseParser(self)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_headers_complete(self) -> None:
        if self.client.head_at_once and self.parser.get_status_code() == 200:
            self.client.write(b"")

    def on_body(self, body: bytes) -> None:
        self.client.relay(body)

    def on_message_complete(self) -> None:
        self.client.finish()

    def connection_lost(self, exc: Exception | None) -> None:
        self.client.transport.close()


class _Client(asyncio.Protocol):
    """A client's connection: each request parsed, checked and sent on to the engine."""

    def __init__(self, engine_port: int, head_at_once: bool) -> None:
        self.engine_port = engine_port
        self.head_at_once = head_at_once
        self.parser = httptools.HttpRequestParser(self)
        self.engine: asyncio.Transport | None = None
        self.waiting: bytes = b""  # a request read before the engine connection was up
        self.body: list[bytes] = []
        self.pending = b""  # the answer's bytes after its last whole event
        self.head_sent = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        self.opening = asyncio.get_running_loop().create_task(self._open())

    async def _open(self) -> None:
        loop = asyncio.get_running_loop()
        engine, _ = await loop.create_connection(lambda: _Engine(self), HOST, self.engine_port)
        self.engine = engine
        if self.waiting:
            engine.write(self.waiting)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = orjson.loads(b"".join(self.body))
        self.body.clear()
        if (
            not isinstance(body, dict)
            or not isinstance(body.get("model"), str)
            or not isinstance(body.get("messages"), list)
        ):
            error = orjson.dumps({"error": {"message": "model and messages are required"}})
            self.transport.write(_BAD % len(error) + error)
            return
        payload = orjson.dumps(body)
        request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nhost: %s:%d\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
            % (HOST.encode(), self.engine_port, len(payload), payload)
        )
        self.head_sent = False
        if self.engine is None:
            self.waiting = request
        else:
            self.engine.write(request)

    def relay(self, body: bytes) -> None:
        """The whole events of a read, each parsed and dumped again, in one write."""
        events, _, self.pending = (self.pending + body).rpartition(b"\n\n")
        out = []
        for event in events.split(b"\n\n"):
            if not event.startswith(b"data: "):
                continue
            data = event[6:]
            out.append(_DONE if data == _DONE else orjson.dumps(orjson.loads(data)))
        if out:
            chunk = b"".join(b"data: %s\n\n" % data for data in out)
            self.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))

    def finish(self) -> None:
        self.pending = b""
        self.write(b"0\r\n\r\n")

    def write(self, data: bytes) -> None:
        """`data` to the client, after the answer's head if it has not gone yet."""
        if not self.head_sent:
            self.head_sent = True
            data = _HEAD + data
        self.transport.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.engine is not None:
            self.engine.close()


async def _serve(port: int, engine_port: int, head_at_once: bool) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Client(engine_port, head_at_once), HOST, port)
    await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    head_at_once = "--head-at-once" in args
    port, engine_port = (int(arg) for arg in args if arg != "--head-at-once")
    uvloop.run(_serve(port, engine_port, head_at_once))
    return 0


if __name__ == "__main__":
    sys.exit(main())
