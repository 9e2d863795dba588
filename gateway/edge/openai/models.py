"""The models a caller may use: `GET /v1/models` and `GET /v1/models/{id}` as
OpenAI answers them (language models first, with the context length vLLM
reports as `max_model_len` once a worker has told it; a LoRA adapter with its base
model as `parent`, as vLLM lists one). A model outside the
caller's team is as missing as an unknown one; `resolve`, which turns the
model a request names into its pool, is admission's visibility stage
(gateway/admission/admit.py). A request from Anthropic's clients (`anthropic-version`)
is answered in Anthropic's shape (gateway/edge/anthropic/models.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from gateway.admission.admit import Admission, resolve, usable
from gateway.edge.anthropic import models as anthropic
from gateway.edge.errors import APIError
from gateway.edge.ops import json_response
from gateway.fleet import ModelPool
from gateway.teams import team_of

__all__ = ["list_models", "one_model", "resolve"]


def _entry(pool: ModelPool, created: int) -> dict[str, object]:
    entry: dict[str, object] = {
        "id": pool.name,
        "object": "model",
        "created": created,
        "owned_by": "furnace",
    }
    if pool.kind == "llm" and pool.max_context:
        entry["max_model_len"] = pool.max_context
    if pool.base is not None:  # a LoRA adapter, named with its base as vLLM names it
        entry["parent"] = pool.base.name
    return entry


def _alias_entry(name: str, created: int) -> dict[str, object]:
    return {"id": name, "object": "model", "created": created, "owned_by": "furnace"}


def list_models(admission: Admission, created: int) -> Callable[[Request], Awaitable[Response]]:
    """The endpoint listing the fleet's models, then the aliases (as models), filtered
    by the caller's team."""

    async def endpoint(request: Request) -> Response:
        team = team_of(request.scope)
        pools, aliases = usable(admission.fleet, team), admission.aliases_of(team)
        if anthropic.VERSION_HEADER in request.headers:
            infos = [anthropic.model_info(pool.name, created, pool) for pool in pools]
            infos += [anthropic.model_info(name, created) for name in aliases]
            return anthropic.page(infos, request.query_params)
        data = [_entry(pool, created) for pool in pools]
        data += [_alias_entry(name, created) for name in aliases]
        return json_response({"object": "list", "data": data})

    return endpoint


def one_model(admission: Admission, created: int) -> Callable[[Request], Awaitable[Response]]:
    """`GET /v1/models/{id}`: one model (or alias), or OpenAI's 404 (ids may hold
    slashes)."""

    async def endpoint(request: Request) -> Response:
        name = request.path_params["model"]
        team = team_of(request.scope)
        pool = next((p for p in usable(admission.fleet, team) if p.name == name), None)
        anthropics = anthropic.VERSION_HEADER in request.headers
        if pool is None and name in admission.aliases_of(team):
            alias = (
                anthropic.model_info(name, created) if anthropics else _alias_entry(name, created)
            )
            return json_response(alias)
        if pool is None:
            message = f"The model `{name[:256]}` does not exist."
            raise APIError(404, message, param="model", code="model_not_found")
        if anthropics:
            return json_response(anthropic.model_info(pool.name, created, pool))
        return json_response(_entry(pool, created))

    return endpoint
