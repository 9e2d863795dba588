"""gRPC server-streaming calls over an HTTP/2 client written on the event loop: how
the gateway reads vLLM's `Generate` stream (`gateway.upstreams.vllm_grpc`), where
the engine sends one message a token, and its `SubscribeKvEvents`, one a step.

Why not grpc.aio for that stream: each message grpc.aio reads is a batch of gRPC
core's completion queue, polled by a thread of its own and handed to the event loop,
so every token wakes two threads. Here the loop's own transport receives the frames
and `data_received` parses them in place: the message reaches the waiting reader in
the same callback. `benchmarks/bench_grpc_stream.py` measures both clients' CPU a
message against a grpc.aio server in one run.

What it speaks: HTTP/2 over cleartext TCP (prior knowledge, as gRPC does without TLS) or
over TLS (the worker must agree to `h2` by ALPN, as gRPC servers do), one connection per
worker opened on first use and opened again after it is lost or the worker sends GOAWAY;
request headers and a unary request body out (DATA frames under the worker's
flow-control windows and frame size), length-prefixed messages in, the status from the
trailers (or a trailers-only answer, or an HTTP status, as gRPC maps them; HPACK by
`h2_fields`). Failures are `grpc.aio.AioRpcError`s with gRPC's codes and details, so the
worker kinds' tables (`furnace_channel.from_rpc_error`, vLLM's) read them as they read
grpc.aio's. The deadline goes out as `grpc-timeout` and is kept here as well (a timer
that resets the stream); a cancel is a RST_STREAM. A dead peer is found by TCP
keepalive, not HTTP/2 pings, which gRPC servers count against a client that pings while
idle.

What a worker can make it hold is bounded: a stream's unread messages by its window
(`STREAM_WINDOW`: the worker waits until the reader takes them), a message by
`MAX_MESSAGE_BYTES` (RESOURCE_EXHAUSTED, as grpc.aio words it), a header block by
`MAX_HEADER_BLOCK` (the forms of good headers and OK trailers kept, `_KEPT_FORMS` of
each), a frame by HTTP/2's default size; a worker that breaks the protocol
loses the connection (GOAWAY, every call on it UNAVAILABLE), never the gateway.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar, cast
from urllib.parse import unquote

import grpc
import hpack

from gateway.protocol.grpc_options import MAX_MESSAGE_BYTES
from gateway.protocol.h2_fields import (
    EMPTY_TABLE,
    BlockDecoder,
    Fields,
    fields,
    metadata_fields,
    timeout_field,
)

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


class ServerStream(Protocol[T_co]):
    """What a reader of a server stream uses, of this module's calls and grpc.aio's alike."""

    async def read(self) -> T_co | object:
        """The next message, or `grpc.aio.EOF`."""

    def cancel(self) -> bool:
        """Stops the call; False if it had ended."""


_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# Frame types, flags and error codes of RFC 9113 that this client uses.
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _PUSH_PROMISE = 0x0, 0x1, 0x3, 0x4, 0x5
_PING, _GOAWAY, _WINDOW_UPDATE, _CONTINUATION = 0x6, 0x7, 0x8, 0x9
_END_STREAM = _ACK = 0x1
_END_HEADERS, _PADDED, _PRIORITY = 0x4, 0x8, 0x20
_NO_ERROR, _PROTOCOL_ERROR, _FLOW_CONTROL_ERROR, _FRAME_SIZE_ERROR = 0x0, 0x1, 0x3, 0x6
_REFUSED_STREAM, _CANCEL, _ENHANCE_YOUR_CALM = 0x7, 0x8, 0xB
# SETTINGS identifiers.
_HEADER_TABLE_SIZE, _ENABLE_PUSH, _MAX_CONCURRENT_STREAMS = 0x1, 0x2, 0x3
_INITIAL_WINDOW_SIZE, _MAX_FRAME_SIZE, _MAX_HEADER_LIST_SIZE = 0x4, 0x5, 0x6

#: HTTP/2's default (and largest) window and frame size before SETTINGS say otherwise.
_DEFAULT_WINDOW = 65_535
_DEFAULT_FRAME = 16_384
_MAX_WINDOW = 2**31 - 1
_MAX_STREAM_ID = 2**31 - 1
#: A frame's head (length in 3 bytes: its high 2, its low 1; type, flags, stream id) and
#: a gRPC message's prefix (compressed flag, length), each read in one call.
_FRAME_HEAD = struct.Struct(">HBBBL")
_unpack_head = _FRAME_HEAD.unpack_from
#: A frame's head written in one call: its length and type in 4 bytes, flags, stream id.
_pack_head = struct.Struct(">LBL").pack
_MESSAGE_PREFIX = struct.Struct(">BL")
_unpack_prefix = _MESSAGE_PREFIX.unpack_from
#: The last stream id a connection opens; the next call opens a new connection.
LAST_STREAM_ID = _MAX_STREAM_ID

#: The bytes of a stream's messages the worker may send before the reader takes them
#: (HTTP/2's default window, as the gateway's grpc.aio channels keep it: no BDP probe).
STREAM_WINDOW = _DEFAULT_WINDOW
#: Half a stream's window: once that much is received (and not held unread), it is given back.
_HALF_WINDOW = STREAM_WINDOW // 2
#: The connection's receive window: every stream's window together, many times over.
CONNECTION_WINDOW = 16 * 1024 * 1024
_HALF_CONNECTION_WINDOW = CONNECTION_WINDOW // 2
#: How long a call without a deadline waits for its connection to open.
CONNECT_TIMEOUT = 20.0
#: The largest header block (headers or trailers) a worker may send.
MAX_HEADER_BLOCK = 64 * 1024

#: An RST_STREAM's code as the call's gRPC status (gRPC's HTTP/2 transport spec).
_RESET_CODES = {
    _NO_ERROR: grpc.StatusCode.INTERNAL,
    _REFUSED_STREAM: grpc.StatusCode.UNAVAILABLE,
    _CANCEL: grpc.StatusCode.CANCELLED,
    _ENHANCE_YOUR_CALM: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
#: An HTTP status other than 200 as the call's gRPC status (same spec).
_HTTP_CODES = {
    400: grpc.StatusCode.INTERNAL,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.UNIMPLEMENTED,
    429: grpc.StatusCode.UNAVAILABLE,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.UNAVAILABLE,
}
_CODES = {code.value[0]: code for code in grpc.StatusCode}
#: The statuses as gRPC writes them in `grpc-status` ("0"): most trailers found in one look.
_STATUS_TEXTS = {str(value): code for value, code in _CODES.items()}
#: Response headers seen to open a call well (status 200, gRPC's content type), and
#: trailers seen to end one with OK, by their fields: a worker sends a few forms of each,
#: so a call's blocks are each one look, not their checks. At most `_KEPT_FORMS` each.
_GOOD_HEADERS: set[Fields] = set()
_OK_TRAILERS: set[Fields] = set()
_KEPT_FORMS = 16


def _keep(forms: set[Fields], block: Fields) -> None:
    if len(forms) >= _KEPT_FORMS:
        forms.clear()
    forms.add(block)


def grpc_timeout(seconds: float) -> str:
    """`seconds` as gRPC's `grpc-timeout` value: at most 8 digits, in the finest unit
    that fits (rounded down, at least 1)."""
    millis = int(seconds * 1000.0)
    if millis <= 99_999_999:  # every deadline under 27 hours: the loop's first unit, unrolled
        return f"{max(1, millis)}m"
    for unit, per_second in (("S", 1.0), ("M", 1 / 60), ("H", 1 / 3600)):
        value = max(1, int(seconds * per_second))
        if value <= 99_999_999:
            return f"{value}{unit}"
    return "99999999H"


def _failure(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


def _frame(kind: int, flags: int, stream_id: int, payload: bytes | memoryview = b"") -> bytes:
    return _pack_head(len(payload) << 8 | kind, flags, stream_id) + payload


class _ProtocolError(Exception):
    """The worker broke HTTP/2: the connection ends with a GOAWAY of this code."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class StreamCall(Generic[T]):
    """One server-streaming call: `await read()` for each message, then
    `grpc.aio.EOF`; a failed call raises its `AioRpcError`; `cancel()` resets it.
    Or, once started, `listen` and `poll`: the messages are taken in the connection's
    callback that brought them, with no task waiting on the call."""

    __slots__ = (
        "_body",
        "_channel",
        "_conn",
        "_deadline",
        "_deserialize",
        "_done",
        "_ended",
        "_error",
        "_head",
        "_inbox",
        "_listener",
        "_messages",
        "_queued",
        "_started",
        "_timer",
        "_unacked",
        "_waiter",
        "id",
        "send_window",
    )

    def __init__(
        self,
        channel: StreamChannel,
        head: bytes,
        body: bytes,
        deserialize: Callable[[bytes], T],
        deadline: float | None,
    ) -> None:
        self._channel = channel
        self._head: bytes | None = head  # the header block but `grpc-timeout`; None once sent
        self._body: bytes | memoryview = body  # a memoryview once sent in part
        self._deserialize = deserialize
        self._deadline = deadline
        self._conn: _Connection | None = None
        self.id = 0
        self.send_window = 0
        self._inbox = bytearray()  # DATA not yet a whole message
        self._messages: deque[bytes] = deque()
        self._queued = 0  # bytes in `_messages`
        self._unacked = 0  # bytes received and not yet given back to the worker's window
        self._started = False  # the worker's response headers arrived
        self._ended = False  # the worker ended the stream with OK
        self._done = False  # nothing more arrives: ended, failed or cancelled
        self._error: grpc.aio.AioRpcError | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._listener: Callable[[], None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    async def read(self) -> T | object:
        """The next message, or `grpc.aio.EOF` once the worker ended with OK."""
        if self._head is not None:
            await self._start()
        while (message := self.poll()) is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return message

    def listen(self, listener: Callable[[], None] | None) -> None:
        """Calls `listener` whenever messages came or the call ended (None: stop), in
        the callback that brought them; `poll` takes them."""
        self._listener = listener

    def poll(self) -> T | object | None:
        """The next message that came, `grpc.aio.EOF` once the worker ended with OK,
        or None while there is none; raises the call's `AioRpcError`."""
        messages = self._messages
        if not messages:
            if self._error is not None:
                raise self._error
            return grpc.aio.EOF if self._ended else None
        data = messages.popleft()
        self._queued -= len(data)
        if self._unacked >= _HALF_WINDOW and self._conn is not None and not self._done:
            self._conn.give_back(self)
        try:
            return self._deserialize(data)
        except Exception as error:  # as grpc.aio words it: the call fails, INTERNAL
            self.fail(grpc.StatusCode.INTERNAL, f"Exception deserializing response! {error}", True)
            raise self._error from None  # type: ignore[misc]

    async def arrived(self, within: float) -> bool:
        """Starts the call; whether a message or its end came within `within` seconds
        (nothing is taken: the next `read` has it)."""
        if self._head is not None:
            await self._start()
        if not self._messages and not self._done:
            loop = asyncio.get_running_loop()
            self._waiter = loop.create_future()
            timer = loop.call_later(within, self._wake)
            try:
                await self._waiter
            finally:
                self._waiter = None
                timer.cancel()
        return bool(self._messages) or self._done

    def cancel(self) -> bool:
        """Stops the call (RST_STREAM CANCEL to the worker); False if it had ended."""
        if self._done:
            return False
        self.fail(grpc.StatusCode.CANCELLED, "Locally cancelled by application!", reset=True)
        return True

    async def _start(self) -> None:
        block, self._head = self._head, None
        assert block is not None
        loop = asyncio.get_running_loop()
        if self._error is not None:
            raise self._error
        deadline, left = self._deadline, None
        if deadline is not None:
            left = deadline - loop.time()
            if left <= 0:
                self.fail(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
                raise self._error  # type: ignore[misc]
            self._timer = loop.call_at(deadline, self._expire)
            block += timeout_field(grpc_timeout(left))
        conn = self._channel.ready()
        if conn is None:  # (with one, nothing above has failed the call)
            try:  # a worker that never answers the connect (a lost node) is bounded too
                wait = CONNECT_TIMEOUT if left is None else left
                conn = await asyncio.wait_for(self._channel.connection(self), wait)
            except grpc.aio.AioRpcError as error:
                self._error = self._error or error
            except TimeoutError:
                self._error = self._error or (
                    _failure(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
                    if left is not None
                    else _failure(grpc.StatusCode.UNAVAILABLE, "The connect timed out.")
                )
            if self._error is not None or conn is None:  # failed while connecting
                self._finish()
                raise self._error  # type: ignore[misc]
        conn.start(self, block)

    def _expire(self) -> None:
        self._timer = None
        self.fail(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded", reset=True)

    # -- what the connection tells the call, inside its callbacks --------------------

    def data(self, payload: bytes, flow: int) -> None:
        """A DATA frame's payload (`flow`: the bytes it counted against the window).
        The reader is not woken here: the connection wakes each call once a read,
        after its DATA frames (`_Connection.data_received`)."""
        # the call is not done: its end took it out of the connection's streams
        unacked = self._unacked = self._unacked + flow
        if unacked > STREAM_WINDOW:  # past the window it was given: a broken worker
            self.fail(
                grpc.StatusCode.INTERNAL, "The worker sent past its flow-control window.", True
            )
            return
        inbox = self._inbox
        if not inbox:  # the usual frame: one whole message, uncompressed
            size = len(payload) - 5
            if size >= 0 and _unpack_prefix(payload) == (0, size) and size <= MAX_MESSAGE_BYTES:
                self._messages.append(payload[5:])
                self._queued += size
                return
        inbox += payload
        while len(inbox) >= 5:
            if inbox[0] != 0:
                self.fail(grpc.StatusCode.INTERNAL, "The worker sent a compressed message.", True)
                return
            size = int.from_bytes(inbox[1:5], "big")
            if size > MAX_MESSAGE_BYTES:
                self.fail(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"Received message larger than max ({size} vs. {MAX_MESSAGE_BYTES})",
                    reset=True,
                )
                return
            if len(inbox) < 5 + size:
                break
            self._messages.append(bytes(inbox[5 : 5 + size]))
            self._queued += size
            del inbox[: 5 + size]

    def owed(self) -> int:
        """The window to give back to the worker now: what was received, once half a
        window of it is out and the reader holds less than half a window unread."""
        if self._unacked < _HALF_WINDOW or self._queued >= _HALF_WINDOW:
            return 0
        owed, self._unacked = self._unacked, 0
        return owed

    def headers(self, headers: Fields, end_stream: bool) -> None:
        """A header block: the response's headers, then (with END_STREAM) its trailers."""
        if self._done:
            return
        if self._started:  # the usual trailers: OK, of a form seen (`_OK_TRAILERS`)
            if end_stream and headers in _OK_TRAILERS and not self._inbox:
                self._ended = True
                self._finish()
                return
        elif not end_stream and headers in _GOOD_HEADERS:  # the usual response headers
            self._started = True
            return
        fields = dict(headers)
        if not self._started:
            self._started = True
            status = fields.get(":status", "")
            if status != "200":
                code = _HTTP_CODES.get(int(status) if status.isdigit() else 0)
                self.fail(code or grpc.StatusCode.UNKNOWN, f"HTTP status {status or '?'}", True)
                return
            if not fields.get("content-type", "").startswith("application/grpc"):
                kind = fields.get("content-type", "none")
                self.fail(grpc.StatusCode.UNKNOWN, f"The worker answered {kind}, not gRPC.", True)
                return
            if not end_stream:
                _keep(_GOOD_HEADERS, headers)
                return
        elif not end_stream:
            self.fail(grpc.StatusCode.INTERNAL, "The worker sent headers twice.", reset=True)
            return
        raw = fields.get("grpc-status")
        code = _STATUS_TEXTS.get(raw)  # type: ignore[arg-type]
        if code is None and raw is not None and raw.isdigit():  # written otherwise ("00")
            code = _CODES.get(int(raw))
        if code is None:
            self.fail(grpc.StatusCode.UNKNOWN, f"The worker sent no valid grpc-status ({raw}).")
        elif code is not grpc.StatusCode.OK:
            self.fail(code, unquote(fields.get("grpc-message", "")))
        else:
            _keep(_OK_TRAILERS, headers)
            if self._inbox:
                self.fail(grpc.StatusCode.INTERNAL, "The worker ended inside a message.")
            else:
                self._ended = True
                self._finish()

    def reset(self, code: int) -> None:
        """The worker reset the stream (RST_STREAM)."""
        status = _RESET_CODES.get(code, grpc.StatusCode.INTERNAL)
        self.fail(status, f"The worker reset the stream (HTTP/2 error {code}).")

    def fail(self, code: grpc.StatusCode, details: str, reset: bool = False) -> None:
        """Ends the call with `code`; `reset`: tell the worker (RST_STREAM CANCEL)."""
        if self._done:
            return
        self._error = _failure(code, details)
        if code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
            self._messages.clear()  # ours to stop: nothing more is read
            self._queued = 0
        if reset and self._conn is not None:
            self._conn.reset(self, _CANCEL)
        self._finish()

    def _finish(self) -> None:
        self._done = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._conn is not None:
            self._conn.forget(self)
        self._channel.forget(self)
        self._wake()

    def _wake(self) -> None:
        listener = self._listener
        if listener is not None:
            listener()
            return
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


def _wake_all(calls: dict[StreamCall[Any], None]) -> None:
    """Wakes the reader of each call (its messages came), and forgets them."""
    for call in calls:
        call._wake()
    calls.clear()


class _Connection(asyncio.Protocol):
    """One HTTP/2 connection to a worker and the calls on it."""

    def __init__(self, channel: StreamChannel) -> None:
        self._channel = channel
        self.transport: asyncio.Transport | None = None
        self.streams: dict[int, StreamCall[Any]] = {}
        self._next_id = 1
        self.usable = True  # no GOAWAY, no break, stream ids left
        self.why = "The connection to the worker is closing."  # once not usable
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._table_note = EMPTY_TABLE  # what the next header block starts with
        self._decoder = BlockDecoder(MAX_HEADER_BLOCK)
        self._buffer = bytearray()
        self._block: bytearray | None = None  # a header block awaiting CONTINUATION
        self._block_stream = 0
        self._block_end = False
        self._peer_frame = _DEFAULT_FRAME
        self._peer_window = _DEFAULT_WINDOW  # each new stream's send window
        self._peer_streams = 2**31  # MAX_CONCURRENT_STREAMS
        self._send_window = _DEFAULT_WINDOW  # the connection's
        self._unacked = 0  # bytes received, not yet given back to the connection's window
        self._blocked: dict[int, StreamCall[Any]] = {}  # calls with body left to send

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            _keepalive(sock)
        settings = b"".join(
            key.to_bytes(2, "big") + value.to_bytes(4, "big")
            for key, value in (
                (_ENABLE_PUSH, 0),
                (_INITIAL_WINDOW_SIZE, STREAM_WINDOW),
                (_MAX_HEADER_LIST_SIZE, MAX_HEADER_BLOCK),
            )
        )
        increment = (CONNECTION_WINDOW - _DEFAULT_WINDOW).to_bytes(4, "big")
        transport.write(
            _PREFACE + _frame(_SETTINGS, 0, 0, settings) + _frame(_WINDOW_UPDATE, 0, 0, increment)
        )

    def has_room(self) -> bool:
        return self.usable and len(self.streams) < self._peer_streams

    def start(self, call: StreamCall[Any], block: bytes) -> None:
        """Opens `call`'s stream: its header `block` (`h2_fields`), then as much of its
        body as the windows allow."""
        assert self.transport is not None
        if not self.usable:  # it broke between the pick and now
            call.fail(grpc.StatusCode.UNAVAILABLE, self.why)
            return
        stream_id = self._next_id
        self._next_id += 2
        call._conn, call.id, call.send_window = self, stream_id, self._peer_window
        self.streams[stream_id] = call
        if self._next_id > LAST_STREAM_ID:  # ids spent: the next call opens a new connection
            self.usable = False
            self.why = "The connection's stream ids are spent."
            self._channel.lost(self)
        if self._table_note:
            block, self._table_note = self._table_note + block, b""
        limit = self._peer_frame
        if len(block) <= limit:  # the usual block: one HEADERS frame
            frames = [_frame(_HEADERS, _END_HEADERS, stream_id, block)]
        else:
            frames = [_frame(_HEADERS, 0, stream_id, block[:limit])]
            for at in range(limit, len(block), limit):
                piece = block[at : at + limit]
                last = at + limit >= len(block)
                frames.append(_frame(_CONTINUATION, _END_HEADERS if last else 0, stream_id, piece))
        # the headers and what the windows allow of the body: one write, not two
        if not self._body_frames(call, frames):
            self._blocked[stream_id] = call
        self.transport.write(b"".join(frames))

    def _push(self, call: StreamCall[Any]) -> None:
        """Sends what the windows allow of `call`'s body; the last frame ends the stream."""
        assert self.transport is not None
        frames: list[bytes] = []
        if self._body_frames(call, frames):
            del self._blocked[call.id]
        if frames:
            self.transport.write(b"".join(frames))

    def _body_frames(self, call: StreamCall[Any], frames: list[bytes]) -> bool:
        """The DATA frames of what the windows allow of `call`'s body, appended to
        `frames` and counted as sent; the last one ends the stream. Whether it went."""
        body = call._body
        left = len(body)
        if left <= min(self._peer_frame, call.send_window, self._send_window):
            # the usual body: whole in one frame (the loop's one turn, unrolled)
            frames.append(_frame(_DATA, _END_STREAM, call.id, body))
            call.send_window -= left
            self._send_window -= left
            call._body = b""
            return True
        body = memoryview(body)  # (sent in pieces: each a slice, not a copy of the rest)
        went = False
        while True:
            size = min(left, self._peer_frame, call.send_window, self._send_window)
            if size < left and size <= 0:
                break
            left -= size
            frames.append(_frame(_DATA, 0 if left else _END_STREAM, call.id, bytes(body[:size])))
            call.send_window -= size
            self._send_window -= size
            body = body[size:]
            if not left:
                went = True
                break
        call._body = body
        return went

    def give_back(self, call: StreamCall[Any]) -> None:
        owed = call.owed()
        if owed and self.transport is not None and call.id in self.streams:
            self.transport.write(_frame(_WINDOW_UPDATE, 0, call.id, owed.to_bytes(4, "big")))

    def reset(self, call: StreamCall[Any], code: int) -> None:
        if self.transport is not None and call.id in self.streams:
            self.transport.write(_frame(_RST_STREAM, 0, call.id, code.to_bytes(4, "big")))

    def forget(self, call: StreamCall[Any]) -> None:
        self.streams.pop(call.id, None)
        if self._blocked:  # seldom: a body the windows held back
            self._blocked.pop(call.id, None)
        self._channel.room_freed()
        if not self.usable and not self.streams and self.transport is not None:
            self.transport.close()

    def close(self, error: grpc.aio.AioRpcError | None = None) -> None:
        """Ends the connection (a GOAWAY first), failing the calls still on it."""
        self.usable = False
        if self.transport is not None and not self.transport.is_closing():
            goaway = (self._next_id - 2 if self._next_id > 1 else 0).to_bytes(4, "big")
            self.transport.write(_frame(_GOAWAY, 0, 0, goaway + _NO_ERROR.to_bytes(4, "big")))
            self.transport.close()
        self._fail_all(error or _failure(grpc.StatusCode.CANCELLED, "The channel was closed."))

    def _fail_all(self, error: grpc.aio.AioRpcError) -> None:
        for call in list(self.streams.values()):
            call.fail(error.code(), error.details() or "")

    def connection_lost(self, exc: Exception | None) -> None:
        if self.usable:
            self.usable = False
            self.why = "Connection to the worker lost" + (f": {exc}" if exc else ".")
        self._fail_all(_failure(grpc.StatusCode.UNAVAILABLE, self.why))
        self._channel.lost(self)
        if not self.lost.done():
            self.lost.set_result(None)

    # -- frames in ------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        if buffer:
            buffer += data
            view: bytes | bytearray = buffer
            copy = True  # a payload must not be a view of the buffer cut below
        else:  # the usual read: whole frames, parsed from the bytes as they came
            view = data
            copy = False
        at, end = 0, len(view)
        received = self._unacked  # the connection's, kept here through the read
        # The calls that got DATA, woken once each after the read's frames (or before any
        # other frame, so their messages come first): their readers take a read's messages
        # in one go, a wake and a write to the client a read rather than a message. A dict
        # as an ordered set: a call is put in once, however many of its frames came.
        woken: dict[StreamCall[Any], None] = {}
        try:
            while end - at >= 9:
                high, low, kind, flags, stream_id = _unpack_head(view, at)
                size = high << 8 | low
                if size > _DEFAULT_FRAME:
                    raise _ProtocolError(_FRAME_SIZE_ERROR, f"a frame of {size} bytes")
                start = at + 9
                stop = start + size
                if stop > end:
                    break
                stream_id &= _MAX_STREAM_ID
                payload = bytes(view[start:stop]) if copy else data[start:stop]
                at = stop
                if kind == _DATA and self._block is None:  # a stream's message: inline
                    received += size
                    if received > CONNECTION_WINDOW:
                        raise _ProtocolError(
                            _FLOW_CONTROL_ERROR, "DATA past the connection's window"
                        )
                    call = self.streams.get(stream_id)
                    if call is not None:
                        # flags on DATA are seldom any (PADDED, END_STREAM): tested once
                        call.data(_unpad(payload, flags) if flags else payload, size)
                        woken[call] = None
                        if call._unacked >= _HALF_WINDOW:
                            self.give_back(call)
                        if flags and flags & _END_STREAM and not call._done:
                            call.fail(
                                grpc.StatusCode.INTERNAL, "The worker ended without trailers."
                            )
                else:
                    if woken:  # (`_wake_all`, inline)
                        for woke in woken:
                            woke._wake()
                        woken.clear()
                    self._frame(kind, flags, stream_id, payload)
        except _ProtocolError as error:
            _wake_all(woken)
            self._broken(error)
            return
        finally:
            self._unacked = received
            if buffer:
                del buffer[:at]
            elif at < end:
                buffer += data[at:]
        for call in woken:
            call._wake()
        if received >= _HALF_CONNECTION_WINDOW and self.transport is not None:
            self._unacked = 0
            self.transport.write(_frame(_WINDOW_UPDATE, 0, 0, received.to_bytes(4, "big")))

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        """Every frame but DATA outside a header block (`data_received` reads those)."""
        if self._block is not None and kind != _CONTINUATION:
            raise _ProtocolError(_PROTOCOL_ERROR, "a header block cut by another frame")
        # the kinds a call brings first: its headers and trailers, the worker's windows
        if kind == _HEADERS:
            block = _unpad(payload, flags) if flags & _PADDED else payload
            if flags & _PRIORITY:
                block = block[5:]
            if flags & _END_HEADERS:  # the usual block: one frame, decoded as it came
                self._headers_done(block, stream_id, flags & _END_STREAM)
            else:
                self._block, self._block_stream = bytearray(block), stream_id
                self._block_end = bool(flags & _END_STREAM)
        elif kind == _WINDOW_UPDATE:
            self._window_update(stream_id, payload)
        elif kind == _PING:
            if len(payload) != 8:
                raise _ProtocolError(_FRAME_SIZE_ERROR, "a PING not of 8 bytes")
            if not flags & _ACK and self.transport is not None:
                self.transport.write(_frame(_PING, _ACK, 0, payload))
        elif kind == _CONTINUATION:
            if self._block is None or stream_id != self._block_stream:
                raise _ProtocolError(_PROTOCOL_ERROR, "a CONTINUATION out of place")
            self._block += payload
            if len(self._block) > MAX_HEADER_BLOCK:
                raise _ProtocolError(_ENHANCE_YOUR_CALM, "a header block past the bound")
            if flags & _END_HEADERS:
                whole, self._block = self._block, None
                self._headers_done(bytes(whole), self._block_stream, self._block_end)
        elif kind == _RST_STREAM:
            call = self.streams.get(stream_id)
            if call is not None and len(payload) == 4:
                call.reset(int.from_bytes(payload, "big"))
        elif kind == _SETTINGS:
            if stream_id or len(payload) % 6 or (flags & _ACK and payload):
                raise _ProtocolError(_FRAME_SIZE_ERROR, "a malformed SETTINGS frame")
            if not flags & _ACK:
                self._settings(payload)
        elif kind == _GOAWAY:
            self._goaway(payload)
        elif kind == _PUSH_PROMISE:
            raise _ProtocolError(_PROTOCOL_ERROR, "a PUSH_PROMISE, which we disabled")
        # PRIORITY and unknown frame types are ignored, as HTTP/2 asks.

    def _headers_done(self, block: bytes, stream_id: int, end_stream: int) -> None:
        """A whole header block of `stream_id` (`end_stream`: its frame ended the stream)."""
        try:  # every block is decoded: the HPACK table follows them all
            headers = self._decoder.decode(block)
        except hpack.HPACKError as error:
            raise _ProtocolError(
                _PROTOCOL_ERROR, f"a header block HPACK refuses: {error}"
            ) from None
        call = self.streams.get(stream_id)
        if call is not None:
            call.headers(headers, bool(end_stream))

    def _settings(self, payload: bytes) -> None:
        for at in range(0, len(payload), 6):
            key = int.from_bytes(payload[at : at + 2], "big")
            value = int.from_bytes(payload[at + 2 : at + 6], "big")
            if key == _HEADER_TABLE_SIZE:  # whatever it is, we say our table is empty
                self._table_note = EMPTY_TABLE
            elif key == _MAX_CONCURRENT_STREAMS:
                self._peer_streams = value
            elif key == _INITIAL_WINDOW_SIZE:
                if value > _MAX_WINDOW:
                    raise _ProtocolError(_FLOW_CONTROL_ERROR, "a window past 2^31-1")
                for call in self.streams.values():
                    call.send_window += value - self._peer_window
                self._peer_window = value
            elif key == _MAX_FRAME_SIZE:
                if not _DEFAULT_FRAME <= value <= 2**24 - 1:
                    raise _ProtocolError(_PROTOCOL_ERROR, f"a MAX_FRAME_SIZE of {value}")
                self._peer_frame = value
        assert self.transport is not None
        self.transport.write(_frame(_SETTINGS, _ACK, 0))
        self._unblock()
        self._channel.room_freed()

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise _ProtocolError(_FRAME_SIZE_ERROR, "a WINDOW_UPDATE not of 4 bytes")
        increment = int.from_bytes(payload, "big") & _MAX_WINDOW
        if stream_id == 0:
            self._send_window += increment
            if self._send_window > _MAX_WINDOW:
                raise _ProtocolError(_FLOW_CONTROL_ERROR, "a connection window past 2^31-1")
        else:
            call = self.streams.get(stream_id)
            if call is None:
                return
            call.send_window += increment
            if call.send_window > _MAX_WINDOW:
                call.fail(grpc.StatusCode.INTERNAL, "The worker's window passed 2^31-1.", True)
                return
        if self._blocked:  # (seldom: the usual WINDOW_UPDATE finds every body sent whole)
            self._unblock()

    def _unblock(self) -> None:
        for call in list(self._blocked.values()):
            if self._send_window <= 0:
                break
            self._push(call)

    def _goaway(self, payload: bytes) -> None:
        if len(payload) < 8:
            raise _ProtocolError(_FRAME_SIZE_ERROR, "a GOAWAY under 8 bytes")
        last = int.from_bytes(payload[:4], "big") & _MAX_STREAM_ID
        code = int.from_bytes(payload[4:8], "big")
        self.usable = False
        self.why = f"The worker is going away (HTTP/2 code {code})."
        self._channel.lost(self)
        for stream_id, call in list(self.streams.items()):
            if stream_id > last:  # never processed: another connection may take it
                call.fail(grpc.StatusCode.UNAVAILABLE, f"The worker is going away ({code}).")
        if not self.streams and self.transport is not None:
            self.transport.close()

    def _broken(self, error: _ProtocolError) -> None:
        """The worker broke the protocol: GOAWAY with its code, every call UNAVAILABLE."""
        self.usable = False
        self.why = f"The worker broke HTTP/2: {error}."
        self._channel.lost(self)
        if self.transport is not None and not self.transport.is_closing():
            last = (self._next_id - 2 if self._next_id > 1 else 0).to_bytes(4, "big")
            self.transport.write(_frame(_GOAWAY, 0, 0, last + error.code.to_bytes(4, "big")))
            self.transport.close()
        self._fail_all(_failure(grpc.StatusCode.UNAVAILABLE, f"The worker broke HTTP/2: {error}."))


def _unpad(payload: bytes, flags: int) -> bytes:
    if not flags & _PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        raise _ProtocolError(_PROTOCOL_ERROR, "padding past the frame")
    return payload[1 : len(payload) - payload[0]]


def _keepalive(sock: socket.socket) -> None:
    """TCP keepalive: a peer gone silent (a node lost) is found within a minute."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3)):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


class StreamChannel:
    """Server-streaming gRPC calls to one `host:port`, on one connection at a time; it
    opens the connection on first use and again after one is lost. With `tls`, over
    TLS, the worker's certificate checked for `server_name` (None: the host)."""

    def __init__(
        self, address: str, tls: ssl.SSLContext | None = None, server_name: str | None = None
    ) -> None:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit() or "/" in host or host.startswith("unix:"):
            raise ValueError(f"not a host:port address: {address!r}")
        self.address = address
        self._host, self._port = host.strip("[]"), int(port)
        self._tls = tls
        self._server_name = (server_name or self._host) if tls is not None else None
        self._scheme = "http" if tls is None else "https"
        self._conn: _Connection | None = None
        self._connecting: asyncio.Task[_Connection] | None = None
        self._old: set[_Connection] = set()  # draining after a GOAWAY, until they close
        self._waiting: deque[tuple[StreamCall[Any], asyncio.Future[None]]] = deque()
        self._closed = False
        self._why = "The connection to the worker closed."  # the last one's end
        self._fixed: dict[str, bytes] = {}  # a method's fixed header fields, encoded

    def unary_stream(
        self,
        method: str,
        request: bytes,
        deserialize: Callable[[bytes], T],
        timeout: float | None,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> StreamCall[T]:
        """A call of `method` (`/package.Service/Method`) with the serialized
        `request`; it starts on its first read and must end within `timeout` s
        (None: a subscription, no deadline, its connect bounded by `CONNECT_TIMEOUT`)."""
        fixed = self._fixed.get(method)
        if fixed is None:
            fixed = self._fixed[method] = fields(
                [
                    (":method", "POST"),
                    (":scheme", self._scheme),
                    (":path", method),
                    (":authority", self.address),
                    ("content-type", "application/grpc"),
                    ("te", "trailers"),
                ]
            )
        if metadata:  # never indexed: it may carry a credential
            fixed += metadata_fields(metadata)
        body = _MESSAGE_PREFIX.pack(0, len(request)) + request
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        return StreamCall(self, fixed, body, deserialize, deadline)

    def ready(self) -> _Connection | None:
        """The open connection, when it has room for one more stream."""
        conn = self._conn  # (`has_room`, inline: a call each request)
        if conn is not None and conn.usable and len(conn.streams) < conn._peer_streams:
            return conn
        return None

    async def connection(self, call: StreamCall[Any]) -> _Connection:
        """A connection with room for one more stream: the open one, or one this call
        opens (UNAVAILABLE if it does not open, or breaks before the call starts)."""
        tried = False
        while True:
            if call._error is not None:  # it ended while it waited
                raise call._error
            if self._closed:
                raise _failure(grpc.StatusCode.CANCELLED, "The channel was closed.")
            conn = self._conn
            if conn is not None and conn.has_room():
                return conn
            if conn is not None and conn.usable:  # the worker's stream limit: wait a turn
                waiter = asyncio.get_running_loop().create_future()
                self._waiting.append((call, waiter))
                await waiter
                continue
            if tried:
                raise _failure(grpc.StatusCode.UNAVAILABLE, self._why)
            tried = True
            if self._connecting is None:
                self._connecting = asyncio.get_running_loop().create_task(self._connect())
            try:
                await asyncio.shield(self._connecting)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not self._closed or (task is not None and task.cancelling()):
                    raise
            except OSError as error:
                raise _failure(
                    grpc.StatusCode.UNAVAILABLE, f"Cannot connect to {self.address}: {error}"
                ) from None

    async def _connect(self) -> _Connection:
        try:
            loop = asyncio.get_running_loop()
            transport, conn = await loop.create_connection(
                lambda: _Connection(self),
                self._host,
                self._port,
                ssl=self._tls,
                server_hostname=self._server_name,
            )
            if self._tls is not None:
                agreed = transport.get_extra_info("ssl_object").selected_alpn_protocol()
                if agreed != "h2":
                    conn.close()
                    raise OSError(f"the worker did not agree to HTTP/2 over TLS (ALPN {agreed})")
            if self._closed:
                conn.close()
            else:
                self._conn = conn
            return conn
        finally:
            self._connecting = None

    def room_freed(self) -> None:
        """A stream ended or the limit rose: the next waiting call may go."""
        while self._waiting:
            _, waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def forget(self, call: StreamCall[Any]) -> None:
        for entry in self._waiting:
            if entry[0] is call and not entry[1].done():
                entry[1].set_result(None)  # it wakes, sees its end and leaves

    def lost(self, conn: _Connection) -> None:
        self._why = conn.why
        if self._conn is conn:
            self._conn = None
            if conn.streams and not conn.lost.done():
                self._old.add(conn)
                conn.lost.add_done_callback(lambda _: self._old.discard(conn))
        self.room_freed()

    async def close(self) -> None:
        """Ends every call (CANCELLED) and the connections, and waits until they are closed."""
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
            await asyncio.gather(self._connecting, return_exceptions=True)
        conns = [c for c in (self._conn, *self._old) if c is not None]
        self._conn = None
        for conn in conns:
            conn.close()
        for _, waiter in self._waiting:
            if not waiter.done():
                waiter.set_result(None)
        if conns:
            await asyncio.wait([c.lost for c in conns], timeout=1.0)
            for conn in conns:
                if not conn.lost.done() and conn.transport is not None:
                    conn.transport.abort()
