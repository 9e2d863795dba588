"""A client that stops reading: the worker is pushed back (the gateway holds at
most `stream_buffer_bytes` of its answer), and after `write_timeout` the call is
cancelled, the slot comes back and the request counts as `client_gone`."""

import asyncio
import json
import logging
import socket
import time
from collections.abc import AsyncIterator

import httpx

from gateway.config import ModelConfig
from gateway.protocol import features
from gateway.protocol.sizes import event_size
from gateway.protocol.types import (
    Event,
    Finished,
    FinishReason,
    GenerateRequest,
    Started,
    Text,
    TokenLogprob,
)
from gateway.worker.engine import Engine
from tests.support.requests import sse_events
from tests.support.waiting import HANG_GUARD, wait_until

PIECE = "x" * 63 + " "  # one token
ANSWER_TOKENS = 10_000_000  # 640 MB of text: it never gets that far
BUFFER = 4096


class LongEngine(Engine):
    """Answers `max_tokens` pieces (else ANSWER_TOKENS), one per turn of the
    event loop, counting what it produced."""

    model = "long"
    max_context = 1 << 30
    piece = Text(PIECE, 1)

    def __init__(self) -> None:
        self.produced = 0
        self.running = 0

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        tokens = request.sampling.max_tokens or ANSWER_TOKENS
        self.running += 1
        try:
            yield Started(1)
            for _ in range(tokens):
                self.produced += 1
                yield self.piece
                await asyncio.sleep(0)
            yield Finished(FinishReason.LENGTH, tokens)
        finally:
            self.running -= 1


def _stalled_stream(url: str, body: dict[str, object] | None = None) -> socket.socket:
    """Sends a streaming request (`body`; default: for a long answer) and then reads
    nothing."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(HANG_GUARD)
    sock.connect((host, int(port)))
    data = json.dumps(body or {"model": "long", "prompt": "go", "stream": True}).encode()
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (f"{host}:{port}".encode(), len(data), data)
    )
    return sock


def _held_back(engine: LongEngine) -> int:
    """Waits until the engine's answer has started and then stopped making tokens
    (held back by the buffers on the way); the tokens it made."""
    wait_until(lambda: engine.running == 1, "the answer to start")
    seen = [-1]

    def stopped() -> bool:
        before, seen[0] = seen[0], engine.produced
        time.sleep(0.2)
        return engine.produced == before == seen[0]

    wait_until(stopped, "the engine to be held back", timeout=HANG_GUARD)
    return engine.produced


def _requests_by_outcome(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=HANG_GUARD).text
    counted: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("furnace_gateway_requests_total{") and 'model="long"' in line:
            labels, value = line.rsplit(" ", 1)
            outcome = labels.split('outcome="', 1)[1].split('"', 1)[0]
            counted[outcome] = counted.get(outcome, 0) + float(value)
    return counted


def test_a_stalled_reader_pushes_back_then_is_cut_off(gateway_with, serve_engines, caplog):
    caplog.set_level(logging.INFO, logger="furnace.access")
    engine = LongEngine()
    (worker,) = serve_engines(engine)
    gw = gateway_with(
        models=(ModelConfig("long", workers=(worker.address,)),),
        write_timeout=1.0,
        stream_buffer_bytes=BUFFER,
    )
    held = 0  # the most text the gateway held for the edge
    over = 0  # the most held before the piece that crossed the bound
    with _stalled_stream(gw.url):
        wait_until(lambda: engine.running == 1, "the answer to start")
        give_up = time.monotonic() + HANG_GUARD
        while engine.running and time.monotonic() < give_up:
            for pump in list(gw.state.inflight.running):
                lengths = [len(e.text) for e in list(pump._ready) if type(e) is Text]
                held = max(held, sum(lengths))
                over = max(over, sum(lengths[:-1]))
            time.sleep(0.001)
        wait_until(lambda: gw.state.slots.in_use == 0, "the slot to come back")
        print(f"\nstalled: engine produced {engine.produced} tokens; gateway held <= {held} chars")
    assert engine.running == 0 and 0 < engine.produced < ANSWER_TOKENS  # cancelled
    # The reader stops once past the bound: all but the last piece fit in it.
    assert over <= BUFFER
    assert _requests_by_outcome(gw.url) == {"client_gone": 1}
    wait_until(lambda: any(r.name == "furnace.access" for r in caplog.records), "the access log")
    (line,) = [json.loads(r.getMessage()) for r in caplog.records if r.name == "furnace.access"]
    assert line["outcome"] == "client_gone" and line["status"] == 200
    # no Finished reached the edge: the tokens written before the cut, as the ledger counts
    assert 0 < line["completion_tokens"] <= engine.produced


def test_a_reader_that_keeps_up_gets_every_token(gateway_with, serve_engines):
    engine = LongEngine()
    (worker,) = serve_engines(engine)
    gw = gateway_with(
        models=(ModelConfig("long", workers=(worker.address,)),),
        write_timeout=1.0,
        stream_buffer_bytes=BUFFER,
    )
    tokens = 20_000
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        response = client.post(
            "/v1/completions",
            json={"model": "long", "prompt": "go", "stream": True, "max_tokens": tokens},
        )
    events = sse_events(response.text)
    text = "".join(e["choices"][0]["text"] for e in events if e != "[DONE]" and e["choices"])
    assert text == PIECE * tokens
    assert engine.produced == tokens
    assert _requests_by_outcome(gw.url) == {"completed": 1}


def test_a_stalled_reader_stops_the_engine_itself(gateway_with, serve_engines):
    """End to end: the gateway stops reading, gRPC's flow control holds the worker's
    sends, and the worker SDK stops pulling from its engine, which then makes no
    more tokens (without that, it would run until the write timeout, and memory with it)."""
    engine = LongEngine()
    (worker,) = serve_engines(engine)
    gw = gateway_with(
        models=(ModelConfig("long", workers=(worker.address,)),),
        write_timeout=HANG_GUARD,
        stream_buffer_bytes=BUFFER,
    )
    with _stalled_stream(gw.url):
        held_back_at = _held_back(engine)
        assert engine.running == 1
    wait_until(lambda: engine.running == 0, "the engine to stop when the client leaves")
    wait_until(lambda: gw.state.slots.in_use == 0, "the slot to come back")
    # what the buffers on the way hold (read-ahead, HTTP/2 windows, sockets): megabytes at most
    assert held_back_at * len(PIECE) < 32 * 1024 * 1024


#: One token's logprobs at `top_logprobs` 20: twenty alternatives of 32 characters each.
TOP = tuple((f"{i:032d}", -1.0 - i) for i in range(20))


class LogprobEngine(LongEngine):
    """LongEngine with logprobs: each one-character token carries ~1 KB of them."""

    model = "logprobs"
    features = features.FIRST_VERSION | {features.LOGPROBS}
    piece = Text("x", 1, 0, (TokenLogprob("x", -0.5, TOP),))


def test_a_stalled_reader_of_big_logprobs_holds_bounded_memory(gateway_with, serve_engines):
    """The buffers on the way (the worker's read-ahead, the multiplexed call's window,
    the gateway's stream buffer) count what an event carries, not its text: counted
    as one character, each of these tokens held ~1 KB, and a stalled stream of them
    held hundreds of MB."""
    engine = LogprobEngine()
    (worker,) = serve_engines(engine)
    gw = gateway_with(
        models=(ModelConfig("logprobs", workers=(worker.address,)),),
        write_timeout=HANG_GUARD,
        stream_buffer_bytes=64 * 1024,
        max_output_units=1 << 40,
    )
    body = {"model": "logprobs", "prompt": "go", "stream": True, "max_tokens": 1 << 30}
    with _stalled_stream(gw.url, {**body, "logprobs": 20}):
        held_back_at = _held_back(engine)
        held = [sum(event_size(e) for e in list(pump._ready)) for pump in gw.state.inflight.running]
    wait_until(lambda: engine.running == 0, "the engine to stop when the client leaves")
    wait_until(lambda: gw.state.slots.in_use == 0, "the slot to come back")
    token_bytes = event_size(LogprobEngine.piece)
    print(f"\nlogprobs: held back after {held_back_at} tokens of {token_bytes} bytes; {held}")
    # the stream buffer, by what it holds: its bound and an event past it (twice that
    # seen once on a loaded machine, read from this thread while the loop refilled it)
    assert max(held) <= 2 * (64 * 1024 + token_bytes)
    # the read-ahead, the window, the stream buffer, sockets: a few MB, not hundreds
    assert held_back_at * token_bytes < 16 * 1024 * 1024
