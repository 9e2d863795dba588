"""The edge's HTTP protocol keeps uvicorn's pipelining: requests sent back to back
on one connection, before any answer, are answered in order (its queue of waiting
requests is a plain list, not a deque: see edge/http_protocol.py)."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import httptools
import orjson
import pytest

from gateway.edge.http_protocol import PIPELINE_DEPTH
from tests.support.process_usage import MIB, rss_bytes
from tests.support.waiting import HANG_GUARD


class _Answers:
    """Whole responses parsed off one connection, in order (httptools' callbacks)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self._body = b""
        self.parser = httptools.HttpResponseParser(self)

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        self.bodies.append(self._body)
        self._body = b""


def _read_answers(sock: socket.socket, count: int) -> list[bytes]:
    """The bodies of the next `count` responses on `sock` (chunked or not)."""
    answers = _Answers()
    while len(answers.bodies) < count:
        data = sock.recv(65536)
        assert data, "the gateway closed the connection"
        answers.parser.feed_data(data)
    return answers.bodies


def test_pipelined_requests_are_answered_in_order(gateway):
    url = urlsplit(gateway.url)
    chat = orjson.dumps({"messages": [{"role": "user", "content": "one two three"}]})
    requests = [
        b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n",
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(chat), chat),
        b"GET /ready HTTP/1.1\r\nHost: localhost\r\n\r\n",
    ]
    with socket.create_connection((url.hostname, url.port), timeout=HANG_GUARD) as sock:
        sock.sendall(b"".join(requests))  # all three before any answer
        health, answer, ready = _read_answers(sock, 3)
    assert orjson.loads(health) == {"status": "ok"}
    assert orjson.loads(answer)["choices"][0]["message"]["content"] == "one two three"
    assert orjson.loads(ready) == {"status": "ready"}


@pytest.mark.parametrize(
    "fields", [b"", b"Connection: Upgrade\r\nUpgrade: h2c\r\n"], ids=["plain", "upgrade"]
)
def test_a_flood_of_pipelined_requests_is_bounded_then_closed(gateway, fields):
    # One connection writes 1,000 `GET /v1/models` per write and never reads until
    # it is done writing: the gateway answers what it queued (at most
    # PIPELINE_DEPTH behind the first), in order, then closes; it parses no more.
    # (A request that asks for an upgrade is read twice, its head again without it:
    # bounded the same.)
    url = urlsplit(gateway.url)
    flood = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n%s\r\n" % fields * 1000
    before = rss_bytes()
    with socket.create_connection((url.hostname, url.port), timeout=HANG_GUARD) as sock:
        sock.setblocking(False)
        written = 0
        for _ in range(200):  # 200,000 requests, unless the gateway closes first
            try:
                written += sock.send(flood)
            except BlockingIOError:
                time.sleep(0.01)  # its buffers are full: it is not reading
            except (BrokenPipeError, ConnectionResetError):
                break
        grown = rss_bytes() - before
        sock.setblocking(True)
        sock.settimeout(HANG_GUARD)
        answers = _Answers()
        try:
            while data := sock.recv(65536):
                answers.parser.feed_data(data)
        except ConnectionResetError:
            pass  # it closed with our unread requests in its buffer
    assert 1 <= len(answers.bodies) <= PIPELINE_DEPTH + 1
    for body in answers.bodies:  # every one a whole, right answer
        assert orjson.loads(body)["object"] == "list"
    assert grown < 64 * MIB
