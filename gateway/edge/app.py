"""The applications of the edge, one per listener: the public one (the OpenAI API
and the probes) and the admin one (the probes, the metrics and the fleet's
workers), each with the pure-ASGI checks in front of its routes and OpenAI-shaped
errors for everything, from the parts the lifecycle built. The public one sends
its hot routes (a POST to chat, completions, embeddings, rerank and score, responses,
Anthropic's messages, and the two counting routes) past Starlette, which serves the rest.

Where the admin routes go: with `admin_port`, on the admin listener only; without
it, on the public listener of an open gateway (the demo), and nowhere on a keyed
one: they name every model, worker and team, so a key must not be the only
thing between them and the Internet (the cost: no scrape without `admin_port`).

The app holds no state of its own and starts nothing: the lifecycle starts the
fleet and the teams before it binds, and closes them after it stops.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, cast

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.admission import Admission, InFlight
from gateway.config import Config
from gateway.edge.anthropic.errors import AnthropicShape
from gateway.edge.anthropic.routes import MESSAGES, anthropic_paths, anthropic_routes
from gateway.edge.asgi import ASGIApp
from gateway.edge.batches.anthropic import message_batch_routes
from gateway.edge.batches.routes import ENDPOINTS, batch_routes
from gateway.edge.batches.runner import BatchRunner
from gateway.edge.errors import APIError, internal_error
from gateway.edge.kserve.routes import KServeRoutes
from gateway.edge.middleware import (
    ExactRoutes,
    HostCheck,
    JsonOnly,
    KeyGate,
    RequestIds,
    is_loopback,
)
from gateway.edge.openai.audio import TRANSCRIPTIONS, TRANSLATIONS, AudioRoute
from gateway.edge.openai.classify import CLASSIFY_PATHS, ClassifyRoute
from gateway.edge.openai.embeddings import EmbeddingsRoute
from gateway.edge.openai.encoding import ChatEncoder, CompletionEncoder, Encoder
from gateway.edge.openai.generation import GenerationRoute
from gateway.edge.openai.input_limits import InputLimits
from gateway.edge.openai.models import list_models, one_model
from gateway.edge.openai.scoring import RERANK_PATHS, SCORE_PATHS, RerankRoute, ScoreRoute
from gateway.edge.openai.tokenize import (
    DETOKENIZE_PATHS,
    TOKENIZE_PATHS,
    DetokenizeRoute,
    TokenizeRoute,
)
from gateway.edge.openai.validation import ParsedRequest, parse_chat, parse_completion
from gateway.edge.ops import admin_routes, probe_routes
from gateway.edge.request import Parts
from gateway.edge.responses.background import responses_routes
from gateway.edge.responses.compact import COMPACT, CompactRoute
from gateway.edge.responses.input_tokens import INPUT_TOKENS, InputTokensRoute
from gateway.edge.responses.routes import RESPONSES
from gateway.edge.usage import usage_routes
from gateway.fleet import Fleet
from gateway.teams import Teams
from gateway.telemetry import Telemetry
from gateway.telemetry.tracing import Tracing

log = logging.getLogger("furnace.app")


def _error_response(error: APIError) -> Response:
    headers = {k.decode(): v.decode() for k, v in error.headers()}
    return Response(error.body(), error.status, headers, media_type="application/json")


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    response = _error_response(APIError(exc.status_code, str(exc.detail), code=code))
    if exc.headers:  # a 405's Allow, which RFC 9110 (15.5.6) requires
        response.headers.update(exc.headers)
    return response


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return _error_response(exc)


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return _error_response(internal_error())


def admin_on_public(config: Config) -> bool:
    """Whether the public listener serves the admin routes: only on an open
    gateway without `admin_port`."""
    keyed = bool(config.keys) or config.keys_file is not None
    return config.admin_port is None and not keyed


def _starlette(routes: list[Route], middleware: list[Middleware]) -> Starlette:
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={
            HTTPException: _http_error,
            APIError: _api_error,
            Exception: _server_error,
        },
    )
    # A trailing slash is a plain 404: a redirect would echo the client's Host
    # into Location.
    app.router.redirect_slashes = False
    return app


def create_admin_app(
    config: Config,
    *,
    fleet: Fleet,
    inflight: InFlight,
    telemetry: Telemetry,
    is_ready: Callable[[], bool],
    teams: Teams,
) -> Starlette:
    """The admin listener's application: the probes and the admin routes, behind
    the public app's middleware less the key gate."""
    host = config.admin_host or config.host
    return _starlette(
        [
            *admin_routes(fleet=fleet, inflight=inflight, registry=telemetry.registry),
            *usage_routes(teams.accounts),
            *probe_routes(is_ready),
        ],
        [
            Middleware(HostCheck, allowed=config.allowed_hosts, loopback=is_loopback(host)),
            Middleware(JsonOnly),
        ],
    )


def create_app(
    config: Config,
    *,
    fleet: Fleet,
    inflight: InFlight,
    teams: Teams,
    telemetry: Telemetry,
    tracing: Tracing,
    admission: Admission,
    is_ready: Callable[[], bool],
    started_at: int,
    batches: BatchRunner,
) -> ExactRoutes:
    """The gateway's public HTTP application over its parts: the hot routes
    straight to their handlers (`ExactRoutes`), the rest through Starlette's
    router, both behind the same checks."""

    parts = Parts(config, fleet, inflight, teams, admission, telemetry, tracing)

    def generation(
        parse: Callable[[Any, str], ParsedRequest], encoder: type[Encoder]
    ) -> GenerationRoute:
        return GenerationRoute(parse, encoder, parts, InputLimits(config))

    hot: dict[str, Any] = {
        "/v1/chat/completions": generation(parse_chat, ChatEncoder),
        "/v1/completions": generation(parse_completion, CompletionEncoder),
        "/v1/embeddings": EmbeddingsRoute(parts),
        **dict.fromkeys(RERANK_PATHS, RerankRoute(parts)),
        **dict.fromkeys(SCORE_PATHS, ScoreRoute(parts)),
        **dict.fromkeys(CLASSIFY_PATHS, ClassifyRoute(parts)),
        **dict.fromkeys(TOKENIZE_PATHS, TokenizeRoute(parts)),
        **dict.fromkeys(DETOKENIZE_PATHS, DetokenizeRoute(parts)),
        TRANSCRIPTIONS: AudioRoute(parts, translate=False),
        TRANSLATIONS: AudioRoute(parts, translate=True),
        **anthropic_routes(parts, InputLimits(config)),
    }
    responses_hot, responses_store = responses_routes(parts, InputLimits(config))
    hot.update(responses_hot)
    # an exact path, so it is matched before the store's `/v1/responses/{response_id}`
    hot[INPUT_TOKENS] = InputTokensRoute(parts, responses_hot[RESPONSES])
    hot[COMPACT] = CompactRoute(parts, InputLimits(config), responses_hot[RESPONSES])
    # a batch's lines go to the endpoints' routes themselves (the checks are the batch's)
    batches.routes = {path: hot[path] for path in ENDPOINTS}
    batches.routes[MESSAGES] = AnthropicShape(hot[MESSAGES])
    routes = [
        *(Route(path, route, methods=["POST"]) for path, route in hot.items()),
        *batch_routes(batches, admission, config.batch_max_file_bytes, config.retry_after),
        *message_batch_routes(batches, admission, config.batch_max_file_bytes, config.retry_after),
        Route("/v1/models", list_models(admission, started_at), methods=["GET"]),
        Route("/v1/models/{model:path}", one_model(admission, started_at), methods=["GET"]),
        *probe_routes(is_ready),
        *KServeRoutes(parts, is_ready=is_ready).routes(),
        *responses_store,
    ]
    if admin_on_public(config):
        routes += admin_routes(fleet=fleet, inflight=inflight, registry=telemetry.registry)
        routes += usage_routes(teams.accounts)

    def checked(app: ASGIApp) -> ASGIApp:
        """Host, key and content type checked, in this order, before `app`."""
        loopback = is_loopback(config.host)
        gate = KeyGate(JsonOnly(app), teams, telemetry.access_log)
        return HostCheck(gate, config.allowed_hosts, loopback)

    rest = _starlette(routes, [])
    hot_checked = {path: checked(route) for path, route in hot.items()}
    for path in anthropic_paths():  # every refusal in Anthropic's shape, the checks' too
        hot_checked[path] = AnthropicShape(hot_checked[path])
    # Starlette's types say MutableMapping where ours say dict
    # the router's refusals on Anthropic's paths and below (a GET: 405; /v1/messages/batches:
    # 404) in Anthropic's shape too, and /v1/models' to Anthropic's clients (anthropic-version)
    others = AnthropicShape(
        RequestIds(checked(cast(ASGIApp, rest))), MESSAGES, versioned=("/v1/models",)
    )
    return ExactRoutes(others, hot_checked, rest.routes)
