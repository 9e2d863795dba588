"""Errors in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`,
with Anthropic's status codes, from the edge's own errors.

Every refusal of the gateway is first an `APIError` (our error tree goes to HTTP
through `gateway.edge.errors`' one table, so the two APIs never disagree on what
a condition is); this module's one table turns its HTTP status into Anthropic's
status and error type. A full gateway or worker (503) is Anthropic's
`overloaded_error` (529), which its SDK retries as it retries Anthropic's own.

`AnthropicShape` applies it to whatever a route's stack refuses before the route
runs (the key check's 401, the content type's 415, the Host's 421, the router's
405 to another method), so a client of these routes never reads OpenAI's shape.
It also gives every response the request's id as `request-id`, the header
Anthropic's SDKs read (a message's `_request_id`, an error's `request_id`), and an
error's body its `request_id`, as Anthropic's API writes it.
Its cost on a served request: one check of the response's status and one look
through its few headers (and, in front of the other routes, one set lookup of
the path).

A refusal whose OpenAI `code` is one of Anthropic's error codes that its SDK acts
on (`DETAIL_CODES`) carries it as Anthropic's `details.error_code`.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.edge.asgi import ASGIApp, Receive, Scope, Send
from gateway.edge.errors import APIError

#: The edge's HTTP status → Anthropic's status and error type.
STATUS_TABLE: dict[int, tuple[int, str]] = {
    400: (400, "invalid_request_error"),
    401: (401, "authentication_error"),
    403: (403, "permission_error"),
    404: (404, "not_found_error"),
    413: (413, "request_too_large"),
    429: (429, "rate_limit_error"),
    500: (500, "api_error"),
    502: (502, "api_error"),
    503: (529, "overloaded_error"),
    504: (504, "timeout_error"),
}


#: The header Anthropic's SDKs send on every call (and OpenAI's never do).
VERSION_HEADER = b"anthropic-version"
#: Our refusals' codes that are Anthropic's `error.details.error_code`s, which its SDK
#: reads: `thread_unsupported_request` makes its tool runner go on without a thread
#: (sending the whole conversation each turn).
DETAIL_CODES = frozenset({"thread_unsupported_request"})


def translate(status: int) -> tuple[int, str]:
    """Anthropic's status and type for an edge status; others keep their status, as
    invalid_request_error (4xx) or api_error (5xx)."""
    row = STATUS_TABLE.get(status)
    if row is not None:
        return row
    return status, "invalid_request_error" if status < 500 else "api_error"


def sent_status(status: int) -> int:
    """The status an edge status goes out with on Anthropic's routes (for the record)."""
    return translate(status)[0]


def error_payload(status: int, message: str, code: object = None) -> dict[str, Any]:
    """The error object Anthropic's clients parse (also a stream's `error` event), with
    `details` where `code` is one of `DETAIL_CODES`."""
    error: dict[str, Any] = {"type": translate(status)[1], "message": message}
    if code in DETAIL_CODES:
        error["details"] = {"error_code": code}
    return {"type": "error", "error": error}


def _message(error: dict[str, Any]) -> str:
    """An OpenAI-shaped error's message, naming its parameter when the message does not."""
    message = str(error.get("message", ""))
    param = error.get("param")
    if param and param not in message:
        message = f"{param}: {message}"
    return message


def anthropic_body(error: APIError) -> bytes:
    """`error`'s body in Anthropic's shape."""
    return orjson.dumps(error_payload(error.status, _message(error.fields()), error.code))


class AnthropicShape:
    """Turns the OpenAI-shaped error responses of the app it wraps into Anthropic's
    (status and body); anything else passes as is. With `root`, only the requests to
    that path and below it (Anthropic's API: a 404 for `/v1/messages/batches`, which
    its SDK calls, in its shape), and those to a `versioned` path and below it that
    send `anthropic-version` (`/v1/models`, which both APIs share: the key check's 401
    to Anthropic's SDK); the rest of the app keeps OpenAI's shape."""

    def __init__(
        self, app: ASGIApp, root: str | None = None, versioned: tuple[str, ...] = ()
    ) -> None:
        self.app = app
        self.root = root
        self.versioned = versioned

    def _reshapes(self, scope: Scope) -> bool:
        root, path = self.root, scope.get("path", "")
        if root is None or _under(path, root):
            return True
        if not any(_under(path, shared) for shared in self.versioned):
            return False
        return any(key == VERSION_HEADER for key, _ in scope.get("headers", ()))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self._reshapes(scope):
            await self.app(scope, receive, send)
            return
        held: dict[str, Any] | None = None

        async def reshape(message: dict[str, Any]) -> None:
            nonlocal held
            if message["type"] == "http.response.start":
                message = _with_request_id(message)
                if message["status"] >= 400:
                    held = message
                    return
            if held is None:
                await send(message)
                return
            start, held = held, None
            status = start["status"]
            try:
                fields = orjson.loads(message.get("body", b""))["error"]
                payload = error_payload(status, _message(fields), fields.get("code"))
            except (orjson.JSONDecodeError, KeyError, TypeError):
                payload = error_payload(status, "The request was refused.")
            headers = start.get("headers", ())
            request_id = next((v for k, v in headers if k == b"request-id"), None)
            if request_id is not None:  # Anthropic's error bodies say it too
                payload["request_id"] = request_id.decode("latin-1")
            body = orjson.dumps(payload)
            headers = [(k, v) for k, v in headers if k != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "status": translate(status)[0], "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, reshape)


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + "/")


def _with_request_id(start: dict[str, Any]) -> dict[str, Any]:
    """A response's start with its `x-request-id` also as `request-id`, Anthropic's."""
    headers = start.get("headers", ())
    request_id = next((v for k, v in headers if k == b"x-request-id"), None)
    if request_id is None or any(k == b"request-id" for k, _ in headers):
        return start
    return {**start, "headers": [*headers, (b"request-id", request_id)]}
