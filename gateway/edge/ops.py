"""The operators' routes: liveness and readiness (the probes), and the admin
routes: metrics (Prometheus text and a JSON summary) and the fleet's workers.
None of them takes a slot.

The admin routes name every model, every worker's address and every team, so
they belong on the admin listener (`admin_port`), as Envoy's admin port; the
probes are on both listeners, since kubelet may probe either.
"""

from __future__ import annotations

from collections.abc import Callable

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.admission import InFlight
from gateway.fleet import Fleet
from gateway.telemetry.summary import model_summary


def json_response(payload: object, status: int = 200) -> Response:
    """A JSON response from any orjson-serializable value."""
    return Response(orjson.dumps(payload), status, media_type="application/json")


#: The admin routes' paths (what the public listener of a keyed gateway hides).
ADMIN_PATHS = ("/admin/workers", "/admin/usage", "/metrics", "/metrics/json")


def probe_routes(is_ready: Callable[[], bool]) -> list[Route]:
    """`/health` and `/ready`."""

    async def health(request: Request) -> Response:
        return json_response({"status": "ok"})

    async def ready(request: Request) -> Response:
        if is_ready():
            return json_response({"status": "ready"})
        return json_response({"status": "not ready"}, 503)

    return [
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
    ]


def admin_routes(
    *,
    fleet: Fleet,
    inflight: InFlight,
    registry: CollectorRegistry,
) -> list[Route]:
    """`/metrics`, `/metrics/json` and `/admin/workers` (`ADMIN_PATHS`)."""

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    async def metrics_json(request: Request) -> Response:
        slots = inflight.slots
        return json_response(
            {
                "models": model_summary(registry),
                "slots": {"total": slots.limit, "in_use": slots.in_use},
            }
        )

    async def workers(request: Request) -> Response:
        return json_response({**fleet.snapshot(), "draining": inflight.draining})

    return [
        Route("/admin/workers", workers, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/metrics/json", metrics_json, methods=["GET"]),
    ]
