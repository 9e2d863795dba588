"""The edge writes a response's head with its first body bytes (edge/http_protocol.py,
`_HeadHold`): one write, not two, for every answer, as hyper does under the Rust
routers. A write held for that goes out at the end of the loop's turn when nothing
follows it, so a lone head (or uvicorn's `100 Continue`) is never kept waiting.
A paced stream's tokens, once its head is out, are written in the callback that
brought them (`_WriteNow`), the same bytes the request's task would have written."""

from __future__ import annotations

import asyncio
import socket
from urllib.parse import urlsplit

import httpx
import orjson
import pytest

from gateway.edge.http_protocol import _HeadHold, _WriteNow
from tests.support.streams import noted_writes
from tests.support.waiting import HANG_GUARD


class _Cycle:
    """What `_HeadHold` uses of uvicorn's cycle: the attribute it writes through."""

    transport: object


class _Transport:
    """The writes an asyncio transport was given, in order."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_write_buffer_size(self) -> int:
        return 0


def _held() -> tuple[_Cycle, _HeadHold, _Transport]:
    cycle, transport = _Cycle(), _Transport()
    hold = _HeadHold(cycle, transport)  # type: ignore[arg-type]
    cycle.transport = hold
    return cycle, hold, transport


def test_the_head_and_the_first_body_bytes_go_out_in_one_write():
    async def scenario() -> tuple[list[bytes], object, object]:
        cycle, hold, transport = _held()
        hold.write(b"HTTP/1.1 200 OK\r\n\r\n")
        hold.write(b"5\r\nhello\r\n")  # the same turn: joined
        after_two = cycle.transport
        await asyncio.sleep(0)  # the turn's end finds nothing held
        return transport.writes, after_two, transport

    writes, after, transport = asyncio.run(scenario())
    assert writes == [b"HTTP/1.1 200 OK\r\n\r\n5\r\nhello\r\n"]
    assert after is transport  # the later writes go straight to the transport


def test_a_lone_first_write_goes_out_at_the_end_of_the_turn():
    async def scenario() -> tuple[list[bytes], list[bytes], object, object]:
        cycle, hold, transport = _held()
        hold.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        during = list(transport.writes)
        await asyncio.sleep(0)
        return during, transport.writes, cycle.transport, transport

    during, writes, after, transport = asyncio.run(scenario())
    assert during == []
    assert writes == [b"HTTP/1.1 100 Continue\r\n\r\n"]
    assert after is transport


def test_closing_sends_what_is_held_first():
    async def scenario() -> _Transport:
        _, hold, transport = _held()
        hold.write(b"HTTP/1.1 500 Internal Server Error\r\n\r\n")
        hold.close()
        await asyncio.sleep(0)  # the turn's flush finds it sent
        return transport

    transport = asyncio.run(scenario())
    assert transport.writes == [b"HTTP/1.1 500 Internal Server Error\r\n\r\n"]
    assert transport.closed
    assert _held()[1].get_write_buffer_size() == 0  # the rest is the transport's own


def _chat(stream: bool) -> bytes:
    body = {"messages": [{"role": "user", "content": "one two three"}], "stream": stream}
    return orjson.dumps(body)


def test_a_streamed_answer_begins_with_its_head_and_first_event_together(gateway):
    url = urlsplit(gateway.url)
    chat = _chat(stream=True)
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(chat), chat)
    )
    with socket.create_connection((url.hostname, url.port), timeout=HANG_GUARD) as sock:
        sock.sendall(request)
        first = whole = sock.recv(65536)
        while not whole.endswith(b"0\r\n\r\n"):  # the chunked body's end
            data = sock.recv(65536)
            assert data, "the gateway closed the connection"
            whole += data
    head, _, body = first.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK")
    assert b"data: " in body  # the first event came with the head
    assert b"data: [DONE]" in whole


def test_expect_100_continue_is_answered_before_the_body_is_sent(gateway):
    url = urlsplit(gateway.url)
    chat = _chat(stream=False)
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n"
        b"Expect: 100-continue\r\n\r\n" % len(chat)
    )
    with socket.create_connection((url.hostname, url.port), timeout=HANG_GUARD) as sock:
        sock.sendall(head)
        interim = b""
        while b"\r\n\r\n" not in interim:  # held for a turn, then sent alone
            data = sock.recv(65536)
            assert data, "the gateway closed the connection"
            interim += data
        assert interim.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        sock.sendall(chat)
        answer = interim.partition(b"\r\n\r\n")[2]
        while b"one two three" not in answer:
            data = sock.recv(65536)
            assert data, "the gateway closed the connection"
            answer += data
    assert answer.startswith(b"HTTP/1.1 200 OK")


def test_a_paced_streams_tokens_are_written_in_the_callback_that_brought_them(
    gateway, monkeypatch: pytest.MonkeyPatch
):
    written = noted_writes(monkeypatch)
    words = "one two three four five"
    body = {
        "model": "furnace-slow",  # a token every 50 ms: each comes while the edge waits
        "messages": [{"role": "user", "content": words}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with (
        httpx.Client(base_url=gateway.url, timeout=HANG_GUARD) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [orjson.loads(line) for line in lines[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == words
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    # every token, each an event of its own as it came; the first after the role's
    # opening chunk, in the same write
    assert len(written) >= 4
    assert all(w.startswith(b"data: {") and w.endswith(b"\n\n") for w in written)
    first = [orjson.loads(line[6:]) for line in written[0].split(b"\n\n") if line]
    assert [c["choices"][0]["delta"] for c in first] == [
        {"role": "assistant", "content": ""},
        {"content": "one"},
    ]


def test_a_write_the_connection_cannot_take_now_is_left_to_the_task_whole(
    gateway, monkeypatch: pytest.MonkeyPatch
):
    # a client that reads slowly pauses the writes now and then: the sink then leaves the
    # tokens to the request's task, and nothing of them was encoded twice (a Responses
    # stream's encoder counts its events and keeps its text as it encodes)
    writable = _WriteNow.writable
    turns = iter(range(1_000))
    monkeypatch.setattr(_WriteNow, "writable", lambda self: next(turns) % 2 and writable(self))
    words = "one two three four five"
    body = {"model": "furnace-slow", "input": words, "stream": True}
    with (
        httpx.Client(base_url=gateway.url, timeout=HANG_GUARD) as http,
        http.stream("POST", "/v1/responses", json=body) as response,
    ):
        events = [orjson.loads(line[6:]) for line in response.iter_lines() if line[:6] == "data: "]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == words
    final = events[-1]["response"]
    assert final["output"][0]["content"][0]["text"] == words
    with httpx.Client(base_url=gateway.url, timeout=HANG_GUARD) as http:
        stored = http.get(f"/v1/responses/{final['id']}").json()
    assert stored["output"][0]["content"][0]["text"] == words
