"""The Starlette application: routes, OpenAI-shaped errors for everything, and the
lifespan that opens the worker channels on the serving loop and closes them."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.admission import Slots
from gateway.config import Config
from gateway.fleet import Fleet
from gateway.openai.encoding import ChatEncoder, CompletionEncoder
from gateway.openai.errors import APIError
from gateway.openai.gates import HeaderLimit, KeyGate
from gateway.openai.routes import GenerationRoute, internal_error
from gateway.openai.validation import parse_chat, parse_completion
from gateway.state import GatewayState
from gateway.teams import team_of
from gateway.telemetry import model_summary

log = logging.getLogger("furnace.app")


def _json(payload: object, status: int = 200) -> Response:
    return Response(orjson.dumps(payload), status, media_type="application/json")


def _error_response(error: APIError) -> Response:
    headers = {k.decode(): v.decode() for k, v in error.headers()}
    return Response(error.body(), error.status, headers, media_type="application/json")


def create_app(config: Config) -> Starlette:
    """The gateway for `config`; its workers are reached once the app starts."""
    state = GatewayState(config=config, slots=Slots(config.max_concurrent_requests))

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.fleet = Fleet(config)
        state.started_at = int(time.time())
        await state.fleet.start()
        await state.teams.start()
        state.ready = True
        try:
            yield
        finally:
            state.ready = False
            await state.fleet.close()
            await state.teams.close()

    async def list_models(request: Request) -> Response:
        assert state.fleet is not None
        data = []
        team = team_of(request.scope)
        for pool in state.fleet.models.values():
            if not state.teams.sees(team, pool.name):
                continue
            entry: dict[str, object] = {
                "id": pool.name,
                "object": "model",
                "created": state.started_at,
                "owned_by": "furnace",
            }
            if pool.kind == "llm":
                entry["max_model_len"] = pool.max_context
            data.append(entry)
        return _json({"object": "list", "data": data})

    async def workers(request: Request) -> Response:
        assert state.fleet is not None
        return _json({**state.fleet.snapshot(), "draining": state.draining})

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(state.telemetry.registry), media_type=CONTENT_TYPE_LATEST)

    async def metrics_json(request: Request) -> Response:
        return _json(
            {
                "models": model_summary(state.telemetry),
                "slots": {"total": state.slots.limit, "in_use": state.slots.in_use},
            }
        )

    async def health(request: Request) -> Response:
        return _json({"status": "ok"})

    async def ready(request: Request) -> Response:
        if state.ready:
            return _json({"status": "ready"})
        return _json({"status": "not ready"}, 503)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return _error_response(APIError(exc.status_code, str(exc.detail), code=code))

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return _error_response(internal_error())

    routes = [
        Route(
            "/v1/chat/completions",
            GenerationRoute(state, parse_chat, ChatEncoder),
            methods=["POST"],
        ),
        Route(
            "/v1/completions",
            GenerationRoute(state, parse_completion, CompletionEncoder),
            methods=["POST"],
        ),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/admin/workers", workers, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/metrics/json", metrics_json, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        middleware=[
            Middleware(HeaderLimit, limit=config.max_header_bytes),
            Middleware(KeyGate, teams=state.teams),
        ],
        exception_handlers={HTTPException: http_error, Exception: server_error},
    )
    app.state.gateway = state
    return app
