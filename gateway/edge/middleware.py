"""Pure ASGI middleware in front of the routes: on /v1/* the caller's API key
(401) and its team's rate-limit headers on every response, streams included.
(The headers' size and count are bounded earlier, as the parser reads them:
gateway/edge/http_protocol.py.)

A refused key gets one body whatever was wrong (no key, another scheme, an
unknown key), so the answer tells nothing about how close a guess came. Keys
are never logged: the gateway only ever holds their SHA-256.

A browser page may send a "simple" cross-origin POST (text/plain, no preflight)
to a developer's local gateway, and DNS rebinding lets it read the answer under
a name of its own. So POST bodies on /v1/* must be declared JSON (415 before a
byte is read; a missing Content-Type too: OpenAI's SDKs always send it; but the
Responses API's cancel, which reads no body, may declare none), those on
/v2/* JSON or the binary tensor extension's (415 in KServe's shape), and the
Host must be one the gateway serves (`allowed_hosts`; listening on loopback,
loopback names only). A wrong Host gets 421 Misdirected Request: the request
reached a server that will not answer for that authority (RFC 9110 15.5.20),
and unlike a 400 it tells the operator it is about the name, not the body. The
probes and the metrics are exempt: kubelet and Prometheus address pods by IP.
The cost: one pass over the headers per request. The routes behind Starlette (files,
batches, stored responses, models) answer with the request's id (`RequestIds`), as the
hot routes do.
"""

from __future__ import annotations

import functools
import ipaddress
import time
from collections.abc import Iterable, Sequence
from typing import Any

import orjson
from starlette.routing import BaseRoute

from gateway.edge.asgi import ASGIApp, Message, Receive, Scope, Send, send_error, send_json
from gateway.edge.errors import APIError
from gateway.edge.request import request_headers, route_label
from gateway.protocol.errors import Outcome
from gateway.teams import SCOPE_KEY, Teams, rate_limit_headers
from gateway.telemetry import RequestRecord
from gateway.telemetry.access_log import AccessLog

INVALID_KEY = APIError(
    401,
    "Incorrect API key provided. Send it as 'Authorization: Bearer <key>'.",
    code="invalid_api_key",
)


UNSUPPORTED_MEDIA_TYPE = APIError(
    415,
    "The request body must be JSON: send 'Content-Type: application/json'.",
    code="unsupported_media_type",
)
#: A form sent with no key (a page could send one cross-site): say what it lacks.
FORM_WITHOUT_KEY = APIError(
    415,
    "A form (multipart/form-data) is taken only with an API key: send an 'Authorization: "
    "Bearer ...' or 'x-api-key' header (any value on a gateway without keys).",
    code="unsupported_media_type",
)
MISDIRECTED = APIError(
    421, "The request's Host is not one this gateway serves.", code="misdirected_request"
)
#: Paths any Host may reach: probes and scrapes that address the pod by its IP.
HOST_EXEMPT = frozenset({"/health", "/ready", "/metrics", "/metrics/json"})
#: The names a gateway listening on loopback answers to (besides loopback IPs).
LOOPBACK_NAMES = frozenset({"localhost"})


@functools.lru_cache(maxsize=256)
def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, without port) is the loopback; cached, as
    every request asks it of the Host header (a bounded cache: clients choose the value)."""
    host = host.strip("[]").rstrip(".").lower()
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@functools.lru_cache(maxsize=256)
def host_name(value: bytes) -> str:
    """The name in a Host header, lowercased, without port or final dot; cached, as every
    request asks it (bounded, as `is_loopback`)."""
    text = value.decode("latin-1").strip().lower()
    if text.startswith("["):  # [::1]:8000
        return text[1 : text.find("]")] if "]" in text else ""
    return text.rpartition(":")[0].rstrip(".") if ":" in text else text.rstrip(".")


#: The /v2 routes' 415, in the KServe error shape.
UNSUPPORTED_TENSOR_MEDIA_TYPE = orjson.dumps(
    {
        "error": "The request body must be JSON ('Content-Type: application/json') or the "
        "binary tensor extension's ('Content-Type: application/octet-stream', or an "
        "Inference-Header-Content-Length header)."
    }
)
_JSON = frozenset({b"application/json"})
#: The end of the /v1 POST routes that read no body, which take one declared of no type:
#: the Responses API's cancel, sent so by OpenAI's own examples (`curl -X POST`); a page
#: could send it cross-site, but it needs the response's id, 192 random bits.
_BODYLESS = "/cancel"
#: The /v1 routes that take a form (multipart/form-data, as OpenAI's file uploads and
#: audio), from a request that carries a key: a page cannot send a form cross-site with
#: one without the preflight the gateway does not answer.
_UPLOADS = frozenset({"/v1/files", "/v1/audio/transcriptions", "/v1/audio/translations"})
_FORM = frozenset({b"multipart/form-data"})
_KEY_HEADERS = frozenset({b"authorization", b"x-api-key"})
#: What a /v2 body may be declared as: JSON, or the binary tensor extension's bytes.
_TENSOR_TYPES = frozenset({b"application/json", b"application/octet-stream"})


#: The OpenAI-shaped routes outside /v1/, as vLLM serves them: its unversioned rerank,
#: score and classify, and Cohere's v2 rerank (edge/openai/scoring.py, classify.py).
OTHER_API_PATHS = frozenset(
    {"/rerank", "/score", "/v2/rerank", "/classify", "/tokenize", "/detokenize"}
)


def _openai_path(path: str) -> bool:
    return path.startswith("/v1/") or path in OTHER_API_PATHS


class JsonOnly:
    """Answers 415 to a POST on /v1/* (or OTHER_API_PATHS) whose body is not declared JSON,
    and to one on /v2/*
    declared neither JSON nor binary tensors (a request of the binary extension that names
    no type passes by its Inference-Header-Content-Length: Triton's clients send no type,
    and no browser sends that header without a preflight)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path, headers = scope["path"], request_headers(scope)
            openai = _openai_path(path)
            if (
                openai
                and not _declares(headers.content_types, _JSON)
                and not (path.endswith(_BODYLESS) and not headers.content_types)
                and not (path in _UPLOADS and _keyed_form(scope, headers.content_types))
            ):
                form = path in _UPLOADS and _declares(headers.content_types, _FORM)
                await send_error(send, FORM_WITHOUT_KEY if form else UNSUPPORTED_MEDIA_TYPE)
                return
            if (
                not openai
                and path.startswith("/v2/")
                and not _declares(headers.content_types, _TENSOR_TYPES)
                and not headers.inference_header
            ):
                await send_json(send, 415, UNSUPPORTED_TENSOR_MEDIA_TYPE, [])
                return
        await self.app(scope, receive, send)


def _keyed_form(scope: Scope, types: tuple[bytes, ...]) -> bool:
    """Whether the request is a form sent with a key (an upload of the OpenAI SDK's)."""
    return _declares(types, _FORM) and any(name in _KEY_HEADERS for name, _ in scope["headers"])


def _declares(types: tuple[bytes, ...], allowed: frozenset[bytes]) -> bool:
    """Whether the request declares a content type, and each one it declares is allowed."""
    if len(types) == 1:  # the usual case, without a generator
        return _media_type(types[0]) in allowed
    return bool(types) and all(_media_type(t) in allowed for t in types)


@functools.lru_cache(maxsize=64)
def _media_type(value: bytes) -> bytes:
    """A Content-Type's media type, lowercased, without parameters; cached (bounded)."""
    return value.partition(b";")[0].strip().lower()


class HostCheck:
    """Answers 421 when the Host is not among `allowed` (names), or, with
    `loopback` and no names, when it is not a loopback name."""

    def __init__(self, app: ASGIApp, allowed: Iterable[str], loopback: bool) -> None:
        self.app = app
        self.allowed = frozenset(h.strip("[]").rstrip(".").lower() for h in allowed)
        self.loopback = loopback and not self.allowed

    def accepts(self, host: bytes | None) -> bool:
        """Whether the Host header (None unless exactly one) names this gateway."""
        if host is None:
            return False
        name = host_name(host)
        return is_loopback(name) if self.loopback else name in self.allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] == "http"
            and (self.allowed or self.loopback)
            and scope["path"] not in HOST_EXEMPT
            and not self.accepts(request_headers(scope).host)
        ):
            await send_error(send, MISDIRECTED)
            return
        await self.app(scope, receive, send)


def _keyed_path(path: str) -> bool:
    """The OpenAI routes (vLLM's others too) and the KServe v2 routes but their health
    probes."""
    if _openai_path(path):
        return True
    return (path == "/v2" or path.startswith("/v2/")) and not path.startswith("/v2/health/")


class KeyGate:
    """On /v1/*, /v2/* (not /v2/health/*) and OTHER_API_PATHS of a keyed gateway: 401 without a
    known key (with its access-log line, `access_log`); else the team goes into the
    scope and its x-ratelimit-* headers onto the response."""

    def __init__(self, app: ASGIApp, teams: Teams, access_log: AccessLog | None = None) -> None:
        self.app = app
        self.teams = teams
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.teams.keyed or not _keyed_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        team = self.teams.authenticate(scope["headers"])
        if team is None:
            record = _refusal_record(scope, INVALID_KEY.status, "invalid_key")
            await send_error(send, INVALID_KEY)
            if self.access_log is not None:
                self.access_log.write(record, time.perf_counter(), None)
            return
        scope[SCOPE_KEY] = team

        async def send_with_limits(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), *rate_limit_headers(team)]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_limits)


def _refusal_record(scope: Scope, status: int, reason: str) -> RequestRecord:
    """The record of a request refused before any route (its access-log line): the
    client's x-request-id or a new one, the path as the route (the first 200
    characters: any path reaches this check)."""
    record = RequestRecord(request_headers(scope).request_id.decode("latin-1"))
    record.route = route_label(scope["path"])[:200]
    record.status, record.outcome, record.reason = status, Outcome.REJECTED, reason
    return record


class RequestIds:
    """Every response of `app` carries the request's id (`x-request-id`: the client's,
    or a new one), as the hot routes' do and OpenAI's API does for every route: the
    SDKs show it (`_request_id`) for files, batches, stored responses, models."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                if not any(name.lower() == b"x-request-id" for name, _ in headers):
                    headers.append((b"x-request-id", request_headers(scope).request_id))
                    message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_id)


class ExactRoutes:
    """The hot routes straight to their handlers: a POST to one of these exact paths
    skips Starlette (its app, its two exception middlewares, router and route: per
    request a regex match, frames, and wrappers of `send` called on every write of
    a stream; the handlers answer their own errors in OpenAI's shape). Anything
    else, a GET to one of these paths included (405), goes on to `app`. The owner
    puts the same checks (host, key, content type) in front of both."""

    def __init__(
        self, app: ASGIApp, hot: dict[str, ASGIApp], routes: Sequence[BaseRoute] = ()
    ) -> None:
        self.app = app
        self.hot = hot
        #: Every route served, the hot ones included (`app`'s router's), for those
        #: who list them.
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            route = self.hot.get(scope["path"])
            if route is not None:
                await route(scope, receive, send)
                return
        await self.app(scope, receive, send)
