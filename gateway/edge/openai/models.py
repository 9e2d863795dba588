"""`GET /v1/models`: the models the caller may use, as OpenAI lists them, with
the context length of language models (`max_model_len`, as vLLM reports it)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from gateway.edge.ops import json_response
from gateway.fleet import Fleet
from gateway.teams import Teams, team_of


def list_models(
    fleet: Fleet, teams: Teams, created: int
) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint listing the fleet's models, filtered by the caller's team."""

    async def endpoint(request: Request) -> Response:
        team = team_of(request.scope)
        data = []
        for pool in fleet.models.values():
            if not teams.sees(team, pool.name):
                continue
            entry: dict[str, object] = {
                "id": pool.name,
                "object": "model",
                "created": created,
                "owned_by": "furnace",
            }
            if pool.kind == "llm":
                entry["max_model_len"] = pool.max_context
            data.append(entry)
        return json_response({"object": "list", "data": data})

    return endpoint
