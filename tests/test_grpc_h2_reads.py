"""A read of many messages, as `gateway.protocol.grpc_h2` hands it to a listening call:
against a scripted HTTP/2 server on loopback that sends a stream's answer in one write,
the call's listener is woken once for the read's DATA frames rather than once a message
(so the vLLM upstream and the pump take a read's tokens in one go), with every message in
order; and a frame that ends the stream in the same read (trailers, or a RST_STREAM that
drops what was not taken) comes after the messages before it were taken."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc
import hpack
import pytest

from gateway.protocol.grpc_h2 import StreamChannel
from tests.support.h2_script import frame, scripted
from tests.support.servers import ServerLoop

EOF = grpc.aio.EOF
MESSAGES = 50


@pytest.fixture
def run(server_loop: ServerLoop) -> Iterator[Callable[[Callable[[], Awaitable[Any]]], Any]]:
    def runner(spec: Callable[[], Awaitable[Any]]) -> Any:
        return server_loop.call(spec())

    yield runner


def _message(i: int) -> bytes:
    body = b"message %d" % i
    return frame(0, 0, 1, b"\x00" + len(body).to_bytes(4, "big") + body)


def _answer(end: bytes) -> bytes:
    head = hpack.Encoder().encode([(":status", "200"), ("content-type", "application/grpc")])
    messages = b"".join(_message(i) for i in range(MESSAGES))
    return frame(4, 0, 0, b"") + frame(1, 4, 1, head) + messages + end


TRAILERS = frame(1, 5, 1, hpack.Encoder().encode([("grpc-status", "0")]))  # END_STREAM
RESET = frame(3, 0, 1, (8).to_bytes(4, "big"))  # RST_STREAM, CANCEL


async def _listened(port: int) -> tuple[list[object], int]:
    """What a listening call took, each message as its listener polled it, and how many
    times the listener was woken."""
    channel = StreamChannel(f"127.0.0.1:{port}")
    call = channel.unary_stream("/t.S/Count", b"", bytes, 10)
    try:
        assert not await call.arrived(0.001)  # started: the answer comes 0.2 s later
        got: list[object] = []
        wakes = 0
        ended = asyncio.Event()

        def heard() -> None:
            nonlocal wakes
            wakes += 1
            try:
                while not ended.is_set() and (message := call.poll()) is not None:
                    got.append(message)
                    if message is EOF:
                        ended.set()
            except grpc.aio.AioRpcError as error:
                got.append(error.code())
                ended.set()

        call.listen(heard)
        await asyncio.wait_for(ended.wait(), 10)
        call.listen(None)
        return got, wakes
    finally:
        await channel.close()


def test_a_read_of_many_messages_wakes_the_listener_once_for_them(run: Any) -> None:
    async def spec() -> tuple[list[object], int]:
        async with scripted(_answer(TRAILERS), delay=0.2) as port:
            return await _listened(port)

    got, wakes = run(spec)
    assert got == [b"message %d" % i for i in range(MESSAGES)] + [EOF]
    # one wake for the DATA frames, one for the trailers (a read cut by TCP adds a few)
    assert wakes < MESSAGES // 5


def test_the_messages_before_a_reset_in_the_same_read_are_taken_first(run: Any) -> None:
    """A RST_STREAM CANCEL drops what was not taken yet: the listener is woken for the
    messages before it, as when each message woke it, and the call then fails."""

    async def spec() -> tuple[list[object], int]:
        async with scripted(_answer(RESET), delay=0.2) as port:
            return await _listened(port)

    got, _ = run(spec)
    assert got == [b"message %d" % i for i in range(MESSAGES)] + [grpc.StatusCode.CANCELLED]
