"""The Responses API's remote MCP tools (`{"type": "mcp", "server_label",
"server_url", ...}`), as OpenAI's Responses API serves them: the gateway lists each
server's tools (an `mcp_list_tools` output item), gives them to the model as functions,
and runs the calls the model makes (`mcp_call` items), or first asks the client's
approval (`mcp_approval_request`, answered by an `mcp_approval_response` input item).
This module reads OpenAI's tool and items; the servers are gateway/edge/mcp/servers.py's,
an answer's turns gateway/edge/mcp/turns.py's. `headers` and `authorization` go to the
server only, and are never repeated in the response nor stored.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.edge.errors import APIError, invalid
from gateway.edge.mcp.servers import (
    MAX_DESCRIPTION_CHARS,
    MAX_OUTPUT_CHARS,
    McpFailure,
    McpServer,
    McpTool,
    checked_headers,
    sent_tool,
)
from gateway.edge.mcp.turns import Approved, ListingFailed
from gateway.edge.openai.validation import _NAME, MAX_TOOLS, _string
from gateway.protocol import errors
from gateway.protocol.types import ToolCall

MCP = "mcp"
#: Output item types of MCP, which a continuation sends back as input items.
LIST_TOOLS, CALL, APPROVAL_REQUEST, APPROVAL_RESPONSE = (
    "mcp_list_tools",
    "mcp_call",
    "mcp_approval_request",
    "mcp_approval_response",
)
#: A server_label as OpenAI allows it.
LABEL = _NAME
#: Fields of OpenAI's `mcp` tool not served: the values that ask nothing, and why.
UNSERVED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "connector_id": ((None,), "OpenAI's connectors are not served here; name a 'server_url'"),
    "tunnel_id": ((None,), "OpenAI's Secure MCP Tunnels are not served here"),
    "defer_loading": ((None, False), "tool search is not served: the tools are listed"),
    "allowed_callers": ((None, ["direct"]), "only the model calls tools ('direct')"),
}


def parse_server(tool: Mapping[str, Any], where: str) -> McpServer:
    """An `mcp` tool of the request, checked (its URL against the operator's allowed
    prefixes later: `check_allowed`, where the config is known)."""
    known = {
        "type",
        "server_label",
        "server_url",
        "server_description",
        "allowed_tools",
        "require_approval",
        "headers",
        "authorization",
        *UNSERVED_FIELDS,
    }
    for key in tool:
        if key not in known:
            raise invalid(f"{where}.{key}", f"Unknown parameter: '{where}.{key}'.")
    for key, (asks_nothing, why) in UNSERVED_FIELDS.items():
        if tool.get(key) not in asks_nothing:
            raise invalid(f"{where}.{key}", f"'{where}.{key}' is not supported: {why}.")
    label = tool.get("server_label")
    if not isinstance(label, str) or not LABEL.fullmatch(label):
        raise invalid(
            f"{where}.server_label",
            f"'{where}.server_label' is required: 1-64 of a-z, A-Z, 0-9, _ and -.",
        )
    url = tool.get("server_url")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")) or len(url) > 2048:
        raise invalid(f"{where}.server_url", f"'{where}.server_url' is required: an http(s) URL.")
    headers = _headers(tool, where)
    allowed = _allowed(tool.get("allowed_tools"), f"{where}.allowed_tools")
    approval, never, always = _approval(tool.get("require_approval"), f"{where}.require_approval")
    description = _string(tool, "server_description", f"{where}.") or ""
    if len(description) > MAX_DESCRIPTION_CHARS:
        raise invalid(f"{where}.server_description", "Invalid: at most 4096 characters.")
    at = f"{where}.server_url"
    return McpServer(label, url, at, headers, allowed, approval, never, always, description)


def shown(server: McpServer) -> dict[str, Any]:
    """An `mcp` tool as the response object repeats it (its headers left out)."""
    approval: Any = server.approval
    if approval == "by_name":
        approval = {
            "always": {"tool_names": sorted(server.always)},
            "never": {"tool_names": sorted(server.never)},
        }
    return {
        "type": MCP,
        "server_label": server.label,
        "server_url": server.url,
        "server_description": server.description or None,
        "allowed_tools": sorted(server.allowed) if server.allowed is not None else None,
        "require_approval": approval,
        "headers": None,
    }


def _headers(tool: Mapping[str, Any], where: str) -> tuple[tuple[str, str], ...]:
    """`headers`, and `authorization` as a bearer token."""
    raw = tool.get("headers") or {}
    if not isinstance(raw, Mapping):
        raise invalid(f"{where}.headers", "Invalid type: expected an object.")
    pairs = list(raw.items())
    authorization = tool.get("authorization")
    if authorization is not None:
        if not isinstance(authorization, str) or not authorization:
            raise invalid(f"{where}.authorization", "Invalid type: expected a string.")
        pairs.append(("Authorization", f"Bearer {authorization}"))
    return checked_headers(pairs, f"{where}.headers")


def _names(value: Any, where: str) -> frozenset[str]:
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise invalid(where, f"Invalid type: expected a list of at most {MAX_TOOLS} tool names.")
    if not all(isinstance(name, str) and _NAME.fullmatch(name) for name in value):
        raise invalid(where, "Invalid tool name: 1-64 of a-z, A-Z, 0-9, _ and -.")
    return frozenset(value)


def _allowed(value: Any, where: str) -> frozenset[str] | None:
    """`allowed_tools`: a list of names, or `{tool_names: [...]}` (OpenAI's filter; its
    `read_only` is refused by name: the gateway does not read tools' annotations for it)."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        if value.get("read_only") is not None:
            raise invalid(f"{where}.read_only", "The 'read_only' filter is not supported.")
        for key in value:
            if key not in ("tool_names", "read_only"):
                raise invalid(f"{where}.{key}", f"Unknown parameter: '{where}.{key}'.")
        return _names(value.get("tool_names") or [], f"{where}.tool_names")
    return _names(value, where)


def _approval(value: Any, where: str) -> tuple[str, frozenset[str], frozenset[str]]:
    """`require_approval`: "always" (OpenAI's default), "never", or `{always: {tool_names},
    never: {tool_names}}`."""
    if value is None or value == "always":
        return "always", frozenset(), frozenset()
    if value == "never":
        return "never", frozenset(), frozenset()
    if not isinstance(value, Mapping):
        raise invalid(where, "Invalid value: 'always', 'never', or {always, never} filters.")
    lists = {}
    for key in ("always", "never"):
        rule = value.get(key)
        if rule is None:
            lists[key] = frozenset[str]()
            continue
        if not isinstance(rule, Mapping) or set(rule) - {"tool_names", "read_only"}:
            raise invalid(f"{where}.{key}", "Invalid type: expected {tool_names: [...]}.")
        if rule.get("read_only") is not None:
            raise invalid(f"{where}.{key}.read_only", "The 'read_only' filter is not supported.")
        lists[key] = _names(rule.get("tool_names") or [], f"{where}.{key}.tool_names")
    for key in value:
        if key not in ("always", "never"):
            raise invalid(f"{where}.{key}", f"Unknown parameter: '{where}.{key}'.")
    return "by_name", lists["never"], lists["always"]


# -- the items, sent back ---------------------------------------------------------

MCP_ITEMS = frozenset({LIST_TOOLS, CALL, APPROVAL_REQUEST, APPROVAL_RESPONSE})
#: The longest `arguments`, `output` or `error` of an item sent back (characters).
MAX_ITEM_TEXT = MAX_OUTPUT_CHARS


def _text(item: Mapping[str, Any], key: str, where: str, required: bool = True) -> str | None:
    value = item.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or len(value) > MAX_ITEM_TEXT:
        raise invalid(f"{where}.{key}", f"Invalid '{where}.{key}': a string (at most 64 Ki).")
    return value


def _id(item: Mapping[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not 0 < len(value) <= 128:
        raise invalid(f"{where}.{key}", f"'{where}.{key}' is required: 1 to 128 characters.")
    return value


def _label_of(item: Mapping[str, Any], where: str) -> str:
    label = item.get("server_label")
    if not isinstance(label, str) or not LABEL.fullmatch(label):
        raise invalid(f"{where}.server_label", "Invalid server_label: 1-64 of a-z, A-Z, 0-9, _ -.")
    return label


def mcp_item(item: Mapping[str, Any], where: str, kind: str) -> dict[str, Any]:
    """An MCP item sent back (an answer's, or the client's approval), checked, in the
    form the store keeps."""
    if kind == APPROVAL_RESPONSE:
        approve = item.get("approve")
        if not isinstance(approve, bool):
            raise invalid(f"{where}.approve", "'approve' is required: a boolean.")
        return {
            "type": kind,
            "id": _id(item, "id", where) if item.get("id") is not None else _new_id(),
            "approval_request_id": _id(item, "approval_request_id", where),
            "approve": approve,
            "reason": _text(item, "reason", where, required=False),
        }
    shown: dict[str, Any] = {
        "type": kind,
        "id": _id(item, "id", where),
        "server_label": _label_of(item, where),
    }
    if kind == LIST_TOOLS:
        tools = item.get("tools")
        if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
            raise invalid(f"{where}.tools", f"Invalid type: a list of at most {MAX_TOOLS} tools.")
        try:
            listed = [sent_tool(tool) for tool in tools]
        except McpFailure as error:
            raise invalid(f"{where}.tools", f"Invalid 'tools': {error}") from None
        return {**shown, "tools": [tool.shown() for tool in listed], "error": None}
    name = item.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise invalid(f"{where}.name", "Invalid name: 1-64 of a-z, A-Z, 0-9, _ and -.")
    shown |= {"name": name, "arguments": _text(item, "arguments", where)}
    if kind == APPROVAL_REQUEST:
        return shown
    output, failure = _text(item, "output", where, False), _text(item, "error", where, False)
    request = item.get("approval_request_id")
    return {
        **shown,
        "status": "failed" if failure is not None else "completed",
        "output": output,
        "error": failure,
        "approval_request_id": _id(item, "approval_request_id", where) if request else None,
    }


def mcp_turn(item: Mapping[str, Any]) -> tuple[ToolCall | None, tuple[str, str] | None]:
    """What a stored MCP item is in the chat the model reads: the assistant's call, and
    the tool's answer (its call's id, its text): a call run is both (an approved one only
    its answer: its request was the call), a request for approval the call, a refusal of
    one the answer; a listing and an approval given are nothing."""
    kind = item["type"]
    if kind == CALL:
        told = item["output"] or "" if item["error"] is None else f"Error: {item['error']}"
        request = item.get("approval_request_id")
        if request:
            return None, (request, told)
        return ToolCall(item["id"], item["name"], item["arguments"]), (item["id"], told)
    if kind == APPROVAL_REQUEST:
        return ToolCall(item["id"], item["name"], item["arguments"]), None
    if kind == APPROVAL_RESPONSE and not item["approve"]:
        reason = f": {item['reason']}" if item.get("reason") else ""
        return None, (item["approval_request_id"], f"The user did not approve this call{reason}.")
    return None, None


# -- the servers ------------------------------------------------------------------


def _new_id() -> str:
    """An approval's id where the client gave none (OpenAI's style)."""
    return f"mcpa_{secrets.token_hex(24)}"


def approved_calls(
    items: Sequence[dict[str, Any]], given: Sequence[dict[str, Any]], labels: set[str]
) -> list[Approved]:
    """The calls this request's input (`given`) approves, asked by an approval request
    of the conversation (`items`), not yet answered by a call: each of a server among
    this request's `labels`."""
    asked = {item["id"]: item for item in items if item["type"] == APPROVAL_REQUEST}
    done = {item.get("approval_request_id") for item in items if item["type"] == CALL}
    approved = []
    for item in given:
        if item["type"] != APPROVAL_RESPONSE or not item["approve"]:
            continue
        request = asked.get(item["approval_request_id"])
        if request is None:
            raise invalid(
                "input",
                f"No MCP approval request '{item['approval_request_id'][:128]}' in the "
                "conversation to approve.",
            )
        if request["id"] in done:
            continue
        if request["server_label"] not in labels:
            raise invalid(
                "tools",
                f"The approved call is of the MCP server '{request['server_label']}', which "
                "is not among this request's tools.",
            )
        approved.append(
            Approved(request["id"], request["server_label"], request["name"], request["arguments"])
        )
    return approved


def listings(items: Sequence[dict[str, Any]]) -> dict[str, tuple[McpTool, ...]]:
    """The conversation's last listing of each server, by label (`mcp_list_tools`)."""
    return {
        item["server_label"]: tuple(sent_tool(tool) for tool in item["tools"])
        for item in items
        if item["type"] == LIST_TOOLS
    }


def listing_failed(failure: ListingFailed) -> APIError:
    """OpenAI's 424 for a server whose tools could not be listed, naming its URL."""
    server = failure.server
    return APIError(
        424,
        f"Error retrieving tool list from MCP server: '{server.label}': {failure}.",
        type="external_connector_error",
        param=server.where,
        code="mcp_list_tools_failed",
        outcome=errors.Outcome.ENGINE_ERROR,
    )
