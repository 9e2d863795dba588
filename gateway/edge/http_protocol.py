"""Bounds on HTTP/1.1 before a request reaches the app: the head's size and
header count, a deadline for the head and one for the body, and a cap on open
connections (the remedies of Envoy and NGINX: `max_request_headers_kb`,
`max_headers_count`, `client_header_timeout`, `client_body_timeout`,
`max_connections`).

uvicorn's httptools protocol buffers a header until its end, has no deadline
for the head or the body, and only closes idle keep-alive connections. Here:

- the head (request line + headers) is counted as it is fed to the parser: the
  bytes of each read while the head is unfinished, and each header as the
  parser delivers it; past `max_header_bytes` or `max_headers` the answer is a
  431 in OpenAI's shape and the connection closes, so at most one read (uvloop
  reads up to 256 KiB) more than the limit is ever held;
- one deadline per connection, set for `header_timeout` when the connection
  opens and when a keep-alive response completes, for `body_timeout` when the
  head is complete, cleared when the body is: a deadline for the whole head or
  body, not per read, so a client dribbling a byte at a time is cut at the
  deadline. One timer (`loop.call_at`) watches it, moved only when a deadline
  comes sooner than it is set for; when it fires before the deadline it is set
  again for it. A late head gets 408 (nothing at all:
  just closed); a late body gets 408 and its request sees a disconnect (the
  route refuses it before taking a slot);
- `max_connections` is counted here, on the connection, not with uvicorn's
  `limit_concurrency`, which also counts running requests (the slots'
  business, `max_concurrent_requests`) and answers a plain-text 503 after
  reading the head. Its default (0) is three quarters of the process's open-file
  limit (RLIMIT_NOFILE), so the cap is reached before `accept` fails for want
  of a descriptor, with room left for the workers' sockets.

Under connection pressure, as Envoy's overload manager does: from `SCALE_FROM`
of `max_connections` open, the head's deadline (also the idle one between
requests) shrinks in proportion, down to `MIN_HEAD_TIMEOUT` when full; and a
connection over the cap is served by closing the connection that has waited
longest without sending a whole request head (silent or idle, oldest first:
an ordered dict of them, O(1) a connection). Only when every open connection
has a request in flight does the newcomer get a 503 in OpenAI's shape, closed
at once. 300 silent connections with a file limit of 256 had kept 5 of 5
clients out for the whole `header_timeout`.

Pipelined requests (HTTP/1.1 clients rarely send them) are bounded too. uvicorn
parses everything it reads and queues each complete request behind the answer
being written, re-reading after every answer: one connection writing `GET
/v1/models` a thousand times per write and never reading its answers grew the
process by a gigabyte. httptools cannot stop mid-read the way Envoy's and NGINX's
parsers do (read the next request only once the current one is answered), so:
at most `PIPELINE_DEPTH` requests wait behind the one being answered; the next
head stops the parser, the ones waiting are answered in order, and the
connection then closes (RFC 9112 §9.3.2: a client retries what was not answered
on a new connection). Reading stays paused while any request waits (uvicorn
resumed it after every answer), so what waits is at most those requests and one
read. The queue takes its oldest from the front of a short list.

A refused connection says so, half-closes (FIN), then reads and drops what the
client still sends for `LINGER` seconds before closing, so the client reads the
answer instead of a reset (NGINX's lingering close, shorter).

A response's head goes out with its first body bytes, in one write, when they are
sent in the same turn of the loop (as hyper, under the Rust routers, writes them):
uvicorn writes each ASGI message at once, and on loopback a write costs the sender
the receiver's TCP work too. `_HeadHold` keeps the request's first write until the
second or the end of the turn, then hands the cycle back the transport.

A request whose body is small (a `content-length` up to uvicorn's read buffer,
`HIGH_WATER_LIMIT`, 64 KiB, and no `100-continue` asked) starts its task when its body is
whole, not at its head: clients such as httpx write the head and the body apart, and a task
started at the head ran up to its first `receive()`, slept, and was woken again by the body,
a second wake of the request's chain of coroutines on the first token's path. uvicorn reads
such a body into its buffer whatever the app does, so nothing more is held; a body that does
not come whole within `body_timeout` gets its 408 without the app ever seeing the request.

A chunked body's framing is bounded as a head is: the bytes read since the last body bytes
(chunk-size lines, their extensions, the trailer section) count toward `max_header_bytes`,
then 431. httptools gathers a field's value by concatenation, so one endless trailer field
had grown the process by hundreds of megabytes and held the event loop for seconds a read.
Trailer fields are read and dropped: they never join the request's headers (RFC 9110 §6.5.1).

A request that asks for a protocol upgrade (h2c, WebSocket: the gateway serves neither) is
answered over HTTP/1.1, as if it had not asked (RFC 9110 §7.8). httptools skips the body of
such a request and stops after its head, so the head is read a second time without its
Upgrade field (`_replay`), and its body with it; uvicorn answered it with an empty body.

Bytes that are not HTTP/1.1 get a 400 in OpenAI's shape (uvicorn's is plain text), or, while
another response is on the wire, only the close: an answer there would land inside it. Every
refusal written here (400, 408, 431) to a request under `/v1/messages` is in Anthropic's shape,
as the app's own are there.

A stream answered to an HTTP/1.0 request goes out close-delimited, not chunked
(`_CloseDelimited`): such a client cannot read chunks (RFC 9112 §6.1).

The cost: a length addition per read and per header, a clock read per deadline.
"""

from __future__ import annotations

import asyncio
import math
import resource
import weakref
from dataclasses import dataclass, replace
from itertools import chain
from typing import Any, ClassVar, cast

import httptools
from uvicorn.protocols.http.flow_control import HIGH_WATER_LIMIT
from uvicorn.protocols.http.httptools_impl import (
    STATUS_LINE,
    HttpToolsProtocol,
    RequestResponseCycle,
)

from gateway.edge.anthropic.errors import anthropic_body
from gateway.edge.asgi import (
    ABORT_EXTENSION,
    BODY_REFUSED_EXTENSION,
    BODY_TIMEOUT_EXTENSION,
    LOST_EXTENSION,
    WRITE_NOW_EXTENSION,
)
from gateway.edge.errors import SERVER, APIError, request_timeout

#: Seconds a refused connection keeps reading (and dropping) before it closes.
LINGER = 1.0
#: Requests that may wait, parsed, behind the one being answered on a connection.
PIPELINE_DEPTH = 16
#: Past this share of `max_connections` open, the head's deadline shrinks...
SCALE_FROM = 0.5
#: ...down to this many seconds (or `header_timeout`, if shorter) when all are open.
MIN_HEAD_TIMEOUT = 1.0
#: `max_connections` 0: this share of the process's open-file limit.
FILE_LIMIT_SHARE = 0.75

_HEAD, _BODY = "head", "body"
#: What bytes that are not an HTTP/1.1 request get (uvicorn's answer, in OpenAI's shape).
INVALID_HTTP = APIError(400, "Invalid HTTP request received.")
#: The request targets whose refusals here are in Anthropic's shape, as the app's are
#: (`AnthropicShape`: Anthropic's Messages API, and below it).
_ANTHROPIC, _BELOW_ANTHROPIC = b"/v1/messages", (b"/v1/messages/", b"/v1/messages?")


@dataclass(frozen=True)
class HttpLimits:
    """What `GuardedHttpProtocol` enforces; from the gateway's config."""

    max_header_bytes: int
    max_headers: int
    header_timeout: float
    body_timeout: float
    max_connections: int
    retry_after: int


class _Heads:
    """One listener's connections that have not sent a whole request head, oldest
    first (silent, or idle between requests), and those closed for a newcomer and
    not yet gone."""

    __slots__ = ("closing", "waiting")

    def __init__(self) -> None:
        self.waiting: dict[GuardedHttpProtocol, None] = {}
        self.closing = 0


class _Pipeline(list[Any]):
    """What uvicorn's protocol uses of a deque for its pipelined requests: at most
    `PIPELINE_DEPTH` of them, so taking the oldest from the front is cheap."""

    __slots__ = ()

    def appendleft(self, item: Any) -> None:
        """Queues `item` (`pop` takes the oldest)."""
        self.append(item)

    def pop(self, index: int = 0) -> Any:  # type: ignore[override]
        """The oldest request queued."""
        return super().pop(index)


class _HeadHold:
    """The transport a request's cycle writes its first bytes to: it keeps them until the
    next write (sent together) or the end of the loop's turn (sent alone), then gives the
    cycle the real transport, so the later writes (a stream's tokens) cost nothing
    more. Order is kept either way: nothing else writes to the connection meanwhile."""

    __slots__ = ("_cycle", "_held", "_transport")

    def __init__(self, cycle: Any, transport: asyncio.Transport) -> None:
        self._cycle, self._transport = cycle, transport
        self._held = b""

    def write(self, data: bytes) -> None:
        """Holds the first write; sends it with the second."""
        if self._held:
            self._release(data)
        else:
            self._held = bytes(data)
            asyncio.get_running_loop().call_soon(self._release)

    def _release(self, data: bytes = b"") -> None:
        if self._cycle.transport is self:
            self._cycle.transport = self._transport
            self._transport.write(self._held + data)
            self._held = b""

    def close(self) -> None:
        self._release()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _WriteNow:
    """`WRITE_NOW_EXTENSION`: a body chunk written as uvicorn's `send` would write it,
    but outside a task, and only when that `send` would not wait (the client reads:
    no paused flow) and the response is open and chunked (`writable`); otherwise the
    caller awaits `send`, under its write guard. It holds its cycle weakly: the
    cycle's scope holds it, and a cycle of references would outlive the request
    until the collector's next pass."""

    __slots__ = ("_cycle",)

    def __init__(self, cycle: Any) -> None:
        self._cycle = weakref.ref(cycle)

    def writable(self) -> bool:
        """Whether a chunk would be written now: asked before one is built, since
        building it may count it (a Responses stream's sequence numbers)."""
        cycle = self._cycle()
        return not (
            cycle is None
            or cycle.disconnected
            or cycle.flow.write_paused
            or cycle.response_complete
            or not cycle.chunked_encoding
        )

    def write(self, body: bytes) -> None:
        """Writes a chunk, once `writable` said it would be, in the same callback."""
        cycle = self._cycle()
        assert cycle is not None  # writable
        cycle.transport.write(b"%x\r\n%b\r\n" % (len(body), body))


class _CloseDelimited:
    """The ASGI `send` of an HTTP/1.0 request's cycle. A response of no declared length (a
    stream) goes out close-delimited, its body ending where the connection does (RFC 9112
    §6.3), not chunked as uvicorn writes it whatever the request's version: a server must
    not send Transfer-Encoding to an HTTP/1.0 client (§6.1), and such clients (ApacheBench,
    NGINX's default `proxy_http_version 1.0`) read the chunks' framing as the body. The
    cycle is held weakly, as `_WriteNow` holds it; `_WriteNow.writable` says no to such a
    response (it is not chunked), so its writes come here."""

    __slots__ = ("_cycle", "_open")

    def __init__(self, cycle: Any) -> None:
        self._cycle = weakref.ref(cycle)
        self._open = False  # a close-delimited body is being written

    async def __call__(self, message: Any) -> None:
        cycle = self._cycle()
        if cycle is None:
            return
        kind = message["type"]
        if kind == "http.response.start" and not cycle.response_started:
            names = {name.lower() for name, _ in message.get("headers", ())}
            if (
                b"content-length" not in names
                and b"transfer-encoding" not in names
                and cycle.scope["method"] != "HEAD"
                and message["status"] not in (204, 304)
            ):
                self._open = True
                cycle.chunked_encoding = False
                cycle.keep_alive = False  # the close ends the body: "connection: close"
                cycle.expected_content_length = _UNTIL_CLOSE
        elif kind == "http.response.body" and self._open and not message.get("more_body"):
            cycle.expected_content_length = len(message.get("body", b""))  # all it takes
        await RequestResponseCycle.send(cycle, message)


#: The length uvicorn's cycle is told a close-delimited body has: more than any body.
_UNTIL_CLOSE = 2**63


def _whole_first(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a request's task should wait for its whole body: a declared length (or none:
    no body) that uvicorn's buffer holds without pausing the reads. (The parser refuses a
    head with both headers, or two lengths: the dict, made in C, loses nothing.)"""
    fields = dict(headers)
    if b"transfer-encoding" in fields:
        return False
    value = fields.get(b"content-length")
    if value is None:
        return True
    return len(value) <= 6 and value.isdigit() and int(value) <= HIGH_WATER_LIMIT


class _Refused(Exception):
    """Raised from a parser callback to stop parsing: the head is over a limit."""


class _PipelineFull(Exception):
    """Raised from a parser callback to stop parsing: `PIPELINE_DEPTH` requests wait."""


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds above; `protocol_for` binds
    the limits."""

    limits: ClassVar[HttpLimits]
    heads: ClassVar[_Heads]

    # Slots, not uvicorn's instance dict: seven more keys there would double the dict
    # of every connection (about 1.5 KiB each).
    __slots__ = (
        "_deferred",
        "_due",
        "_evicted",
        "_fed",
        "_head_bytes",
        "_lingering",
        "_phase",
        "_refused",
        "_replay_head",
        "_started",
        "_timeout",
        "_timer",
        "_timer_at",
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn's pipelined requests (rare) in an empty list, not a deque: a deque
        # allocates a block of 64 entries at once, 0.7 KiB on every connection.
        self.pipeline = _Pipeline()  # type: ignore[assignment]
        #: What the parser reads now: the head (also between requests) or a body.
        self._phase = _HEAD
        #: Bytes fed while the head is unfinished; the URL's bytes (the headers' are
        #: added once the head is whole: `_head_too_large`).
        self._fed = 0
        self._head_bytes = 0
        #: Whether any byte of the current head arrived (a silent timeout gets no 408).
        self._started = False
        self._due = math.inf  # the current deadline (`_arm`); inf: none
        self._timeout = 0.0  # the seconds it was armed for
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf  # when `_timer` fires
        self._lingering = False  # refused: the deadline closes the connection
        self._refused = False
        self._evicted = False  # closed to make room for a newer connection
        #: Resolved when the connection is lost (LOST_EXTENSION); made with the first head.
        self._lost: asyncio.Future[None] | None = None
        #: The request whose task starts once its body is whole (`_start_asgi_task`).
        self._deferred: tuple[Any, Any] | None = None
        #: The head of a request that asked for an upgrade, less its Upgrade (`_replay`).
        self._replay_head: bytes | None = None

    # The connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        limits = self.limits
        heads = self.heads
        if len(self.connections) - heads.closing > limits.max_connections:
            if heads.waiting:  # make room: the oldest without a whole request head
                oldest = next(iter(heads.waiting))
                oldest._evict()
                self._await_head()
                return
            self._refused = True
            error = APIError(
                503,
                "The gateway has too many open connections; retry shortly.",
                type=SERVER,
                code="server_busy",
                retry_after=limits.retry_after,
            )
            self._write_error(error)
            transport.close()
            return
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._deferred = None  # its body never came whole: the app never sees it
        self._stop_timer()
        self.heads.waiting.pop(self, None)
        if self._evicted:
            self.heads.closing -= 1
        super().connection_lost(exc)
        lost = self._lost
        if lost is not None and not lost.done():
            lost.set_result(None)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # lingering: read and drop
        self._unset_keepalive_if_required()
        if self._phase == _HEAD:
            self._started = True
        self._fed += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            rest = data[upgrade.args[0] :]
        except httptools.HttpParserError as error:
            if isinstance(error.__context__, _Refused):
                self._refuse_request(self._too_large())
            elif isinstance(error.__context__, _PipelineFull):
                self._stop_after_pipeline()
            else:
                self.logger.warning("Invalid HTTP request received.")
                self._refuse_request(INVALID_HTTP)
            return
        else:
            if self._fed > self.limits.max_header_bytes:  # a head, or a body's framing
                self._refuse_request(self._too_large())
            return
        # outside the handler: errors raised while reading again keep their own context
        self._replay(rest)

    def _should_upgrade(self) -> bool:
        """Never: the gateway serves no WebSocket and no h2c (uvicorn's asks for both)."""
        return False

    def _replay(self, rest: bytes) -> None:
        """Reads the request that asked for an upgrade again, its head without the Upgrade
        field, then `rest` (its body, and what follows): httptools ended it at its head.
        A request at a time: each one waits in the pipeline (`PIPELINE_DEPTH`) or is
        answered, so the recursion through `data_received` stays as shallow."""
        head, self._replay_head = self._replay_head, None
        if not head:  # CONNECT
            self._refuse_request(INVALID_HTTP)
            return
        self._fed = 0
        self.data_received(head + rest)

    # Parser callbacks

    def on_message_begin(self) -> None:
        if len(self.pipeline) >= PIPELINE_DEPTH:
            raise _PipelineFull
        super().on_message_begin()
        self._head_bytes = 0
        if self._due == math.inf:  # pipelined behind a response still being sent
            self._arm(self._head_timeout())

    def on_url(self, url: bytes) -> None:
        self._head_bytes += len(url)
        if self._head_bytes > self.limits.max_header_bytes:
            raise _Refused
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        # The count is bounded here; the bytes once the head is whole (`_head_too_large`),
        # or, for a head that is not, after each read (`data_received`): a read parsed
        # past the limit holds at most `max_headers` of them.
        headers = self.headers
        if len(headers) >= self.limits.max_headers:
            raise _Refused
        # uvicorn's `on_header`, here rather than called: a call less for every header
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100_continue = True
        headers.append((name, value))

    def _head_too_large(self) -> bool:
        """Whether the whole head's URL and headers are over `max_header_bytes` (each
        header counted with its ": " and CRLF), added up in C."""
        headers = self.headers
        size = self._head_bytes + sum(map(len, chain.from_iterable(headers))) + 4 * len(headers)
        return size > self.limits.max_header_bytes

    def on_headers_complete(self) -> None:
        if self._head_too_large():
            raise _Refused
        parser = self.parser
        if parser.should_upgrade():  # httptools skips its body: read it again (`_replay`)
            method = parser.get_method()
            # CONNECT asks for a tunnel by its method, not a field: nothing to read again
            self._replay_head = (
                b""
                if method == b"CONNECT"
                else self._head_without_upgrade(method, parser.get_http_version())
            )
            return
        self.heads.waiting.pop(self, None)
        scope = cast(dict[str, Any], self.scope)  # uvicorn types extensions narrowly
        extensions = scope.setdefault("extensions", {})
        extensions[ABORT_EXTENSION] = self.transport.abort
        if self._lost is None:
            self._lost = self.loop.create_future()
        extensions[LOST_EXTENSION] = self._lost
        self._phase = _BODY
        self._fed = 0
        self._started = False
        self._arm(self.limits.body_timeout)
        before = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and cycle is not before:
            cycle.transport = cast(asyncio.Transport, _HeadHold(cycle, self.transport))
            extensions[WRITE_NOW_EXTENSION] = _WriteNow(cycle)
            if scope["http_version"] == "1.0":  # its task has not run: it takes this send
                cast(Any, cycle).send = _CloseDelimited(cycle)
        # The trailer section's fields, if any, go here and are dropped (still counted).
        self.headers = []
        if self.pipeline:  # queued behind a response, reading paused: its turn starts the clock
            self._disarm()

    def _head_without_upgrade(self, method: bytes, version: str) -> bytes:
        """The head just read, less its Upgrade field, for `_replay`."""
        head = [method, b" ", self.url, b" HTTP/", version.encode(), b"\r\n"]
        for name, value in self.headers:
            if name != b"upgrade":
                head += [name, b": ", value, b"\r\n"]
        head.append(b"\r\n")
        return b"".join(head)

    def on_body(self, body: bytes) -> None:
        # uvicorn's `on_body`, here rather than called (no upgrade has a body here: `_replay`)
        self._fed = 0  # body bytes: what was read before them was framing, within bounds
        cycle = self.cycle
        if cycle.response_complete:
            return
        cycle.body += body
        if len(cycle.body) > HIGH_WATER_LIMIT:
            self.flow.pause_reading()
        cycle.message_event.set()

    def on_message_complete(self) -> None:
        if self._replay_head is not None:
            return  # the head of an upgrade: read again (`_replay`)
        self._fed = 0
        self._phase = _HEAD
        self._disarm()  # the app has the request: `request_timeout` governs it now
        super().on_message_complete()
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            super()._start_asgi_task(*deferred)

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        """Starts the request's task now if its body is whole (or large, chunked, or
        awaited with `100-continue`), else when it is (`on_message_complete`)."""
        if (
            cycle.more_body
            and not cycle.waiting_for_100_continue
            and _whole_first(cycle.scope["headers"])
        ):
            self._deferred = (cycle, app)
            return
        super()._start_asgi_task(cycle, app)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.pipeline or self._refused:
            # uvicorn resumed reading: not while requests still wait (their bodies
            # are whole; the one now started reads its own with `receive`).
            self.flow.pause_reading()
        if self._due != math.inf or self.transport.is_closing():
            return
        if self._phase == _BODY:
            if not self.pipeline:  # the queued request whose body is due just started
                self._arm(self.limits.body_timeout)
        elif self.cycle is None or self.cycle.response_complete:  # nothing left running
            self._await_head()

    # Waiting for a head, under pressure

    def _await_head(self) -> None:
        """Waits for the next request head: the deadline, and the newest of those waiting."""
        self._arm(self._head_timeout())
        waiting = self.heads.waiting
        waiting.pop(self, None)
        waiting[self] = None

    def _head_timeout(self) -> float:
        """`header_timeout`, shrunk as the open connections near `max_connections`."""
        limits = self.limits
        full = limits.header_timeout
        used = len(self.connections) / limits.max_connections
        if used <= SCALE_FROM:
            return full
        least = min(full, MIN_HEAD_TIMEOUT)
        return least + (full - least) * max(0.0, 1.0 - used) / (1.0 - SCALE_FROM)

    def _evict(self) -> None:
        """Closes this connection (it has no request in flight) for a newer one."""
        self.heads.waiting.pop(self, None)
        self._evicted = True
        self.heads.closing += 1
        self._disarm()
        self.transport.close()

    # The timer: one deadline at a time, on one timer that is moved only to fire sooner

    def _arm(self, seconds: float) -> None:
        """The deadline, `seconds` from now. The timer is set again only when it would
        fire too late; one that fires early finds the later deadline and waits for it:
        a request's head, body and the wait for the next head cost no timer of their
        own on a busy connection (a timer set and cancelled is most of a microsecond
        of the loop's each)."""
        self._timeout = seconds
        due = self._due = self.loop.time() + seconds
        if due < self._timer_at:
            self._set_timer(due)

    def _disarm(self) -> None:
        self._due = math.inf

    def _set_timer(self, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer_at = when
        self._timer = self.loop.call_at(when, self._on_timer)

    def _stop_timer(self) -> None:
        self._due = math.inf
        if self._timer is not None:
            self._timer.cancel()
            self._timer, self._timer_at = None, math.inf

    def _on_timer(self) -> None:
        fired_for, self._timer, self._timer_at = self._timer_at, None, math.inf
        due = self._due
        if due == math.inf:
            return  # no deadline now; the next `_arm` sets the timer again
        if fired_for < due:  # set for an earlier deadline than the current one
            self._set_timer(due)
            return
        self._due = math.inf
        if self._lingering:
            self.transport.close()
        else:
            self._expired()

    def _expired(self) -> None:
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if self._phase == _BODY:
            deferred, self._deferred = self._deferred, None
            seconds, what = self.limits.body_timeout, "body"
            # Another response is (or will be) on the wire: no room for a 408.
            busy = cycle is None or cycle.response_started or bool(self.pipeline)
            if cycle is not None and not cycle.response_complete:
                # The route waiting on the body sees a disconnect and records the 408
                # (it writes nothing more: the cycle is disconnected).
                extensions = cast(dict[str, Any], cycle.scope)["extensions"]
                extensions[BODY_TIMEOUT_EXTENSION] = seconds
                cycle.disconnected = True
                cycle.message_event.set()
                if deferred is not None:  # its task waited for the whole body: now
                    super()._start_asgi_task(*deferred)
        else:
            seconds, what = self._timeout, "headers"
            busy = cycle is not None and not cycle.response_complete
            if not self._started:  # nothing of a request arrived: just close
                busy = True
        if busy:
            self.transport.close()
            return
        self._refuse(request_timeout(what, seconds))

    # Refusing

    def _refuse_request(self, error: APIError) -> None:
        """Refuses the request being read (its head, or its body's framing): `_refuse`, or
        only the close while another response is on the wire. A route waiting on the
        body sees a disconnect, and records `error` (`BODY_REFUSED_EXTENSION`)."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            if self._phase == _HEAD or cycle.response_started or self.pipeline:
                self.transport.close()  # the answer would land inside another one
                return
            cast(dict[str, Any], cycle.scope)["extensions"][BODY_REFUSED_EXTENSION] = error
            cycle.disconnected = True
            cycle.message_event.set()
        self._refuse(error)

    def _stop_after_pipeline(self) -> None:
        """`PIPELINE_DEPTH` requests wait: parse nothing more, answer them, close."""
        self._refused = True  # what still comes is dropped
        self._disarm()
        self.flow.pause_reading()
        self.cycle.keep_alive = False  # the last one queued: the connection ends with it

    def _too_large(self) -> APIError:
        limits = self.limits
        return APIError(
            431,
            f"The request's headers are larger than {limits.max_header_bytes} bytes "
            f"or more than {limits.max_headers}.",
            code="request_headers_too_large",
        )

    def _refuse(self, error: APIError) -> None:
        """Answers `error`, half-closes, drops what still comes for `LINGER` s, closes."""
        self._refused = True
        self.heads.waiting.pop(self, None)
        self._disarm()
        self._unset_keepalive_if_required()
        self._write_error(error)
        transport = self.transport
        if transport.can_write_eof():
            transport.write_eof()
        self.flow.resume_reading()
        self._lingering = True
        self._arm(LINGER)

    def _write_error(self, error: APIError) -> None:
        body = error.body()
        url = getattr(self, "url", b"")  # as far as it came; none before a first request
        if url == _ANTHROPIC or url.startswith(_BELOW_ANTHROPIC):
            body = anthropic_body(error)  # its statuses here (400, 408, 431) are Anthropic's
        head = [STATUS_LINE[error.status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        for name, value in error.headers():
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
            body,
        ]
        self.transport.write(b"".join(head))


def protocol_for(limits: HttpLimits) -> type[GuardedHttpProtocol]:
    """The protocol class for uvicorn's `http=`, bound to `limits`."""

    class BoundHttpProtocol(GuardedHttpProtocol):
        pass

    BoundHttpProtocol.limits = replace(
        limits, max_connections=connection_limit(limits.max_connections)
    )
    BoundHttpProtocol.heads = _Heads()
    return BoundHttpProtocol


def connection_limit(configured: int) -> int:
    """`max_connections`: as configured, or (0) `FILE_LIMIT_SHARE` of the process's
    open-file limit."""
    if configured:
        return configured
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, int(soft * FILE_LIMIT_SHARE))
