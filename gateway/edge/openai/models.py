"""The models a caller may use: `GET /v1/models` and `GET /v1/models/{id}` as
OpenAI answers them (language models first, with the context length vLLM
reports as `max_model_len` once a worker has told it), and `resolve`, which
every OpenAI route uses to turn the model a request names into its pool.

A model outside the caller's team is as missing as an unknown one, and the
404 lists what the caller may use instead, so a typo is fixed in one try.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from gateway.edge.errors import APIError
from gateway.edge.ops import json_response
from gateway.fleet import Fleet, ModelPool
from gateway.protocol import errors
from gateway.teams import Team, Teams, team_of

#: Names the 404 lists at most.
LISTED = 32


def usable(fleet: Fleet, team: Team | None) -> list[ModelPool]:
    """The pools `team` may use, language models first, each group in config order."""
    pools = [pool for pool in fleet.models.values() if Teams.sees(team, pool.name)]
    return sorted(pools, key=lambda pool: pool.kind != "llm")


def resolve(fleet: Fleet, team: Team | None, name: str | None) -> ModelPool:
    """The LLM pool a request names (its team's first when it names none); a 404
    listing the usable models for one it may not see, a 400 for a tensor model.
    A name the team may use is looked up at once; the list is made for the rest."""
    if name is not None and name in fleet.models and Teams.sees(team, name):
        return fleet.get(name)
    pools = usable(fleet, team)
    if name is None:
        name = next((p.name for p in pools if p.kind == "llm"), None)
        if name is None:
            raise errors.ModelNotFound("No model is named, and none is served.", param="model")
    if not any(pool.name == name for pool in pools):
        names = [pool.name for pool in pools[:LISTED]]
        more = ", ..." if len(pools) > LISTED else ""
        listing = f" Models you can use: {', '.join(names)}{more}." if names else ""
        raise errors.ModelNotFound(
            f"The model `{name[:256]}` does not exist.{listing}", param="model"
        )
    return fleet.get(name)


def _entry(pool: ModelPool, created: int) -> dict[str, object]:
    entry: dict[str, object] = {
        "id": pool.name,
        "object": "model",
        "created": created,
        "owned_by": "furnace",
    }
    if pool.kind == "llm" and pool.max_context:
        entry["max_model_len"] = pool.max_context
    return entry


def list_models(fleet: Fleet, created: int) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint listing the fleet's models, filtered by the caller's team."""

    async def endpoint(request: Request) -> Response:
        team = team_of(request.scope)
        data = [_entry(pool, created) for pool in usable(fleet, team)]
        return json_response({"object": "list", "data": data})

    return endpoint


def one_model(fleet: Fleet, created: int) -> Callable[[Request], Awaitable[Response]]:
    """`GET /v1/models/{id}`: one model, or OpenAI's 404 (ids may hold slashes)."""

    async def endpoint(request: Request) -> Response:
        name = request.path_params["model"]
        team = team_of(request.scope)
        pool = next((p for p in usable(fleet, team) if p.name == name), None)
        if pool is None:
            message = f"The model `{name[:256]}` does not exist."
            raise APIError(404, message, param="model", code="model_not_found")
        return json_response(_entry(pool, created))

    return endpoint
