"""What a route does before an answer of turns (turns.py), whatever its API, and before
it counts such a request's prompt (the Responses API's input_tokens): the plan, made in
the request's slot (the servers' URLs checked against the operator's `mcp_allowed_urls`,
their tools listed and given to the model, the model's features checked for them). The
turns start where the first turn does (the generation route's `turns`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from gateway.edge.mcp.servers import McpServer, McpTool, check_allowed
from gateway.edge.mcp.turns import McpPlan, make_plan
from gateway.edge.openai.generation import check_features
from gateway.edge.request import RequestRoute
from gateway.fleet import ModelPool
from gateway.protocol.types import GenerateRequest


async def planned(
    route: RequestRoute[Any],
    servers: Sequence[McpServer],
    listed: Mapping[str, tuple[McpTool, ...]],
    request: GenerateRequest,
    max_calls: int,
    pool: ModelPool,
) -> tuple[McpPlan, GenerateRequest]:
    """The plan of an answer whose request names `servers`, and the request with their
    tools; `ListingFailed` for a server that cannot be listed (each API's words)."""
    servers = check_allowed(servers, route.config.mcp_allowed_urls)
    functions = [tool.name for tool in request.tools]
    timeout, record = route.config.mcp_timeout, route.telemetry.metrics.mcp_step
    span = route.tracing.tool_step
    plan = await make_plan(servers, listed, functions, max_calls, timeout, record, span)
    request = replace(request, tools=(*request.tools, *plan.functions()))
    check_features(pool, request)
    return plan, request
