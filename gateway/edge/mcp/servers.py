"""Remote MCP servers, as the APIs that let a model call them ask the gateway to (the
Responses API's `mcp` tools: gateway/edge/responses/mcp.py; Anthropic's MCP connector:
gateway/edge/anthropic/mcp.py): a server and what may be done with it, its tools listed
and called, bounded. An answer's turns around the calls are turns.py's.

A client names the server's URL, and the gateway calls it: only URLs under the
operator's `mcp_allowed_urls` prefixes are taken (`check_allowed`, else a 400 naming
it), so a client cannot point the gateway at what it can reach and they cannot. The
headers a request gives go to that server only. Each step with a server (its tools
listed, one call) is bounded by `mcp_timeout` and the request's deadline; what a server
lists is bounded (`MAX_TOOLS` tools, a tool's schema and description, the schemas
together) and a call's output is cut at `MAX_OUTPUT_CHARS`.

The MCP SDK (the `mcp` package, Streamable HTTP) speaks the protocol: its handshake,
versions and pagination are its own, a session per step. It is imported when a server is
first called: a gateway whose clients name none never loads it (nor the OpenTelemetry
API it imports).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import orjson

from gateway.edge.errors import invalid
from gateway.edge.openai.validation import _NAME, MAX_TOOLS

if TYPE_CHECKING:
    import httpx2
    from mcp import Client

#: A call's output kept at most (characters): cut beyond, as the model reads it whole.
MAX_OUTPUT_CHARS = 64 * 1024
#: A listed tool's description and its input schema (JSON) at most, in characters.
MAX_DESCRIPTION_CHARS = 4096
MAX_SCHEMA_CHARS = 64 * 1024
#: A server's listing's schemas at most, all together (an answer stores its listing).
MAX_LISTING_CHARS = 1024 * 1024
#: Pages of a server's tool listing read at most.
MAX_PAGES = 16
#: Headers of the connection, not a client's to set (`Host` would name another server).
CONNECTION_HEADERS = frozenset(
    {"host", "content-length", "transfer-encoding", "connection", "upgrade", "te", "trailer"}
)
#: Records one step with a server: its allowed prefix, the step (`list`, `call`), whether
#: it went well, its seconds (the telemetry's `mcp_step`).
StepRecorder = Callable[[str, str, bool, float], None]
#: Headers a request may send a server, and their size.
MAX_HEADERS = 32
MAX_HEADER_CHARS = 8192


@dataclass(frozen=True)
class McpServer:
    """A remote MCP server a request names, and what may be done with it."""

    label: str
    url: str
    #: Where the request names its URL (`tools[2].server_url`), for a 400.
    where: str
    #: Sent to the server only (never shown): `headers`, and `authorization` as a bearer.
    headers: tuple[tuple[str, str], ...] = ()
    #: `allowed_tools`' names (None: every tool the server lists).
    allowed: frozenset[str] | None = None
    #: `require_approval`: "always" (OpenAI's default), "never" (Anthropic's every call),
    #: or "by_name": the names that need none (`never`) or need it (`always`).
    approval: str = "always"
    never: frozenset[str] = frozenset()
    always: frozenset[str] = frozenset()
    description: str = ""
    #: Tools turned off by name (Anthropic's toolset `configs`).
    denied: frozenset[str] = frozenset()
    #: The operator's allowed URL prefix its URL is under (`check_allowed`): its metrics'.
    prefix: str = ""

    def offers(self, name: str) -> bool:
        """Whether the model may call the server's tool `name`."""
        return (self.allowed is None or name in self.allowed) and name not in self.denied

    def needs_approval(self, name: str) -> bool:
        """Whether a call of the tool `name` waits for the client's approval: by
        `require_approval` (a tool named under neither list needs it, as OpenAI's default)."""
        if self.approval == "never":
            return False
        if self.approval == "always":
            return True
        return name not in self.never or name in self.always


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


def checked_headers(pairs: Sequence[tuple[Any, Any]], where: str) -> tuple[tuple[str, str], ...]:
    """Headers a request gives a server (`where` names them in a 400): strings, none of
    the connection's own, no line breaks, 8 KiB in all."""
    if len(pairs) > MAX_HEADERS:
        raise invalid(where, f"Invalid: at most {MAX_HEADERS} headers.")
    for name, value in pairs:
        if not (isinstance(name, str) and isinstance(value, str)):
            raise invalid(where, "Invalid header: names and values are strings.")
        if not (name.isascii() and name and name.strip() == name):
            raise invalid(where, f"Invalid header name {name[:64]!r}.")
        if name.lower() in CONNECTION_HEADERS:
            raise invalid(where, f"The header {name!r} is the connection's own.")
        if "\r" in value or "\n" in value:
            raise invalid(where, "Invalid header value: no line breaks.")
    if sum(len(n) + len(v) for n, v in pairs) > MAX_HEADER_CHARS:
        raise invalid(where, "Invalid: the headers hold at most 8 KiB.")
    return tuple(pairs)


def check_allowed(servers: Sequence[McpServer], prefixes: Sequence[str]) -> list[McpServer]:
    """Each server's URL under one of the operator's `mcp_allowed_urls`, else a 400
    naming it (none configured: no server is called); the servers with their prefix."""
    checked = []
    for server in servers:
        prefix = next((p for p in prefixes if server.url.startswith(p)), None)
        if prefix is None:
            served = (
                "its operator allows none (`mcp_allowed_urls`)"
                if not prefixes
                else "it is not one this gateway's operator allows (`mcp_allowed_urls`)"
            )
            raise invalid(
                server.where,
                f"This gateway does not call the MCP server {server.url[:200]!r}: {served}.",
            )
        checked.append(replace(server, prefix=prefix))
    return checked


# -- the servers ------------------------------------------------------------------


class McpFailure(Exception):
    """A step with a server failed: its message is shown in the item's `error`."""


def _client(server: McpServer, timeout: float) -> tuple[httpx2.AsyncClient, Client]:
    """A session's client and its HTTP client (the SDK imported here, on first use)."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    http = httpx2.AsyncClient(headers=dict(server.headers), timeout=httpx2.Timeout(timeout))
    return http, Client(streamable_http_client(server.url, http_client=http))


async def list_tools(server: McpServer, timeout: float) -> list[McpTool]:  # noqa: ASYNC109
    """The tools `server` lists that it offers the model (`McpServer.offers`), within
    `timeout` seconds; `McpFailure` when it cannot be reached or answers wrong."""
    http, client = _client(server, timeout)
    tools: list[McpTool] = []
    size = 0  # the schemas' JSON, as the answer stores them
    try:
        async with asyncio.timeout(timeout), http, client:
            cursor: str | None = None
            for _ in range(MAX_PAGES):
                page = await client.list_tools(cursor=cursor)
                for tool in page.tools:
                    if server.offers(tool.name):
                        tools.append(_listed(tool))
                        size += len(orjson.dumps(tools[-1].input_schema))
                    if len(tools) > MAX_TOOLS:
                        raise McpFailure(f"the server lists more than {MAX_TOOLS} tools")
                    if size > MAX_LISTING_CHARS:
                        raise McpFailure("the schemas of the server's tools hold over 1 MiB")
                cursor = page.next_cursor
                if cursor is None:
                    break
    except McpFailure:
        raise
    except Exception as error:  # the SDK's and the transport's, any of them
        if _timed_out(error):
            raise McpFailure(f"it did not list its tools within {timeout:g} s") from None
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
    except Exception as error:  # the SDK's and the transport's, any of them
        if _timed_out(error):
            return None, f"The tool did not answer within {timeout:g} s."
        return None, f"The tool could not be called: {_said(error)}"
    texts = [str(getattr(block, "text", "")) for block in result.content if block.type == "text"]
    output = "".join(texts)
    if not texts and result.structured_content is not None:
        output = orjson.dumps(result.structured_content).decode()
    output = output[:MAX_OUTPUT_CHARS]
    if result.is_error:
        return None, output or "The tool failed."
    return output, None


def _timed_out(error: BaseException) -> bool:
    """Whether the step ran out of its time: our bound's `TimeoutError`, or the HTTP
    client's own timeout (the same bound), which the SDK's transport task may raise first
    (a group's first)."""
    import httpx2

    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    return isinstance(error, TimeoutError | httpx2.TimeoutException)


def _said(error: BaseException) -> str:
    """What an error says, one line, bounded (a group's first)."""
    while isinstance(error, BaseExceptionGroup) and error.exceptions:
        error = error.exceptions[0]
    text = str(error) or type(error).__name__
    return text.splitlines()[0][:500] if text else type(error).__name__
