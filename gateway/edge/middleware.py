"""Pure ASGI middleware in front of the routes: the request's headers bounded in
size (431), and on /v1/* the caller's API key (401) and its team's rate-limit
headers on every response, streams included.

uvicorn's httptools parser has no header limit of its own (h11 has
`h11_max_incomplete_event_size`), so the total is checked here, before any
route reads a byte of the body.

A refused key gets one body whatever was wrong (no key, another scheme, an
unknown key), so the answer tells nothing about how close a guess came. Keys
are never logged: the gateway only ever holds their SHA-256.
"""

from __future__ import annotations

from typing import Any

from gateway.edge.asgi import ASGIApp, Receive, Scope, Send, send_error
from gateway.edge.errors import APIError
from gateway.teams import SCOPE_KEY, Teams, rate_limit_headers

INVALID_KEY = APIError(
    401,
    "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.",
    code="invalid_api_key",
)


class HeaderLimit:
    """Answers 431 when the request's headers add up to more than `limit` bytes."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.error = APIError(
            431,
            f"The request's headers are larger than {limit} bytes.",
            code="request_headers_too_large",
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            size = sum(len(name) + len(value) for name, value in scope["headers"])
            if size > self.limit:
                await send_error(send, self.error)
                return
        await self.app(scope, receive, send)


class KeyGate:
    """On /v1/* of a keyed gateway: 401 without a known key; else the team goes
    into the scope and its x-ratelimit-* headers onto the response."""

    def __init__(self, app: ASGIApp, teams: Teams) -> None:
        self.app = app
        self.teams = teams

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.teams.keyed or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        team = self.teams.authenticate(scope["headers"])
        if team is None:
            await send_error(send, INVALID_KEY)
            return
        scope[SCOPE_KEY] = team

        async def send_with_limits(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), *rate_limit_headers(team)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_limits)
