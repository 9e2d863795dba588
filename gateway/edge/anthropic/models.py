"""`GET /v1/models` and `GET /v1/models/{id}` as Anthropic's Models API answers them,
for a request that says `anthropic-version` (Anthropic's SDKs send it on every
call; OpenAI's never do): the same path as OpenAI's listing, so the shape is
chosen by that header, and OpenAI's clients see no change.

A model is `{"type": "model", "id", "display_name", "created_at", ...}` (the
name as its display name, the gateway's start as its time, RFC 3339, and its
context as `max_input_tokens` once a worker has told it, its `max_tokens_limit`
as `max_tokens`), a page is `{"data", "has_more", "first_id", "last_id"}` with
Anthropic's `limit`, `after_id` and `before_id` (a refusal raised here is put in
Anthropic's shape by `errors.AnthropicShape`, as the key check's is).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import orjson
from starlette.responses import Response

from gateway.edge.errors import invalid
from gateway.fleet import ModelPool

#: The header that marks a request from Anthropic's clients.
VERSION_HEADER = "anthropic-version"
#: Anthropic's page size: 20 by default, 1 to 1000.
DEFAULT_LIMIT, MAX_LIMIT = 20, 1000


def model_info(name: str, created: int, pool: ModelPool | None = None) -> dict[str, Any]:
    """A model (or an alias, with no pool) as Anthropic's `ModelInfo`."""
    created_at = datetime.fromtimestamp(created, UTC).isoformat().replace("+00:00", "Z")
    info: dict[str, Any] = {
        "type": "model",
        "id": name,
        "display_name": name,
        "created_at": created_at,
        "lifecycle": "active",
    }
    if pool is not None and pool.kind == "llm" and pool.max_context:
        info["max_input_tokens"] = pool.max_context
    if pool is not None and pool.max_tokens_limit:
        info["max_tokens"] = pool.max_tokens_limit
    return info


def page(models: Sequence[dict[str, Any]], query: Mapping[str, str]) -> Response:
    """A page of `models` as Anthropic lists them (else a 400 naming the parameter)."""
    chosen, has_more = _window(models, query)
    body = {
        "data": chosen,
        "has_more": has_more,
        "first_id": chosen[0]["id"] if chosen else None,
        "last_id": chosen[-1]["id"] if chosen else None,
    }
    return Response(orjson.dumps(body), 200, media_type="application/json")


def _window(
    models: Sequence[dict[str, Any]], query: Mapping[str, str]
) -> tuple[list[dict[str, Any]], bool]:
    raw = query.get("limit", str(DEFAULT_LIMIT))
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 4) or not 1 <= int(raw) <= MAX_LIMIT:
        raise invalid("limit", f"Invalid value for 'limit': an integer in [1, {MAX_LIMIT}].")
    limit = int(raw)
    ids = [model["id"] for model in models]
    after, before = query.get("after_id"), query.get("before_id")
    if after is not None and before is not None:
        raise invalid("before_id", "Give 'after_id' or 'before_id', not both.")
    for name, value in (("after_id", after), ("before_id", before)):
        if value is not None and value not in ids:
            raise invalid(name, f"Invalid value for '{name}': no model '{value[:256]}'.")
    if before is not None:
        end = ids.index(before)
        return list(models[max(0, end - limit) : end]), end - limit > 0
    start = 0 if after is None else ids.index(after) + 1
    return list(models[start : start + limit]), start + limit < len(models)
