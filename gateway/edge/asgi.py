"""The few raw-ASGI pieces every route and middleware of the edge shares: the
callables' types and whole-JSON responses (errors in OpenAI's shape)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from gateway.edge.errors import APIError

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

JSON_HEADERS = [(b"content-type", b"application/json")]
#: The scope extension under which the gateway's HTTP protocol leaves a callable that
#: aborts the connection (no flush of what is buffered for a client that stopped reading).
ABORT_EXTENSION = "furnace.abort"
#: ... and a future it resolves when the connection is lost: a route learns that its
#: client went away without a task of its own waiting on `receive()`.
LOST_EXTENSION = "furnace.lost"
#: ... and a callable that writes a body chunk of the started, chunked response at
#: once, when `send` would not wait (the client reads, the response is open), and
#: says whether it did: a stream's token written in the callback that brought it.
WRITE_NOW_EXTENSION = "furnace.write_now"
#: ... and, once a body's deadline passed before it came whole, that deadline's seconds:
#: the protocol answers the 408 itself, and the route, which reads a disconnect, records
#: the request as that 408 (its access-log line, its metrics).
BODY_TIMEOUT_EXTENSION = "furnace.body_timeout"
#: ... and, once the protocol refused a body as it came (its chunk framing past the head's
#: bound, bytes that are not HTTP), the `APIError` it answered, recorded so as well.
BODY_REFUSED_EXTENSION = "furnace.body_refused"


async def send_json(
    send: Send, status: int, body: bytes, headers: list[tuple[bytes, bytes]]
) -> None:
    """A whole JSON response, its length said (not chunked: an HTTP/1.0 client could not
    read chunks, and a length lets any client size its read)."""
    length = (b"content-length", b"%d" % len(body))
    headers = [*JSON_HEADERS, length, *headers]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def send_error(send: Send, error: APIError, request_id: bytes | None = None) -> None:
    """An OpenAI-shaped error response, with the request's id when it has one."""
    headers = error.headers()
    if request_id is not None:
        headers = [(b"x-request-id", request_id), *headers]
    await send_json(send, error.status, error.body(), headers)
