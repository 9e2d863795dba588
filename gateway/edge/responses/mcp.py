"""Remote MCP servers as tools of a Responses request (`{"type": "mcp", "server_label",
"server_url", ...}`), as OpenAI's Responses API serves them: the gateway lists each
server's tools (an `mcp_list_tools` output item), gives them to the model as functions,
and runs the calls the model makes (`mcp_call` items), or first asks the client's
approval (`mcp_approval_request`, answered by an `mcp_approval_response` input item).
The turns of one response are mcp_turns.py's; this module reads the tool and the items,
and speaks to the servers.

A client names the server's URL, and the gateway calls it: only URLs under the
operator's `mcp_allowed_urls` prefixes are taken (else a 400 naming `server_url`), so a
client cannot point the gateway at what it can reach and they cannot. `headers` and
`authorization` go to that server only, and are never repeated in the response or
stored. Each step with a server (its tools listed, one call) is bounded by
`mcp_timeout` and the request's deadline; what a server sends is bounded: its tools
(`MAX_TOOLS` in all with the request's functions), a tool's schema and description, a
call's output (`MAX_OUTPUT_CHARS`, cut beyond).

The MCP SDK (the `mcp` package, Streamable HTTP) speaks the protocol: its handshake,
versions and pagination are its own, a session per step.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx2
import orjson
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.types import TextContent

from gateway.edge.errors import invalid
from gateway.edge.openai.validation import _NAME, MAX_TOOLS, _string
from gateway.protocol.types import ToolCall

log = logging.getLogger("furnace.responses")

MCP = "mcp"
#: Output item types of MCP, which a continuation sends back as input items.
LIST_TOOLS, CALL, APPROVAL_REQUEST, APPROVAL_RESPONSE = (
    "mcp_list_tools",
    "mcp_call",
    "mcp_approval_request",
    "mcp_approval_response",
)
#: A call's output kept at most (characters): cut beyond, as the model reads it whole.
MAX_OUTPUT_CHARS = 64 * 1024
#: A listed tool's description and its input schema (JSON) at most, in characters.
MAX_DESCRIPTION_CHARS = 4096
MAX_SCHEMA_CHARS = 64 * 1024
#: Pages of a server's tool listing read at most.
MAX_PAGES = 16
#: Headers of the connection, not a client's to set (`Host` would name another server).
CONNECTION_HEADERS = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "upgrade", "te", "trailer"}
)
#: Headers a tool may send its server, and their size.
MAX_HEADERS = 32
MAX_HEADER_CHARS = 8192
#: A server_label as OpenAI allows it.
LABEL = _NAME
#: Fields of OpenAI's `mcp` tool not served: the values that ask nothing, and why.
UNSERVED_FIELDS: dict[str, tuple[tuple[Any, ...], str]] = {
    "connector_id": ((None,), "OpenAI's connectors are not served here; name a 'server_url'"),
    "tunnel_id": ((None,), "OpenAI's Secure MCP Tunnels are not served here"),
    "defer_loading": ((None, False), "tool search is not served: the tools are listed"),
    "allowed_callers": ((None, ["direct"]), "only the model calls tools ('direct')"),
}


@dataclass(frozen=True)
class McpServer:
    """One `mcp` tool of a request: the server and what may be done with it."""

    label: str
    url: str
    #: Sent to the server only (never shown): `headers`, and `authorization` as a bearer.
    headers: tuple[tuple[str, str], ...]
    #: `allowed_tools`' names (None: every tool the server lists).
    allowed: frozenset[str] | None
    #: `require_approval`: "always", "never", or the names that need none / need it.
    approval: str
    never: frozenset[str]
    always: frozenset[str]
    description: str
    #: Where the request names it (`tools[2]`), for a 400.
    where: str

    def needs_approval(self, name: str) -> bool:
        """Whether a call of the tool `name` waits for the client's approval: by
        `require_approval` (a tool named under neither list needs it, as OpenAI's default)."""
        if self.approval == "never":
            return False
        if self.approval == "always":
            return True
        return name not in self.never or name in self.always

    def shown(self) -> dict[str, Any]:
        """The tool as the response object repeats it (its headers left out)."""
        approval: Any = self.approval
        if approval == "by_name":
            approval = {
                "always": {"tool_names": sorted(self.always)},
                "never": {"tool_names": sorted(self.never)},
            }
        return {
            "type": MCP,
            "server_label": self.label,
            "server_url": self.url,
            "server_description": self.description or None,
            "allowed_tools": sorted(self.allowed) if self.allowed is not None else None,
            "require_approval": approval,
            "headers": None,
        }


@dataclass(frozen=True)
class McpTool:
    """A tool a server lists, as an `mcp_list_tools` item shows it."""

    name: str
    description: str
    input_schema: dict[str, Any]
    annotations: dict[str, Any] | None = None

    def shown(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description or None,
            "input_schema": self.input_schema,
            "annotations": self.annotations,
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
    return McpServer(label, url, headers, allowed, approval, never, always, description, where)


def _headers(tool: Mapping[str, Any], where: str) -> tuple[tuple[str, str], ...]:
    raw = tool.get("headers") or {}
    if not isinstance(raw, Mapping) or len(raw) > MAX_HEADERS:
        raise invalid(f"{where}.headers", f"Invalid type: an object of at most {MAX_HEADERS}.")
    headers = []
    for name, value in raw.items():
        if not (isinstance(value, str) and name.isascii() and name and name.strip() == name):
            raise invalid(f"{where}.headers", "Invalid header: names and values are strings.")
        if name.lower() in CONNECTION_HEADERS:
            raise invalid(f"{where}.headers", f"The header {name!r} is the connection's own.")
        headers.append((name, value))
    authorization = tool.get("authorization")
    if authorization is not None:
        if not isinstance(authorization, str) or not authorization:
            raise invalid(f"{where}.authorization", "Invalid type: expected a string.")
        headers.append(("Authorization", f"Bearer {authorization}"))
    if sum(len(n) + len(v) for n, v in headers) > MAX_HEADER_CHARS:
        raise invalid(f"{where}.headers", "Invalid: the headers hold at most 8 KiB.")
    for _, value in headers:
        if "\r" in value or "\n" in value:
            raise invalid(f"{where}.headers", "Invalid header value: no line breaks.")
    return tuple(headers)


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


def check_allowed(servers: Sequence[McpServer], prefixes: Sequence[str]) -> None:
    """Each server's URL under one of the operator's `mcp_allowed_urls`, else a 400
    naming it (none configured: `mcp` tools are not served)."""
    for server in servers:
        if not any(server.url.startswith(prefix) for prefix in prefixes):
            served = (
                "its operator allows none (`mcp_allowed_urls`)"
                if not prefixes
                else "it is not one this gateway's operator allows (`mcp_allowed_urls`)"
            )
            raise invalid(
                f"{server.where}.server_url",
                f"This gateway does not call the MCP server {server.url[:200]!r}: {served}.",
            )


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


class McpFailure(Exception):
    """A step with a server failed: its message is shown in the item's `error`."""


def _client(server: McpServer, timeout: float) -> tuple[httpx2.AsyncClient, Client]:
    http = httpx2.AsyncClient(headers=dict(server.headers), timeout=httpx2.Timeout(timeout))
    return http, Client(streamable_http_client(server.url, http_client=http))


async def list_tools(server: McpServer, timeout: float) -> list[McpTool]:  # noqa: ASYNC109
    """The tools `server` lists (those `allowed_tools` names, when it names some), within
    `timeout` seconds; `McpFailure` when it cannot be reached or answers wrong."""
    http, client = _client(server, timeout)
    tools: list[McpTool] = []
    try:
        async with asyncio.timeout(timeout), http, client:
            cursor: str | None = None
            for _ in range(MAX_PAGES):
                page = await client.list_tools(cursor=cursor)
                for tool in page.tools:
                    if server.allowed is None or tool.name in server.allowed:
                        tools.append(_listed(tool))
                    if len(tools) > MAX_TOOLS:
                        raise McpFailure(f"the server lists more than {MAX_TOOLS} tools")
                cursor = page.next_cursor
                if cursor is None:
                    break
    except McpFailure:
        raise
    except TimeoutError:
        raise McpFailure(f"it did not list its tools within {timeout:g} s") from None
    except Exception as error:  # the SDK's and the transport's, any of them
        raise McpFailure(f"its tools could not be listed: {_said(error)}") from None
    return tools


def _listed(tool: Any) -> McpTool:
    """A tool as the SDK lists it, checked."""
    annotations = tool.annotations.model_dump(exclude_none=True) if tool.annotations else None
    return _tool(tool.name, tool.description, tool.input_schema, annotations)


def sent_tool(tool: Any) -> McpTool:
    """A tool of an `mcp_list_tools` item a client sent back, checked as a listed one."""
    if not isinstance(tool, Mapping):
        raise McpFailure("a tool is an object")
    fields = (tool.get(key) for key in ("name", "description", "input_schema", "annotations"))
    return _tool(*fields)


def _tool(name: Any, description: Any, schema: Any, annotations: Any) -> McpTool:
    """A tool, bounded: a name a model can call, a schema of 64 KiB at most, a description
    cut at 4 Ki characters."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        shown = repr(name[:80]) if isinstance(name, str) else "without a name"
        raise McpFailure(f"a tool {shown} no model can call (1-64 of a-z, A-Z, 0-9, _ and -)")
    if schema is None:
        schema = {"type": "object"}
    if not isinstance(schema, Mapping) or len(orjson.dumps(schema)) > MAX_SCHEMA_CHARS:
        raise McpFailure(
            f"the input schema of the tool {name!r} is not an object of 64 KiB at most"
        )
    if description is not None and not isinstance(description, str):
        raise McpFailure(f"the description of the tool {name!r} is not a string")
    if annotations is not None and not isinstance(annotations, Mapping):
        raise McpFailure(f"the annotations of the tool {name!r} are not an object")
    return McpTool(
        name,
        (description or "")[:MAX_DESCRIPTION_CHARS],
        dict(schema),
        dict(annotations) if annotations is not None else None,
    )


def _new_id() -> str:
    """An approval's id where the client gave none (OpenAI's style)."""
    return f"mcpa_{secrets.token_hex(24)}"


async def call_tool(
    server: McpServer,
    name: str,
    arguments: str,
    timeout: float,  # noqa: ASYNC109
) -> tuple[str | None, str | None]:
    """Calls the tool `name` with `arguments` (JSON text) within `timeout` seconds: its
    output (its text contents, joined; its structured content as JSON where it has no
    text) and None, or None and what went wrong (the tool's error, or the step's)."""
    try:
        parsed = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return None, "The model's arguments are not JSON."
    if not isinstance(parsed, dict):
        return None, "The model's arguments are not a JSON object."
    http, client = _client(server, timeout)
    try:
        async with asyncio.timeout(timeout), http, client:
            result = await client.call_tool(name, parsed)
    except TimeoutError:
        return None, f"The tool did not answer within {timeout:g} s."
    except Exception as error:  # the SDK's and the transport's, any of them
        return None, f"The tool could not be called: {_said(error)}"
    texts = [block.text for block in result.content if isinstance(block, TextContent)]
    output = "".join(texts)
    if not texts and result.structured_content is not None:
        output = orjson.dumps(result.structured_content).decode()
    output = output[:MAX_OUTPUT_CHARS]
    if result.is_error:
        return None, output or "The tool failed."
    return output, None


def _said(error: BaseException) -> str:
    """What an error says, one line, bounded (a group's first)."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    text = str(error) or type(error).__name__
    return text.splitlines()[0][:500] if text else type(error).__name__
