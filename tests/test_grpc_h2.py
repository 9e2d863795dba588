"""The gateway's own HTTP/2 client for server-streaming gRPC calls
(`gateway.protocol.grpc_h2`), against a real grpc.aio server on loopback: messages in
order, bodies and messages past every window, statuses with their details, deadlines,
cancellation the server sees, flow control that holds a worker back, GOAWAY and
reconnects; and against a scripted TCP server that breaks HTTP/2, which costs the
connection and never the loop. After each spec the channel is closed and its socket
with it (warnings are errors here: an unclosed socket fails the spec)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import hpack
import pytest

from gateway.protocol import grpc_h2
from gateway.protocol.grpc_h2 import StreamChannel, grpc_timeout
from gateway.protocol.tls import client_credentials
from tests.support.certs import CertificateAuthority, Issued
from tests.support.h2_script import frame, scripted
from tests.support.servers import ServerLoop

EOF = grpc.aio.EOF


@dataclass
class Seen:
    """What the server saw, for the specs to check."""

    sent: int = 0
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    metadata: dict[str, str] = field(default_factory=dict)
    bodies: list[int] = field(default_factory=list)
    time_remaining: float | None = None


def _handlers(seen: Seen) -> grpc.GenericRpcHandler:
    async def count(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        n, size, pause = (float(x) for x in request.decode().split(","))
        seen.metadata = {k: v for k, v in context.invocation_metadata() if isinstance(v, str)}
        seen.time_remaining = context.time_remaining()
        for i in range(int(n)):
            if pause:
                await asyncio.sleep(pause)
            seen.sent += 1
            yield str(i).encode().ljust(int(size), b".")

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        seen.bodies.append(len(request))
        yield request

    async def fail(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        before, code = (int(x) for x in request.decode().split(","))
        for i in range(before):
            yield b"%d" % i
        await context.abort(grpc.StatusCode(_code(code)), "bad ∂ input: 100% wrong")

    async def hang(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        yield b"first"
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            seen.cancelled.set()
            raise

    methods = {"Count": count, "Echo": echo, "Fail": fail, "Hang": hang}
    return grpc.method_handlers_generic_handler(
        "t.S", {name: grpc.unary_stream_rpc_method_handler(f) for name, f in methods.items()}
    )


def _code(number: int) -> tuple[int, str]:
    return next(c.value for c in grpc.StatusCode if c.value[0] == number)


@asynccontextmanager
async def _server(
    port: int = 0, tls: grpc.ServerCredentials | None = None
) -> AsyncIterator[tuple[grpc.aio.Server, int, Seen]]:
    """A grpc.aio server of the specs' methods; with `tls`, over TLS (`_mutual_tls`)."""
    seen = Seen()
    big = 64 * 1024 * 1024
    server = grpc.aio.server(
        options=[("grpc.max_send_message_length", big), ("grpc.max_receive_message_length", big)]
    )
    server.add_generic_rpc_handlers((_handlers(seen),))
    if tls is None:
        port = server.add_insecure_port(f"127.0.0.1:{port}")
    else:
        port = server.add_secure_port(f"127.0.0.1:{port}", tls)
    await server.start()
    try:
        yield server, port, seen
    finally:
        await server.stop(None)


def _mutual_tls(issued: Issued, client_ca: str) -> grpc.ServerCredentials:
    """A server's TLS: its certificate, and the CA its clients' certificates must come from."""
    pair = (Path(issued.key_file).read_bytes(), Path(issued.cert_file).read_bytes())
    return grpc.ssl_server_credentials(
        [pair], Path(client_ca).read_bytes(), require_client_auth=True
    )


@asynccontextmanager
async def _served() -> AsyncIterator[tuple[StreamChannel, Seen]]:
    """A server and a channel to it, closed after the spec."""
    async with _server() as (_, port, seen):
        channel = StreamChannel(f"127.0.0.1:{port}")
        try:
            yield channel, seen
        finally:
            await channel.close()


async def _all(
    channel: StreamChannel, method: str, body: bytes, within: float | None = 10
) -> list[bytes]:
    """Every message of one call that must end `within` seconds."""
    call = channel.unary_stream(f"/t.S/{method}", body, bytes, within)
    out = []
    while (message := await call.read()) is not EOF:
        out.append(message)
    return out


@pytest.fixture
def run(server_loop: ServerLoop) -> Iterator[Callable[[Callable[[], Awaitable[Any]]], Any]]:
    def runner(spec: Callable[[], Awaitable[Any]]) -> Any:
        return server_loop.call(spec())

    yield runner


def test_messages_arrive_in_order_with_the_metadata(run: Any) -> None:
    async def spec() -> None:
        async with _served() as (channel, seen):
            call = channel.unary_stream("/t.S/Count", b"50,8,0", bytes, 10, (("X-Api-Key", "k1"),))
            got = []
            while (message := await call.read()) is not EOF:
                got.append(message)
            assert got == [str(i).encode().ljust(8, b".") for i in range(50)]
            assert seen.metadata["x-api-key"] == "k1"
            assert "grpc-timeout" not in seen.metadata  # gRPC takes it as the deadline
            assert await call.read() is EOF
            assert not call.cancel()  # it had ended

    run(spec)


def test_arrived_tells_a_worker_still_at_work_from_one_that_answered(run: Any) -> None:
    """`arrived` starts the call and waits at most its seconds for a message, taking none:
    a worker still at work (an engine's prefill) says no, one that answered says yes, and
    the messages are all read after either."""

    async def spec() -> None:
        async with _served() as (channel, _):
            slow = channel.unary_stream("/t.S/Count", b"2,4,1.0", bytes, 10)
            assert not await slow.arrived(0.05)
            assert [await slow.read(), await slow.read(), await slow.read()] == [
                b"0...",
                b"1...",
                EOF,
            ]
            fast = channel.unary_stream("/t.S/Count", b"1,4,0", bytes, 10)
            assert await fast.arrived(10)
            assert await fast.arrived(10)  # nothing was taken
            assert [await fast.read(), await fast.read()] == [b"0...", EOF]

    run(spec)


def test_a_listener_hears_each_message_in_the_callback_and_poll_takes_it(run: Any) -> None:
    """Once started, a listener runs in the connection's callback that brought messages
    (or the call's end); `poll` takes what came, None while nothing has, then EOF, or
    raises the call's status: no task waits on the call."""

    async def spec() -> None:
        async with _served() as (channel, _):
            call = channel.unary_stream("/t.S/Count", b"3,4,0.01", bytes, 10)
            assert not await call.arrived(0.001)  # started, nothing yet
            assert call.poll() is None
            got: list[object] = []
            ended = asyncio.Event()

            def heard() -> None:
                while not ended.is_set() and (message := call.poll()) is not None:
                    got.append(message)
                    if message is EOF:
                        ended.set()

            call.listen(heard)
            await asyncio.wait_for(ended.wait(), 10)
            assert got == [b"0...", b"1...", b"2...", EOF]

            failing = channel.unary_stream("/t.S/Fail", b"1,5", bytes, 10)
            assert await failing.arrived(10)
            told = asyncio.Event()
            failing.listen(told.set)
            assert failing.poll() == b"0"

            async def status() -> grpc.StatusCode:
                while True:
                    try:
                        failing.poll()
                    except grpc.aio.AioRpcError as error:
                        return error.code()
                    told.clear()
                    await told.wait()

            assert await asyncio.wait_for(status(), 10) == grpc.StatusCode.NOT_FOUND
            failing.listen(None)

    run(spec)


def test_a_call_without_a_deadline_sends_none(run: Any) -> None:
    """A subscription (`timeout=None`): no `grpc-timeout`, no timer; it ends when the
    worker ends it or when it is cancelled."""

    async def spec() -> None:
        async with _served() as (channel, seen):
            assert await _all(channel, "Count", b"3,1,0", within=None) == [b"0", b"1", b"2"]
            assert seen.time_remaining is None
            await _all(channel, "Count", b"1,1,0", within=30)
            assert seen.time_remaining is not None and 25 < seen.time_remaining <= 30

    run(spec)


def test_grpc_timeout_keeps_to_eight_digits() -> None:
    assert [grpc_timeout(s) for s in (0.0001, 2.5, 99_999.999, 100_000, 1e12)] == [
        "1m",
        "2500m",
        "99999999m",
        "100000S",
        "99999999H",
    ]


def test_bodies_and_messages_past_every_window_get_through(run: Any) -> None:
    async def spec() -> None:
        async with _served() as (channel, seen):
            body = bytes(range(256)) * 12_000  # 3 MB: many frames, the windows refilled
            assert await _all(channel, "Echo", body) == [body]
            assert seen.bodies == [len(body)]
            messages = await _all(channel, "Count", b"3,300000,0")  # each past a window
            assert [len(m) for m in messages] == [300_000] * 3

    run(spec)


def test_many_calls_share_one_connection(run: Any) -> None:
    async def spec() -> None:
        async with _served() as (channel, _seen):
            answers = await asyncio.gather(
                *(_all(channel, "Count", b"20,4,0.001") for _ in range(64))
            )
            assert all(len(a) == 20 for a in answers)
            assert len(grpc_connections(channel)) == 1

    run(spec)


def grpc_connections(channel: StreamChannel) -> list[Any]:
    conn = channel._conn
    return [conn] if conn is not None else []


@pytest.mark.parametrize("before", [0, 2])
def test_a_status_arrives_with_its_code_and_details(run: Any, before: int) -> None:
    """Before any message (trailers only) or after some: the messages first, then the
    status, its details percent-decoded as gRPC sends them."""

    async def spec() -> None:
        async with _served() as (channel, _seen):
            call = channel.unary_stream("/t.S/Fail", b"%d,3" % before, bytes, 10)
            got = []
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                while (message := await call.read()) is not EOF:
                    got.append(message)
            assert got == [b"%d" % i for i in range(before)]
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert caught.value.details() == "bad ∂ input: 100% wrong"
            with pytest.raises(grpc.aio.AioRpcError):  # and again on the next read
                await call.read()
            unknown = channel.unary_stream("/t.S/Nope", b"", bytes, 10)
            with pytest.raises(grpc.aio.AioRpcError) as missing:
                await unknown.read()
            assert missing.value.code() == grpc.StatusCode.UNIMPLEMENTED

    run(spec)


def test_the_deadline_ends_the_call_and_the_worker_hears_it(run: Any) -> None:
    async def spec() -> None:
        async with _served() as (channel, seen):
            call = channel.unary_stream("/t.S/Hang", b"", bytes, 0.3)
            assert await call.read() == b"first"
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call.read()
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await asyncio.wait_for(seen.cancelled.wait(), 10)

    run(spec)


def test_a_cancel_stops_the_read_and_the_worker(run: Any) -> None:
    async def spec() -> None:
        async with _served() as (channel, seen):
            call = channel.unary_stream("/t.S/Hang", b"", bytes, 30)
            assert await call.read() == b"first"
            reader = asyncio.ensure_future(call.read())
            await asyncio.sleep(0.05)
            assert call.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await reader
            assert caught.value.code() == grpc.StatusCode.CANCELLED
            await asyncio.wait_for(seen.cancelled.wait(), 10)
            assert await _all(channel, "Count", b"2,1,0") == [b"0", b"1"]  # the link serves on

    run(spec)


def test_a_reader_that_stops_holds_the_worker_back(run: Any) -> None:
    """Flow control: the worker sends about a window (64 KiB) past what was read, then
    waits; reading on takes every message."""

    async def spec() -> None:
        async with _served() as (channel, seen):
            call = channel.unary_stream("/t.S/Count", b"5000,1000,0", bytes, 30)
            assert await call.read() is not EOF
            await asyncio.sleep(1.0)
            assert seen.sent < 500, seen.sent  # 500 KB: several windows, not 5 MB
            count = 1
            while await call.read() is not EOF:
                count += 1
            assert count == seen.sent == 5000

    run(spec)


def test_a_message_past_the_bound_fails_the_call_not_the_link(
    run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(grpc_h2, "MAX_MESSAGE_BYTES", 100_000)

    async def spec() -> None:
        async with _served() as (channel, _seen):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await _all(channel, "Count", b"1,200000,0")
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "Received message larger than max" in (caught.value.details() or "")
            assert await _all(channel, "Count", b"1,10,0") == [b"0".ljust(10, b".")]

    run(spec)


def test_a_worker_that_goes_away_finishes_its_calls_and_the_next_one_reconnects(
    run: Any,
) -> None:
    async def spec() -> None:
        async with _server() as (server, port, _seen):
            channel = StreamChannel(f"127.0.0.1:{port}")
            running = asyncio.ensure_future(_all(channel, "Count", b"10,4,0.05"))
            await asyncio.sleep(0.1)
            await server.stop(5)  # GOAWAY, then the call may finish
            assert len(await running) == 10
        with pytest.raises(grpc.aio.AioRpcError) as caught:  # nobody listens now
            await _all(channel, "Count", b"1,1,0")
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        async with _server(port) as (_, _port, _seen):
            assert await _all(channel, "Count", b"1,1,0") == [b"0"]
        await channel.close()

    run(spec)


def test_a_connection_whose_stream_ids_are_spent_gives_way_to_a_new_one(
    run: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(grpc_h2, "LAST_STREAM_ID", 7)  # ids 1, 3, 5, 7

    async def spec() -> None:
        async with _served() as (channel, _seen):
            running = asyncio.ensure_future(_all(channel, "Count", b"5,1,0.1"))
            await asyncio.sleep(0.05)
            first = channel._conn
            for _ in range(5):
                assert await _all(channel, "Count", b"1,1,0") == [b"0"]
            assert channel._conn is not first
            assert len(await running) == 5  # the old connection served its call to the end

    run(spec)


def test_a_closed_channel_ends_its_calls(run: Any) -> None:
    async def spec() -> None:
        async with _served() as (channel, seen):
            call = channel.unary_stream("/t.S/Hang", b"", bytes, 30)
            assert await call.read() == b"first"
            await channel.close()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call.read()
            assert caught.value.code() == grpc.StatusCode.CANCELLED
            await asyncio.wait_for(seen.cancelled.wait(), 10)
            with pytest.raises(grpc.aio.AioRpcError):
                await _all(channel, "Count", b"1,1,0")

    run(spec)


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(b"HTTP/1.1 400 Bad Request\r\n\r\n", id="not-http2"),
        pytest.param(frame(4, 0, 0, b"") + frame(0, 0, 1, b"x" * 20_000), id="oversized-frame"),
        pytest.param(
            frame(4, 0, 0, b"")
            + frame(1, 0, 1, b"\x88")
            + b"".join(frame(9, 0, 1, b"\x00" * 16_000) for _ in range(6)),
            id="endless-headers",
        ),
        pytest.param(frame(4, 0, 0, b"") + frame(5, 4, 1, b"\x00" * 8), id="push-promise"),
        pytest.param(frame(4, 0, 0, b"\x00\x04\xff\xff\xff\xff"), id="window-past-2^31"),
    ],
)
def test_a_worker_that_breaks_http2_costs_its_connection_only(run: Any, answer: bytes) -> None:
    async def spec() -> None:
        async with scripted(answer) as port:
            channel = StreamChannel(f"127.0.0.1:{port}")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await _all(channel, "Count", b"1,1,0", within=10)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            await channel.close()

    run(spec)


def _answer_head() -> bytes:
    """SETTINGS, then stream 1's response headers, as a gRPC server sends them."""
    block = hpack.Encoder().encode([(":status", "200"), ("content-type", "application/grpc")])
    return frame(4, 0, 0, b"") + frame(1, 4, 1, block)


def test_a_worker_that_sends_past_its_window_fails_that_call(run: Any) -> None:
    """100 messages of 1 KB in one write, while the reader is away: past 64 KiB
    unread the call fails, after the messages the window covered."""
    message = b"\x00" + (1000).to_bytes(4, "big") + b"x" * 1000
    flood = b"".join(frame(0, 0, 1, message) for _ in range(100))

    async def spec() -> None:
        async with scripted(_answer_head() + flood) as port:
            channel = StreamChannel(f"127.0.0.1:{port}")
            call = channel.unary_stream("/t.S/Count", b"", bytes, 10)
            got = 0
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                while await call.read() is not EOF:
                    got += 1
            assert caught.value.code() == grpc.StatusCode.INTERNAL
            assert "window" in (caught.value.details() or "")
            assert 32 <= got < 70
            await channel.close()

    run(spec)


def test_a_silent_worker_and_a_closed_port_are_bounded(run: Any) -> None:
    async def spec() -> None:
        async with scripted(b"") as port:
            channel = StreamChannel(f"127.0.0.1:{port}")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await _all(channel, "Count", b"1,1,0", within=0.3)
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            await channel.close()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            free = sock.getsockname()[1]
        channel = StreamChannel(f"127.0.0.1:{free}")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await _all(channel, "Count", b"1,1,0")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        await channel.close()

    run(spec)


def test_calls_over_mutual_tls_to_a_certificate_of_another_name(run: Any, tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path, "furnace-ca")
    worker = ca.issue("worker", dns=("engine.furnace.internal",))
    gateway = ca.issue("gateway", client=True)
    tls = client_credentials(
        ca.ca_file, gateway.cert_file, gateway.key_file, "engine.furnace.internal"
    )
    assert tls.context is not None
    served = _mutual_tls(worker, ca.ca_file)

    async def spec() -> None:
        async with _server(tls=served) as (_, port, _seen):
            channel = StreamChannel(f"127.0.0.1:{port}", tls.context, tls.server_name)
            try:
                got = await _all(channel, "Count", b"20,4,0")
                assert got == [str(i).encode().ljust(4, b".") for i in range(20)]
                assert await _all(channel, "Echo", b"x" * 300_000) == [b"x" * 300_000]
            finally:
                await channel.close()

    run(spec)


def test_a_worker_whose_certificate_is_not_trusted_is_unavailable(run: Any, tmp_path: Path) -> None:
    ca = CertificateAuthority(tmp_path, "furnace-ca")
    stranger = CertificateAuthority(tmp_path, "stranger-ca")
    worker = stranger.issue("worker", ips=("127.0.0.1",))
    gateway = ca.issue("gateway", client=True)
    tls = client_credentials(ca.ca_file, gateway.cert_file, gateway.key_file)
    served = _mutual_tls(worker, ca.ca_file)

    async def spec() -> None:
        async with _server(tls=served) as (_, port, _seen):
            channel = StreamChannel(f"127.0.0.1:{port}", tls.context)
            try:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await _all(channel, "Count", b"1,1,0")
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "certificate" in (refused.value.details() or "")
            finally:
                await channel.close()

    run(spec)


def test_an_address_that_is_not_host_and_port_is_refused() -> None:
    for target in ("dns:///engine", "dns:///engine:50051", "unix:engine:1", "engine"):
        with pytest.raises(ValueError):
            StreamChannel(target)
