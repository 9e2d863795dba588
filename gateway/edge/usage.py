"""`GET /admin/usage`: the usage ledger (gateway.teams.usage) on the admin
listener, for the monthly question "how much did each team use, of what?".

    GET /admin/usage?team=alpha&model=llama-70b&from=2026-12-01&to=2026-12-31&format=csv

Every parameter is optional: `team` and `model` select rows (none: all),
`from` and `to` are UTC days (`YYYY-MM-DD`, both included; default the last 31
days to today, at most 366), `format` is `json` (`{"data": [rows]}`) or `csv`
(a header line, then the same rows). One row per day x team x model x key id,
with `prompt_tokens`, `cached_tokens` (of those, the ones the engine's prefix
cache held), `completion_tokens`, `requests`, `spend` and a count per outcome;
no totals mixed in. An unknown parameter, or a bad value, is a 400
naming it; a ledger in Redis that does not answer, a 503.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.edge.errors import SERVER, APIError, invalid
from gateway.edge.ops import json_response
from gateway.teams.accounts import Accounts
from gateway.teams.usage import MAX_DAYS, STORE_FAILURES, to_csv

#: The parameters the route reads.
PARAMS = ("team", "model", "from", "to", "format")
#: Days a query without `from` spans, today included.
DEFAULT_DAYS = 31


def _day(name: str, value: str | None, default: date) -> date:
    if value is None:
        return default
    try:
        return date.fromisoformat(value)
    except ValueError:
        raise invalid(name, f"`{name}` must be a UTC day, YYYY-MM-DD.") from None


def usage_routes(accounts: Accounts) -> list[Route]:
    """The usage route over `accounts`' ledger."""

    async def usage(request: Request) -> Response:
        query = request.query_params
        for name in query:
            if name not in PARAMS:
                known = ", ".join(PARAMS)
                raise invalid(name[:64], f"Unknown parameter `{name[:64]}`; known: {known}.")
        fmt = query.get("format", "json")
        if fmt not in ("json", "csv"):
            raise invalid("format", "`format` must be json or csv.")
        last = _day("to", query.get("to"), datetime.now(UTC).date())
        first = _day("from", query.get("from"), last - timedelta(days=DEFAULT_DAYS - 1))
        if first > last:
            raise invalid("from", "`from` must not be after `to`.")
        if (last - first).days >= MAX_DAYS:
            raise invalid("from", f"A query spans at most {MAX_DAYS} days.")
        try:
            rows = await accounts.ledger.query(query.get("team"), query.get("model"), first, last)
        except STORE_FAILURES:
            raise APIError(
                503,
                "The usage ledger (Redis) does not answer; try again shortly.",
                type=SERVER,
                code="usage_store_unavailable",
                retry_after=1,
            ) from None
        if fmt == "csv":
            return Response(to_csv(rows), media_type="text/csv; charset=utf-8")
        return json_response({"data": rows})

    return [Route("/admin/usage", usage, methods=["GET"])]
