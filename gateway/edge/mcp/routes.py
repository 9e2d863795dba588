"""What a generation route does for an answer of turns (turns.py), whatever its API: the
plan made in the request's slot (the servers' URLs checked against the operator's
`mcp_allowed_urls`, their tools listed and given to the model, the model's features
checked for them), and the turns started on the pool that serves, as its first turn was.
"""

from __future__ import annotations

from collections.abc import Awaitable, Coroutine, Mapping, Sequence
from dataclasses import replace
from typing import Any

from gateway.edge.mcp.servers import McpServer, McpTool, check_allowed
from gateway.edge.mcp.turns import McpPlan, make_plan, turns_start
from gateway.edge.openai.generation import GenerationRoute, check_features, served
from gateway.edge.request import Exchange
from gateway.fleet import ModelPool
from gateway.protocol.deadline import Deadline
from gateway.protocol.types import GenerateRequest, Started
from gateway.upstreams.base import UpstreamCall


async def planned(
    route: GenerationRoute,
    servers: Sequence[McpServer],
    listed: Mapping[str, tuple[McpTool, ...]],
    request: GenerateRequest,
    max_calls: int,
    pool: ModelPool,
) -> tuple[McpPlan, GenerateRequest]:
    """The plan of an answer whose request names `servers`, and the request with their
    tools; `ListingFailed` for a server that cannot be listed (each API's words)."""
    check_allowed(servers, route.config.mcp_allowed_urls)
    functions = [tool.name for tool in request.tools]
    timeout = route.config.mcp_timeout
    plan = await make_plan(servers, listed, functions, max_calls, timeout)
    request = replace(request, tools=(*request.tools, *plan.functions()))
    check_features(pool, request)
    return plan, request


def started_turns(
    route: GenerationRoute,
    plan: McpPlan,
    request: GenerateRequest,
    start: Coroutine[Any, Any, tuple[Started, UpstreamCall]],
    pool: ModelPool,
    deadline: Deadline,
    metadata: tuple[tuple[str, str], ...],
    ex: Exchange,
) -> Coroutine[Any, Any, tuple[Started, UpstreamCall]]:
    """The answer's turns from its first turn's `start`: the next ones on the pool that
    serves (a fallback's, where admission moved the request), as the first was started."""

    def start_turn(turn: GenerateRequest) -> Awaitable[tuple[Started, UpstreamCall]]:
        return route.fleet.start_call(served(ex.ctx, pool), turn, deadline, metadata, ex.record)

    started = route.admission.falls_back(ex.ctx)
    timeout = route.config.mcp_timeout
    return turns_start(plan, request, start, start_turn, started, deadline, timeout)
