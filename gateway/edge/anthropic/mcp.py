"""Anthropic's MCP connector: `mcp_servers` (`{"type": "url", "url", "name",
"authorization_token", "tool_configuration"}`) and their `mcp_toolset` entries in `tools`
(`{"type": "mcp_toolset", "mcp_server_name", "default_config", "configs", "tools"}`), as
Anthropic's Messages API serves them: the gateway lists each server's tools, gives them
to the model, and runs the calls it makes between the model's turns (Anthropic asks no
approval), the answer holding each as an `mcp_tool_use` block and its `mcp_tool_result`.
This module reads the request's servers and the blocks a conversation sends back; the
servers and the turns are gateway/edge/mcp's.

Which tools a server gives the model: its toolset's `configs[name].enabled`, else its
`default_config.enabled` (true by default); without a toolset, its `tool_configuration`
(`enabled`, `allowed_tools`: the older beta's). A toolset's `tools` (a listing copied
from an earlier answer), and an `mcp_tool_listing` block sent back, are the server's
listing: it is not asked again. `defer_loading` (tool search) is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from gateway.edge.errors import APIError, invalid
from gateway.edge.mcp.servers import (
    MAX_OUTPUT_CHARS,
    McpFailure,
    McpServer,
    McpTool,
    checked_headers,
    sent_tool,
)
from gateway.edge.mcp.turns import ListingFailed
from gateway.edge.openai.validation import _NAME, MAX_TOOLS
from gateway.protocol import errors
from gateway.protocol.types import Message, ToolCall

TOOLSET = "mcp_toolset"
#: The blocks of a server's calls in an assistant turn, and of its listing.
USE, RESULT, LISTING = "mcp_tool_use", "mcp_tool_result", "mcp_tool_listing"
#: Servers a request may name at most.
MAX_SERVERS = 20
_SERVER_FIELDS = frozenset({"type", "url", "name", "authorization_token", "tool_configuration"})
_TOOLSET_FIELDS = frozenset(
    {"type", "mcp_server_name", "default_config", "configs", "tools", "cache_control"}
)


@dataclass
class Connector:
    """A request's MCP servers, and the listings its conversation holds, by name."""

    servers: tuple[McpServer, ...] = ()
    listed: dict[str, tuple[McpTool, ...]] = field(default_factory=dict)


def connector(body: Mapping[str, Any]) -> Connector:
    """`mcp_servers` and their toolsets in `tools`, checked (the URLs against the
    operator's allowed prefixes later, where the config is known)."""
    raw = body.get("mcp_servers")
    toolsets = _toolsets(body.get("tools"))
    if raw is None:
        raw = []  # a toolset then names no server: refused below
    elif not isinstance(raw, list) or not 0 < len(raw) <= MAX_SERVERS:
        raise invalid("mcp_servers", f"mcp_servers: a list of 1 to {MAX_SERVERS} servers.")
    servers: list[McpServer] = []
    listed: dict[str, tuple[McpTool, ...]] = {}
    for i, server in enumerate(raw):
        where = f"mcp_servers[{i}]"
        if not isinstance(server, Mapping) or server.get("type") != "url":
            raise invalid(f"{where}.type", f"{where}.type: 'url'.")
        for key in server:
            if key not in _SERVER_FIELDS:
                raise invalid(f"{where}.{key}", f"{where}.{key}: Extra inputs are not permitted")
        name = server.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise invalid(f"{where}.name", f"{where}.name: 1-64 of a-z, A-Z, 0-9, _ and -.")
        if any(other.label == name for other in servers):
            raise invalid(f"{where}.name", f"{where}.name: MCP server names must be unique.")
        url = server.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise invalid(f"{where}.url", f"{where}.url: an http(s) URL is required.")
        token = server.get("authorization_token")
        if token is not None and (not isinstance(token, str) or not token):
            raise invalid(f"{where}.authorization_token", "authorization_token: a string.")
        headers = checked_headers(
            [("Authorization", f"Bearer {token}")] if token else [], f"{where}.authorization_token"
        )
        toolset = toolsets.pop(name, None)
        allowed, denied = _offered(server, toolset, where)
        if toolset is not None and toolset[1].get("tools") is not None:
            listed[name] = _listing(toolset[1]["tools"], f"{toolset[0]}.tools")
        at = f"{where}.url"  # Anthropic asks no approval: every call runs
        servers.append(McpServer(name, url, at, headers, allowed, "never", denied=denied))
    for name, (where, _) in toolsets.items():
        raise invalid(
            f"{where}.mcp_server_name",
            f"{where}.mcp_server_name: no server in mcp_servers is named {name[:64]!r}.",
        )
    return Connector(tuple(servers), listed)


def _toolsets(tools: Any) -> dict[str, tuple[str, Mapping[str, Any]]]:
    """The `mcp_toolset` entries of `tools`, by their server's name (with where each is)."""
    found: dict[str, tuple[str, Mapping[str, Any]]] = {}
    for k, tool in enumerate(tools if isinstance(tools, list) else []):
        if not isinstance(tool, Mapping) or tool.get("type") != TOOLSET:
            continue
        where = f"tools[{k}]"
        for key in tool:
            if key not in _TOOLSET_FIELDS:
                raise invalid(f"{where}.{key}", f"{where}.{key}: Extra inputs are not permitted")
        name = tool.get("mcp_server_name")
        if not isinstance(name, str) or not name:
            raise invalid(f"{where}.mcp_server_name", f"{where}.mcp_server_name: required.")
        if name in found:
            raise invalid(f"{where}.mcp_server_name", f"{where}: one toolset a server.")
        found[name] = (where, tool)
    return found


def _enabled(config: Any, where: str) -> bool | None:
    """A tool config's `enabled` (None: not said); `defer_loading` refused by name."""
    if config is None:
        return None
    if not isinstance(config, Mapping) or set(config) - {"enabled", "defer_loading"}:
        raise invalid(where, f"{where}: {{enabled, defer_loading}}.")
    if config.get("defer_loading") not in (None, False):
        raise invalid(
            f"{where}.defer_loading",
            f"{where}.defer_loading: tool search is not supported by this gateway.",
        )
    enabled = config.get("enabled")
    if enabled is not None and not isinstance(enabled, bool):
        raise invalid(f"{where}.enabled", f"{where}.enabled: a boolean.")
    return enabled


def _offered(
    server: Mapping[str, Any], toolset: tuple[str, Mapping[str, Any]] | None, where: str
) -> tuple[frozenset[str] | None, frozenset[str]]:
    """The tool names the model may call (None: every one the server lists), and those
    turned off."""
    none = frozenset[str]()
    if toolset is not None:
        at, tools = toolset
        default = _enabled(tools.get("default_config"), f"{at}.default_config")
        configs = tools.get("configs") or {}
        if not isinstance(configs, Mapping) or len(configs) > MAX_TOOLS:
            raise invalid(f"{at}.configs", f"{at}.configs: an object of tool configs.")
        by_name = {name: _enabled(c, f"{at}.configs.{name}") for name, c in configs.items()}
        if default is False:  # only those turned on
            return frozenset(name for name, on in by_name.items() if on), none
        return None, frozenset(name for name, on in by_name.items() if on is False)
    config = server.get("tool_configuration")
    if config is None:
        return None, none
    if not isinstance(config, Mapping) or set(config) - {"enabled", "allowed_tools"}:
        raise invalid(
            f"{where}.tool_configuration", "tool_configuration: {enabled, allowed_tools}."
        )
    if config.get("enabled") is False:
        return none, none
    names = config.get("allowed_tools")
    if names is None:
        return None, none
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise invalid(f"{where}.tool_configuration.allowed_tools", "allowed_tools: names.")
    return frozenset(names), none


def _listing(tools: Any, where: str) -> tuple[McpTool, ...]:
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise invalid(where, f"{where}: a list of at most {MAX_TOOLS} tools.")
    try:
        return tuple(sent_tool(tool) for tool in tools)
    except McpFailure as failure:
        raise invalid(where, f"{where}: {failure}") from None


# -- the blocks of an assistant turn, sent back -------------------------------------------


def use_block(block: Mapping[str, Any], where: str) -> ToolCall:
    """An `mcp_tool_use` block: the assistant's call (its server's run it)."""
    for key in block:
        if key not in ("type", "id", "name", "server_name", "input", "cache_control"):
            raise invalid(f"{where}.{key}", f"{where}.{key}: Extra inputs are not permitted")
    call_id, name = block.get("id"), block.get("name")
    if not isinstance(call_id, str) or not 0 < len(call_id) <= 256:
        raise invalid(f"{where}.id", f"{where}.id: required.")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise invalid(f"{where}.name", f"{where}.name: 1-64 of a-z, A-Z, 0-9, _ and -.")
    arguments = block.get("input")
    if not isinstance(arguments, Mapping):
        raise invalid(f"{where}.input", f"{where}.input: an object.")
    return ToolCall(call_id, name, orjson.dumps(arguments).decode())


def result_block(block: Mapping[str, Any], where: str) -> Message:
    """An `mcp_tool_result` block: the tool's answer, as the model read it."""
    for key in block:
        if key not in ("type", "tool_use_id", "is_error", "content", "cache_control"):
            raise invalid(f"{where}.{key}", f"{where}.{key}: Extra inputs are not permitted")
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or not call_id:
        raise invalid(f"{where}.tool_use_id", f"{where}.tool_use_id: required.")
    content = block.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise invalid(f"{where}.content", f"{where}.content: text blocks only.")
            parts.append(part.get("text"))
        content = "".join(p for p in parts if isinstance(p, str))
    if not isinstance(content, str) or len(content) > MAX_OUTPUT_CHARS:
        raise invalid(f"{where}.content", f"{where}.content: text (at most 64 Ki).")
    failed = block.get("is_error") is True
    return Message("tool", f"Error: {content}" if failed else content, tool_call_id=call_id)


def listing_block(block: Mapping[str, Any], where: str) -> tuple[str, tuple[McpTool, ...]]:
    """An `mcp_tool_listing` block: a server's tools as an earlier answer listed them."""
    name = block.get("mcp_server_name")
    if not isinstance(name, str) or not name:
        raise invalid(f"{where}.mcp_server_name", f"{where}.mcp_server_name: required.")
    return name, _listing(block.get("tools"), f"{where}.tools")


def listing_failed(failure: ListingFailed) -> APIError:
    """A server whose tools could not be listed: a 424 naming its URL."""
    server = failure.server
    return APIError(
        424,
        f"Connection error while communicating with MCP server '{server.label}': {failure}.",
        param=server.where,
        outcome=errors.Outcome.ENGINE_ERROR,
    )
