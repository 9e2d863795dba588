"""The frame every raw-ASGI route that serves a request on the fleet shares (chat and text
completions, embeddings, KServe v2 inference), so that each gets its id, its record, its
error handling and its telemetry one way: the request's id and the gRPC metadata passed to
its worker, the `x-furnace-priority` header, the future of a client that goes away, and
`RequestRoute`, whose `__call__` is the try/except/finally around serving one request:
every request ends there once (`_serve_to_the_end`: a refusal, a 499, or the answer),
with admission's `end` (gateway/admission/admit.py) called with the record final. A
route keeps only what is its own: `serve` (which runs admission's stages), and where it
differs, the shape of its refusals, its span's usage and what it counts at the end.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, NamedTuple, TypeVar

from gateway.admission import Admission, ClientGone, InFlight, RequestContext
from gateway.config import Config
from gateway.edge.asgi import ABORT_EXTENSION, LOST_EXTENSION, Receive, Scope, Send, send_error
from gateway.edge.errors import APIError, from_error, internal_error, invalid
from gateway.edge.write_guard import WriteGuard, WriteTimedOut
from gateway.fleet import Fleet
from gateway.protocol import errors
from gateway.protocol.errors import Outcome
from gateway.teams import Teams, team_of
from gateway.teams.accounts import key_id
from gateway.telemetry import RequestRecord, Telemetry
from gateway.telemetry.tracing import Tracing, annotate

log = logging.getLogger("furnace.edge")

#: gRPC metadata for a worker call: (name, value) pairs.
Metadata = tuple[tuple[str, str], ...]

_REQUEST_ID = re.compile(rb"[A-Za-z0-9._:/+=-]{1,128}")
_TRACEPARENT = re.compile(rb"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_PRIORITY = re.compile(rb"-?[0-9]{1,4}")


class RequestHeaders(NamedTuple):
    """What the gateway reads of a request's headers, in one pass over them
    (`request_headers`): its id (the client's x-request-id, or a new one) and the metadata
    passed on to its worker (values that could not travel as gRPC metadata, or are not W3C
    trace contexts, are replaced or dropped); the raw `x-furnace-priority` and
    `x-session-id`, which the routes that take them check (`priority`, `session`); and
    what the edge's checks read (gateway/edge/middleware.py): the Host header (None
    unless there is exactly one), the declared content types, and whether the KServe
    binary extension's Inference-Header-Content-Length is there."""

    request_id: bytes
    metadata: Metadata
    priority: bytes | None
    session: bytes | None
    host: bytes | None
    content_types: tuple[bytes, ...]
    inference_header: bool


#: Where a request's scope keeps its `RequestHeaders` once read.
HEADERS_KEY = "furnace.headers"

#: Which header a name is, for `request_headers`.
(
    _ID_HEADER,
    _TRACE_HEADER,
    _PRIORITY_HEADER,
    _SESSION_HEADER,
    _HOST_HEADER,
    _TYPE_HEADER,
    _INFERENCE_HEADER,
) = range(7)
#: The headers read, by (lowercase) name; the rest cost one lookup each.
_READ = {
    b"host": _HOST_HEADER,
    b"content-type": _TYPE_HEADER,
    b"x-request-id": _ID_HEADER,
    b"traceparent": _TRACE_HEADER,
    b"x-furnace-priority": _PRIORITY_HEADER,
    b"x-session-id": _SESSION_HEADER,
    # Claude Code's per-session id, on each of its requests: its conversation's key too
    b"x-claude-code-session-id": _SESSION_HEADER,
    b"inference-header-content-length": _INFERENCE_HEADER,
}


def request_headers(scope: Scope) -> RequestHeaders:
    """The request's `RequestHeaders`: read in one pass the first time (by the edge's
    checks, or the route's frame), then kept in the scope."""
    known: RequestHeaders | None = scope.get(HEADERS_KEY)
    if known is not None:
        return known
    request_id = b""
    metadata: list[tuple[str, str]] = []
    priority = session = host = None
    hosts = 0
    types: list[bytes] = []
    inference = False
    read = _READ.get
    for name, value in scope["headers"]:
        kind = read(name)
        if kind is None:
            continue
        if kind == _HOST_HEADER:
            host = value
            hosts += 1
        elif kind == _TYPE_HEADER:
            types.append(value)
        elif kind == _ID_HEADER:
            if _REQUEST_ID.fullmatch(value):
                request_id = value
        elif kind == _TRACE_HEADER:
            if _TRACEPARENT.fullmatch(value):
                metadata.append(("traceparent", value.decode("ascii")))
        elif kind == _PRIORITY_HEADER:
            priority = value if priority is None else priority
        elif kind == _SESSION_HEADER:
            session = value if session is None else session
        else:
            inference = True
    if not request_id:
        request_id = os.urandom(16).hex().encode()  # secrets.token_hex's, without its calls
    metadata.append(("x-request-id", request_id.decode("ascii")))
    headers = scope[HEADERS_KEY] = RequestHeaders(
        request_id,
        tuple(metadata),
        priority,
        session,
        host if hosts == 1 else None,
        tuple(types),
        inference,
    )
    return headers


def _as_is(status: int) -> int:
    return status


def route_label(path: str) -> str:
    """A request route's path as a metric label: its own path, which is one of the
    app's fixed routes, but for the KServe v2 model routes, whose paths name a model
    (and a version) the client chose."""
    if not path.startswith("/v2/models/"):
        return path
    if path.endswith("/infer"):
        return "/v2/models/{model}/infer"
    return "/v2/models/{model}"


def priority(ex: Exchange) -> int | None:
    """The request's `x-furnace-priority` (an integer; its team's caps it), or None."""
    value = ex.headers.priority
    if value is None:
        return None
    if not _PRIORITY.fullmatch(value.strip()):
        raise errors.Invalid(
            "x-furnace-priority: expected an integer from -1000 to 1000.",
            param="x-furnace-priority",
        )
    return max(-1000, min(1000, int(value)))


#: The longest `x-session-id` taken (a conversation's key for session affinity).
MAX_SESSION_ID = 256


def session(ex: Exchange) -> str:
    """The request's `x-session-id` (routing keeps a conversation on one worker; Claude
    Code's `x-claude-code-session-id` is taken as one), or ""."""
    value = ex.headers.session
    if value is None:
        return ""
    if len(value) > MAX_SESSION_ID:
        raise invalid("x-session-id", f"At most {MAX_SESSION_ID} characters.")
    return value.decode("latin-1")


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client goes away (run as a task once the body is read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def client_gone(scope: Scope, receive: Receive) -> asyncio.Future[None]:
    """The request's own future that is done when its client goes away (the body
    read); the caller cancels it when the request is over. Under the gateway's HTTP
    protocol it follows the connection's LOST_EXTENSION future (no task: ~1 µs);
    elsewhere a task waits on `receive()` for the disconnect."""
    lost: asyncio.Future[None] | None = scope.get("extensions", {}).get(LOST_EXTENSION)
    if lost is None:
        return asyncio.ensure_future(wait_disconnect(receive))
    gone: asyncio.Future[None] = lost.get_loop().create_future()
    if lost.done():
        gone.set_result(None)
        return gone

    def follow(_: asyncio.Future[None]) -> None:
        if not gone.done():
            gone.set_result(None)

    lost.add_done_callback(follow)
    gone.add_done_callback(lambda _: lost.remove_done_callback(follow))
    return gone


@dataclass(frozen=True, slots=True)
class Parts:
    """The gateway's parts a request route serves with (one set for every route)."""

    config: Config
    fleet: Fleet
    inflight: InFlight
    teams: Teams
    admission: Admission
    telemetry: Telemetry
    tracing: Tracing


class Exchange:
    """One request as the frame hands it to its route: the ASGI callables it is served
    on (`send` guarded: a write waits at most `write_timeout`), its admission's request
    context (`ctx`, whose `record` is the request's tally) and the metadata for its
    worker call. A route subclasses it for what it counts per request. `detached`: the
    route handed the request to a task of its own (a background response), which ends
    it, once: the frame then neither counts it nor calls admission's `end`."""

    __slots__ = ("ctx", "detached", "headers", "metadata", "receive", "record", "scope", "send")

    def __init__(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        ctx: RequestContext,
        headers: RequestHeaders,
    ) -> None:
        self.scope = scope
        self.receive = receive
        self.send = send
        self.ctx = ctx
        self.record = ctx.record
        self.headers = headers
        self.metadata = headers.metadata
        self.detached = False

    def watch_client(self) -> asyncio.Future[None]:
        """Starts watching for the client to go away (once the body is read): the
        request's one client-gone future, `ctx.gone`, which admission's `end` drops."""
        gone = self.ctx.gone = client_gone(self.scope, self.receive)
        return gone


X = TypeVar("X", bound=Exchange)


class RequestRoute(Generic[X]):
    """A raw-ASGI route that serves one request on the fleet, in the one frame: every
    error leaves as a refusal (OpenAI's shape unless the route says otherwise), and every
    request leaves one record in the metrics and the access log, and one span."""

    #: The per-request object `serve` gets.
    exchange: type[X]

    def __init__(self, parts: Parts) -> None:
        self.config = parts.config
        self.fleet = parts.fleet
        self.inflight = parts.inflight
        self.teams = parts.teams
        self.admission = parts.admission
        self.telemetry = parts.telemetry
        self.tracing = parts.tracing
        #: The status a refusal reaches the client with, which its record keeps: an API
        #: whose shape is made around the route sends some as its own codes (Anthropic's
        #: 529 for a 503: `anthropic.errors.sent_status`).
        self.sent_status: Callable[[int], int] = _as_is

    async def serve(self, ex: X) -> None:
        """The route's own work: read, check, admit, call the worker, answer."""
        raise NotImplementedError

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = request_headers(scope)
        record = RequestRecord(headers.request_id.decode("latin-1"))
        record.route = route_label(scope["path"])
        ctx = RequestContext(record, team_of(scope))
        if ctx.team is not None:  # a keyed gateway's: the ledger's and key budgets' key id
            ctx.key_id = key_id(scope["headers"])
            record.team, record.key_id = ctx.team.name, ctx.key_id or ""
        # every write waits at most `write_timeout` on the client (see write_guard.py)
        abort = scope.get("extensions", {}).get(ABORT_EXTENSION)
        send = guard = WriteGuard(send, self.config.write_timeout, abort)
        ex = self.exchange(scope, receive, send, ctx, headers)
        traceparent = dict(headers.metadata).get("traceparent")
        with self.tracing.request(f"{scope['method']} {scope['path']}", traceparent) as span:
            try:
                refusal = await self._serve_to_the_end(ex)
                if refusal is not None:
                    await self._refuse(ex, refusal)
            finally:
                guard.close()
                if not ex.detached:
                    self.telemetry.finish(record)
                    self._finished(ex)
                if span is not None:  # tracing on: a dict built for nothing otherwise
                    annotate(
                        span,
                        {
                            "http.response.status_code": record.status,
                            "gen_ai.request.model": record.model or None,
                            **self._usage(record),
                            "furnace.outcome": record.outcome,
                            "furnace.request_id": record.request_id,
                        },
                    )

    async def _serve_to_the_end(self, ex: X) -> APIError | None:
        """Serves the request and ends it, once, however it ends: a refusal to send
        (its status already in the record), a client gone (499: the status already
        sent, if any), or the answer; then admission's `end`, with the record final."""
        ctx, record = ex.ctx, ex.record
        refusal: APIError | None = None
        try:
            await self.serve(ex)
        except APIError as error:
            refusal = error
        except errors.GatewayError as error:
            if ctx.client_left():
                self._client_gone(record)
            else:
                refusal = self._to_api_error(error, record)
        except (ClientGone, WriteTimedOut) as error:
            self._client_gone(record, error)
        except Exception:
            log.exception("request %s failed in the gateway", record.request_id)
            if record.status:  # the answer had begun: the connection is closed
                record.outcome = Outcome.ENGINE_ERROR
                raise
            refusal = internal_error()
        finally:
            if refusal is not None:
                record.status, record.outcome = refusal.status, refusal.outcome
                record.reason = refusal.reason
            if not ex.detached:
                await self.admission.end(ctx)
        return refusal

    @staticmethod
    def _client_gone(record: RequestRecord, error: Exception | None = None) -> None:
        """A client gone (or too slow: the write guard aborted it) ends as a 499, or
        with the status already sent."""
        record.status = record.status or 499  # nginx's "client closed request"
        record.outcome = Outcome.CLIENT_GONE
        cause = f"{error} " if isinstance(error, WriteTimedOut) else ""
        log.info("%sclient went away; request %s cancelled", cause, record.request_id)

    def _to_api_error(self, error: errors.GatewayError, record: RequestRecord) -> APIError:
        """The client's error for `error` (what the client does not see is logged)."""
        return from_error(error, self.config.retry_after, record.request_id)

    async def _refuse(self, ex: X, error: APIError) -> None:
        """Records the refusal and sends it, in OpenAI's shape."""
        record = ex.record
        record.status, record.outcome, record.reason = (
            self.sent_status(error.status),
            error.outcome,
            error.reason,
        )
        await send_error(ex.send, error, record.request_id.encode("latin-1"))

    def _usage(self, record: RequestRecord) -> dict[str, Any]:
        """The span's token counts, for a route that has them."""
        return {}

    def _finished(self, ex: X) -> None:
        """What the route counts once the request is over (after its record)."""
