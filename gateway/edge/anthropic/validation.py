"""Turns an Anthropic Messages body into our `GenerateRequest`, or a 400 naming
the field at fault, with Anthropic's rules.

Anthropic's API refuses a field it does not know ("Extra inputs are not
permitted"), so this does too: every top-level field is either served (parsed
here) or refused by name, and so is every content block type but `text`,
`image`, `document` (a text or content source), `tool_use`, `tool_result`, `thinking`
and the MCP connector's (`mcp_tool_use`,
`mcp_tool_result`, `mcp_tool_listing`: mcp.py), and every tool but a custom one and an
MCP server's `mcp_toolset` (with `mcp_servers`: mcp.py).
Served: `system` (a string or text blocks), `messages`, `max_tokens` (required),
`stop_sequences`, `temperature`, `top_p`, `top_k`, `metadata.user_id`, `tools`,
`tool_choice` (`auto`, `any`, `tool`, `none`, with `disable_parallel_tool_use`),
`stream`, `thinking` (as vLLM's own Messages server reads it: `enabled` with
`budget_tokens`, vLLM's `thinking_token_budget`; `adaptive`; `disabled`, vLLM's effort
"none" where the workers take one, leaves a reasoning model's thinking out of the
answer; `display: "omitted"` leaves its text out of each thinking block, as Anthropic's
API does), `output_config` (`format`, a JSON schema the answer
follows: chat's `response_format`; `effort`, vLLM's `reasoning_effort`, as vLLM's own
Messages server reads both), `service_tier` `auto` or `standard_only` (what asks
nothing), and `context_management` (Anthropic's context editing, which Claude Code
sends with thinking on: `clear_thinking_20251015` leaves the thinking of earlier turns
out of the prompt, `clear_tool_uses_20250919` old tool results, applied by the route
where it counts the prompt: `context_editing.py`; `compact_20260112`, the conversation
summarized by the model once it is long, and the `compaction` parameter, a summary
asked for: `compaction.py`). A
tool's `strict` is chat's strict function; `defer_loading` leaves it out of the model's
tools (Claude Code loads such tools itself, by its own tool search); its options that ask
nothing of us are accepted (`eager_input_streaming`, `allowed_callers` `["direct"]`). A
`system` message within `messages` (Claude Code's reminders) is a system message where it
comes, as vLLM's Messages server takes it, and its `tool_addition`/`tool_removal` blocks
change the tools in effect (`_tools_in_effect`); Claude Code's billing header (a system block
whose hash changes with every version) is left out of the prompt, as vLLM leaves it
out. `cache_control` (on the body, a block or a tool) is accepted: it is a hint about
prompt caching, which the engines do by themselves for every prefix. The SDK's newest
version no longer names `temperature`, `top_p` and `top_k`; older clients (and
`extra_body`) send them, so they are served.

As Anthropic's API does, a message with empty content (but a final assistant one)
and an empty text block are refused. A final assistant message is a prefill the answer
continues (`_prefill`: vLLM's `continue_final_message`).

A conversation maps onto chat messages: a `tool_use` block is an assistant
message's tool call, a `tool_result` block a `tool` message of its own (its text;
`is_error` marks that text as an error), a `thinking` block the assistant message's
reasoning (`redacted_thinking`, Anthropic's encrypted thinking, is refused), a
`compaction` block the summary that stands for every block before it, images go
in as URLs or data URIs, a `document` as a paragraph of the message's text (its title
and context first; a PDF source and citations are refused by name). The
value checks and bounds are the OpenAI routes' (`gateway.edge.openai.validation`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, ClassVar

import orjson

from gateway.edge.anthropic import tool_examples
from gateway.edge.anthropic.compaction import (
    COMPACT,
    Compaction,
    going_on,
    parse_edit,
    parse_parameter,
)
from gateway.edge.anthropic.context_editing import (
    CLEAR_THINKING,
    CLEAR_TOOL_USES,
    KEEP_TOOL_USES,
    Applied,
    ContextEdits,
    ToolClearing,
)
from gateway.edge.anthropic.mcp import LISTING as MCP_LISTING
from gateway.edge.anthropic.mcp import RESULT as MCP_RESULT
from gateway.edge.anthropic.mcp import (
    TOOLSET,
    Connector,
    connector,
    listing_block,
    result_block,
    use_block,
)
from gateway.edge.anthropic.mcp import USE as MCP_USE
from gateway.edge.compacting import GoesOn, summary_message
from gateway.edge.errors import APIError, invalid
from gateway.edge.mcp.servers import McpTool
from gateway.edge.mcp.turns import McpPlan
from gateway.edge.openai.schema_limits import SchemaBudget
from gateway.edge.openai.validation import (
    _NAME,
    MAX_IMAGES,
    MAX_STOP,
    MAX_STOP_CHARS,
    MAX_TOOLS,
    MAX_USER_CHARS,
    UINT32_MAX,
    ParsedRequest,
    _flag,
    _int,
    _is_int,
    _number,
    _string,
    model_of,
)
from gateway.protocol.types import (
    GenerateRequest,
    Message,
    ReasoningParams,
    ResponseFormat,
    SamplingParams,
    Tool,
    ToolCall,
)

#: Fields of a Messages body this gateway serves.
MESSAGE_FIELDS = frozenset(
    {
        "model",
        "messages",
        "system",
        "max_tokens",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "metadata",
        "tools",
        "tool_choice",
        "stream",
        "cache_control",
        "thinking",
        "output_config",
        "output_format",
        "service_tier",
        "context_management",
        "compaction",
        "mcp_servers",
    }
)
#: ... and of a count_tokens body (what shapes the prompt; `compaction` is taken and asks
#: nothing there, as Anthropic's count_tokens takes it: the count is of the prompt sent).
COUNT_FIELDS = frozenset(
    {
        "model",
        "messages",
        "system",
        "tools",
        "tool_choice",
        "cache_control",
        "thinking",
        "output_config",
        "output_format",
        "context_management",
        "compaction",
        "mcp_servers",
    }
)
#: `service_tier` values that ask nothing of a self-hosted model.
SERVICE_TIERS = frozenset({"auto", "standard_only"})
#: Image types Anthropic takes inline.
MEDIA_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})
#: Keys of a block besides its own that ask nothing of us.
_HINTS = frozenset({"type", "cache_control"})


def _refuse_unknown(body: Mapping[str, Any], known: frozenset[str], where: str = "") -> None:
    """A 400 naming the first field not in `known` (Anthropic refuses extra inputs); a
    field set to null asks nothing (SDKs write out their unset optional fields so)."""
    extra = [name for name in body.keys() - known if body[name] is not None]
    if extra:
        name = min(extra)
        raise invalid(where + name, f"{where}{name}: Extra inputs are not permitted.")


def _text_of(block: Mapping[str, Any], where: str) -> str:
    _refuse_unknown(block, _HINTS | {"text", "citations"}, where + ".")
    if block.get("citations") not in (None, []):
        raise invalid(f"{where}.citations", "Citations are not supported by this gateway.")
    text = block.get("text")
    if not isinstance(text, str):
        raise invalid(f"{where}.text", "Field required: a string.")
    return text


#: How Claude Code's first system block begins: its version and a hash for Anthropic's
#: billing, which changes with each version (and build) and would change the prompt's
#: first tokens, so no engine's prefix cache could keep a conversation. It is left out of
#: the prompt, as vLLM's own Messages server leaves it out.
BILLING_HEADER = "x-anthropic-billing-header"


#: A tool change a system message made (its block's path, `tool_addition` or
#: `tool_removal`, and its `tool`: a reference or a definition).
ToolChange = tuple[str, str, Mapping[str, Any]]
_TOOL_CHANGES = ("tool_addition", "tool_removal")


def _system_text(system: Any, where: str, changes: list[ToolChange] | None = None) -> str:
    """A system prompt's text: a string, or text blocks joined by newlines (Claude Code's
    billing header left out); a system message's (`changes` given) may also change the
    tools in effect, with `tool_addition` and `tool_removal` blocks, gathered there."""
    if isinstance(system, str):
        return "" if system.startswith(BILLING_HEADER) else system
    if not isinstance(system, list):
        raise invalid(where, f"Invalid type for '{where}': a string or a list of text blocks.")
    texts = []
    for i, block in enumerate(system):
        at = f"{where}[{i}]"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if changes is not None and kind in _TOOL_CHANGES and isinstance(block, Mapping):
            _refuse_unknown(block, _HINTS | {"tool"}, at + ".")
            tool = block.get("tool")
            if not isinstance(tool, Mapping):
                raise invalid(f"{at}.tool", f"{at}.tool: expected an object.")
            changes.append((at, str(kind), tool))
            continue
        if kind != "text":
            raise invalid(f"{at}.type", "A system block must be of type 'text'.")
        text = _text_of(block, at)
        if not text.startswith(BILLING_HEADER):
            texts.append(text)
    return "\n".join(texts)


def _image(block: Mapping[str, Any], where: str) -> str:
    """An image block as a URL or a data URI."""
    _refuse_unknown(block, _HINTS | {"source"}, where + ".")
    source = block.get("source")
    kind = source.get("type") if isinstance(source, Mapping) else None
    if kind == "url":
        url = source.get("url") if isinstance(source, Mapping) else None
        if not isinstance(url, str) or not url.lower().startswith(("https://", "http://")):
            raise invalid(f"{where}.source.url", "Invalid 'url': an http(s) URL.")
        return url
    if kind != "base64" or not isinstance(source, Mapping):
        raise invalid(f"{where}.source.type", "An image source is of type 'base64' or 'url'.")
    media_type = source.get("media_type")
    if not isinstance(media_type, str) or media_type not in MEDIA_TYPES:
        raise invalid(
            f"{where}.source.media_type",
            f"Invalid 'media_type': one of {', '.join(sorted(MEDIA_TYPES))}.",
        )
    data = source.get("data")
    if not isinstance(data, str) or not data:
        raise invalid(f"{where}.source.data", "Field required: the image's base64 data.")
    return f"data:{media_type};base64,{data}"


def _document(block: Mapping[str, Any], where: str) -> tuple[str, tuple[str, ...]]:
    """A document block's text (its `title` and `context` first, where given, each in a
    paragraph of its own) and images: a `text` source's plain text, or a `content`
    source's text and image blocks. A PDF (a `base64`, `url` or `file` source) is refused
    by name, and so are citations: the engines answer with no citation blocks."""
    _refuse_unknown(block, _HINTS | {"source", "title", "context", "citations"}, where + ".")
    citations = block.get("citations")
    if citations is not None and (
        not isinstance(citations, Mapping) or citations.get("enabled") not in (None, False)
    ):
        raise invalid(f"{where}.citations", "Citations are not supported by this gateway.")
    heads = []
    for name in ("title", "context"):
        value = block.get(name)
        if value is not None and not isinstance(value, str):
            raise invalid(f"{where}.{name}", f"Invalid type for '{name}': a string.")
        if value:
            heads.append(value)
    source = block.get("source")
    kind = source.get("type") if isinstance(source, Mapping) else None
    if not isinstance(source, Mapping):
        raise invalid(f"{where}.source", "Field required: the document's source, an object.")
    at = f"{where}.source"
    images: tuple[str, ...] = ()
    if kind == "text":
        _refuse_unknown(source, frozenset({"type", "media_type", "data"}), at + ".")
        if source.get("media_type") != "text/plain":
            raise invalid(f"{at}.media_type", "A text source's 'media_type' is 'text/plain'.")
        data = source.get("data")
        if not isinstance(data, str) or not data.strip():
            raise invalid(f"{at}.data", "Field required: the document's text, not empty.")
        text = data
    elif kind == "content":
        _refuse_unknown(source, frozenset({"type", "content"}), at + ".")
        content = source.get("content")
        if content in (None, "", []):
            raise invalid(f"{at}.content", "Field required: a string or a list of blocks.")
        text, images = _content(content, f"{at}.content")
    else:
        raise invalid(
            f"{at}.type",
            "A document's source is of type 'text' or 'content' here: PDFs (a 'base64', 'url' "
            "or 'file' source) are not supported by this gateway.",
        )
    return "\n\n".join([*heads, text]), images


def _tool_use(block: Mapping[str, Any], where: str) -> ToolCall:
    _refuse_unknown(block, _HINTS | {"id", "name", "input"}, where + ".")
    call_id = _string(block, "id", where + ".")
    name = _string(block, "name", where + ".")
    if not call_id or not name:
        raise invalid(f"{where}.{'name' if call_id else 'id'}", "Field required: a string.")
    arguments = block.get("input")
    if not isinstance(arguments, Mapping):
        raise invalid(f"{where}.input", "Invalid type for 'input': expected an object.")
    return ToolCall(call_id, name, orjson.dumps(arguments).decode())


def _references(content: Any, where: str, changes: list[ToolChange]) -> Any:
    """A tool result's content without its `tool_reference` blocks, which a tool search
    returns (Claude Code's `ToolSearch`): each loads the deferred tool it names, as a
    system message's `tool_addition` does (gathered in `changes`), and adds no text, as
    vLLM's Messages server passes them on."""
    if not isinstance(content, list):
        return content
    kept = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") != "tool_reference":
            kept.append(part)
            continue
        at = f"{where}[{j}]"
        _refuse_unknown(part, _HINTS | {"tool_name", "name"}, at + ".")
        name = part.get("tool_name", part.get("name"))
        if not isinstance(name, str):
            raise invalid(f"{at}.tool_name", f"{at}.tool_name: the name of a tool.")
        changes.append((at, "tool_addition", {"type": "tool_reference", "name": name}))
    return kept


def _tool_result(
    block: Mapping[str, Any], where: str, changes: list[ToolChange]
) -> tuple[Message, int]:
    """A tool message, and how many images it holds."""
    _refuse_unknown(block, _HINTS | {"tool_use_id", "content", "is_error"}, where + ".")
    call_id = _string(block, "tool_use_id", where + ".")
    if not call_id:
        raise invalid(f"{where}.tool_use_id", "Field required: a string.")
    content = _references(block.get("content"), f"{where}.content", changes)
    text, images = ("", ()) if content is None else _content(content, f"{where}.content")
    if _flag(block, "is_error", where + "."):
        text = f"Error: {text}"
    return Message("tool", text, images, tool_call_id=call_id), len(images)


def _content(content: Any, where: str) -> tuple[str, tuple[str, ...]]:
    """The text and images of a tool result's content (text and image blocks only)."""
    message = _blocks(content, where, "tool", nested=True)[0][0]
    return message.content, message.images


def _blocks(
    content: Any,
    where: str,
    role: str,
    *,
    nested: bool = False,
    changes: list[ToolChange] | None = None,
    listed: dict[str, tuple[McpTool, ...]] | None = None,
    summaries: list[Message] | None = None,
) -> tuple[list[Message], int]:
    """A turn's content as chat messages (tool results each a message of their own,
    in order, an MCP server's too), and how many images it holds; the MCP listings it
    holds go to `listed`. A compaction block with a summary is the user message of its
    summary (added to `summaries`), in place of the blocks before it."""
    if isinstance(content, str):
        return [Message(role, content)], 0
    if not isinstance(content, list):
        raise invalid(where, f"Invalid type for '{where}': a string or a list of blocks.")
    out: list[Message] = []
    texts: list[str] = []
    images: list[str] = []
    calls: list[ToolCall] = []
    thoughts: list[str] = []
    count = 0
    after_document = False  # a text after a document begins a paragraph

    def flush() -> None:
        if texts or images or calls or thoughts:
            reasoning = "".join(thoughts)
            out.append(
                Message(role, "".join(texts), tuple(images), tuple(calls), reasoning=reasoning)
            )
            texts.clear()
            images.clear()
            calls.clear()
            thoughts.clear()

    for j, block in enumerate(content):
        at = f"{where}[{j}]"
        kind = block.get("type") if isinstance(block, Mapping) else None
        if not isinstance(block, Mapping):
            raise invalid(at, "Invalid type: expected a content block (an object).")
        if kind == "text":
            text = _text_of(block, at)
            if not text:  # as Anthropic's API refuses it
                raise invalid(at, f"{at}: text content blocks must be non-empty")
            if text.isspace():
                raise invalid(at, f"{at}: text content blocks must contain non-whitespace text")
            texts.append("\n\n" + text if after_document and texts else text)
            after_document = False
        elif kind == "image":
            images.append(_image(block, at))
            count += 1
        elif kind == "document" and role != "assistant":  # a paragraph of its own
            text, inside = _document(block, at)
            texts.append("\n\n" + text if texts else text)
            images += inside
            count += len(inside)
            after_document = True
        elif kind == "tool_use" and role == "assistant" and not nested:
            calls.append(_tool_use(block, at))
        elif kind == MCP_USE and role == "assistant" and not nested:
            calls.append(use_block(block, at))
        elif kind == MCP_RESULT and role == "assistant" and not nested:
            flush()  # the server's answer, read by the model before it went on
            out.append(result_block(block, at))
        elif kind == MCP_LISTING and role == "assistant" and not nested:
            name, tools = listing_block(block, at)
            if listed is not None:
                listed[name] = tools
        elif kind == "thinking" and role == "assistant" and not nested:
            _refuse_unknown(block, _HINTS | {"thinking", "signature"}, at + ".")
            thoughts.append(_string(block, "thinking", at + ".") or "")
        elif kind == "redacted_thinking" and role == "assistant" and not nested:
            raise invalid(
                f"{at}.type", "Redacted thinking (Anthropic's) is not supported by this gateway."
            )
        elif kind == "compaction" and not nested:
            summary = _compaction_block(block, at)
            if summary is not None:  # null: a failed compaction, which changes nothing
                flush()
                out.clear()
                count = 0
                out.append(summary_message(summary))
                if summaries is not None:
                    summaries.append(out[-1])
        elif kind == "tool_result" and role == "user" and not nested:
            flush()
            message, pictures = _tool_result(block, at, [] if changes is None else changes)
            out.append(message)
            count += pictures
        else:
            if role == "assistant":
                allowed = "'text', 'image', 'tool_use', 'thinking', 'compaction' and the MCP "
                allowed += "connector's"
            elif nested:
                allowed = "'text', 'image', 'document'"
            else:
                allowed = "'text', 'image', 'document', 'tool_result' and 'compaction'"
            raise invalid(
                f"{at}.type", f"Block type {str(kind)[:64]!r} is not supported here: {allowed}."
            )
    flush()
    if not out:
        out.append(Message(role, ""))
    return out, count


def _compaction_block(block: Mapping[str, Any], where: str) -> str | None:
    """A compaction block's summary (None: a failed compaction's block). Its opaque
    fields (`encrypted_content`, `signature`: Anthropic's, sent back as they came) ask
    nothing of a summary this gateway reads as text; `tool_changes` would, and are refused."""
    _refuse_unknown(
        block,
        _HINTS | {"content", "encrypted_content", "signature", "tool_changes"},
        where + ".",
    )
    if block.get("tool_changes") not in (None, []):
        raise invalid(
            f"{where}.tool_changes",
            f"{where}.tool_changes: a compaction block's tool changes are not supported by "
            "this gateway.",
        )
    for name in ("encrypted_content", "signature"):
        if block.get(name) is not None and not isinstance(block[name], str):
            raise invalid(f"{where}.{name}", f"{where}.{name}: a string or null.")
    content = block.get("content")
    if content is not None and (not isinstance(content, str) or not content.strip()):
        raise invalid(
            f"{where}.content", f"{where}.content: a non-empty string (the summary), or null."
        )
    return content


def _messages(
    body: Mapping[str, Any], listed: dict[str, tuple[McpTool, ...]] | None = None
) -> tuple[tuple[Message, ...], list[ToolChange]]:
    """The conversation as chat messages, and the tool changes its system messages made
    (the MCP servers' listings it holds go to `listed`). A compaction block with a
    summary stands for the conversation before it: the messages before its own are left
    out (the system prompt stays), as Anthropic's API leaves them out."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "Field required: 'messages', a non-empty list.")
    system = body.get("system")
    system = None if system is None else _system_text(system, "system")
    out = [Message("system", system)] if system else []
    head = len(out)
    summaries: list[Message] = []
    images = 0
    calls: list[str] = []  # the ids of the previous message's tool_use blocks
    changes: list[ToolChange] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise invalid(where, "Invalid type: expected an object.")
        _refuse_unknown(message, frozenset({"role", "content"}), where + ".")
        role = message.get("role")
        content = message.get("content")
        if role == "system":
            # a system message within the conversation (Claude Code's reminders), where
            # it came; it stands outside the turns, so tool results pair across it
            text = _system_text(content, f"{where}.content", changes)
            if text:
                out.append(Message("system", text))
            continue
        if role not in ("user", "assistant"):
            raise invalid(f"{where}.role", "Invalid value: 'user', 'assistant' or 'system'.")
        if content in ("", []) and not (role == "assistant" and i == len(messages) - 1):
            # as Anthropic's API refuses it (a final assistant message is a prefill)
            raise invalid(
                f"{where}.content",
                f"{where}.content: all messages must have non-empty content except for the "
                "optional final assistant message",
            )
        compacted = len(summaries)
        parsed, count = _blocks(
            content,
            f"{where}.content",
            role,
            changes=changes,
            listed=listed,
            summaries=summaries,
        )
        if len(summaries) > compacted:  # what came before is in the summary
            del out[head:]
            images = 0
        images += count
        if images > MAX_IMAGES:
            raise invalid(f"{where}.content", f"At most {MAX_IMAGES} images in a request.")
        _pair(calls, parsed, f"{where}.content")
        # the calls the next turn answers: an MCP server's answered within this one
        answered = {m.tool_call_id for m in parsed if m.role == "tool"}
        calls = [c.id for m in parsed for c in m.tool_calls if c.id not in answered]
        out += parsed
    return tuple(out), changes


def _pair(calls: list[str], parsed: list[Message], where: str) -> None:
    """A 400, as Anthropic's API answers, unless the message after one with `tool_use`
    blocks (`calls`, their ids) holds a `tool_result` for each, and only for those."""
    # an MCP server's answer in an assistant turn answers that turn's own call
    own = {c.id for m in parsed for c in m.tool_calls}
    results = [m.tool_call_id for m in parsed if m.role == "tool" and m.tool_call_id not in own]
    unexpected = [r for r in results if r not in calls]
    if unexpected:
        raise invalid(
            where,
            f"Unexpected `tool_use_id` found in `tool_result` blocks: {unexpected[0][:64]}. "
            "Each `tool_result` block must have a corresponding `tool_use` block in the "
            "previous message.",
        )
    missing = [c for c in calls if c not in results]
    if missing:
        raise invalid(
            where,
            f"`tool_use` ids were found without `tool_result` blocks immediately after: "
            f"{missing[0][:64]}. Each `tool_use` block must have a corresponding "
            "`tool_result` block in the next message.",
        )


#: A custom tool's fields: its definition, `strict` (its input follows the schema), and
#: the options checked by `_tool_options`.
_TOOL_FIELDS = _HINTS | {
    "name",
    "description",
    "input_schema",
    "strict",
    "eager_input_streaming",
    "defer_loading",
    "allowed_callers",
    "input_examples",
}


def _tool_options(tool: Mapping[str, Any], where: str) -> bool:
    """A tool's options: whether it is deferred (`defer_loading`: left out of the model's
    tools until the client loads it, as Claude Code's own tool search does); served where
    they ask nothing of us: `eager_input_streaming` (its input is streamed as the engine
    makes it, either way), `allowed_callers` the model alone; else a 400 naming the field
    (programmatic calls are Anthropic's own)."""
    _flag(tool, "eager_input_streaming", where + ".")
    callers = tool.get("allowed_callers")
    if callers is not None and callers != ["direct"]:
        raise invalid(
            f"{where}.allowed_callers",
            f"{where}.allowed_callers: only ['direct'] (the model calls the tool) is served.",
        )
    return _flag(tool, "defer_loading", where + ".")


def _tool(tool: Any, where: str, schemas: SchemaBudget) -> tuple[Tool, bool]:
    """One custom tool, and whether it is deferred; its schema counts in `schemas`."""
    if not isinstance(tool, Mapping):
        raise invalid(where, "Invalid type: expected an object.")
    if tool.get("type") not in (None, "custom"):
        raise invalid(
            f"{where}.type", "Only custom tools (name, description, input_schema) are served."
        )
    _refuse_unknown(tool, _TOOL_FIELDS, where + ".")
    deferred = _tool_options(tool, where)
    name = tool.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise invalid(f"{where}.name", "Invalid name: 1-64 of a-z, A-Z, 0-9, _ and -.")
    schema = tool.get("input_schema")
    if not isinstance(schema, Mapping):
        raise invalid(f"{where}.input_schema", "Field required: a JSON Schema (an object).")
    schemas.check(schema, f"{where}.input_schema")
    description = _string(tool, "description", where + ".") or ""
    description += tool_examples.render(tool, schema, where)
    strict = _flag(tool, "strict", where + ".")
    return Tool(name, description, orjson.dumps(schema).decode(), strict), deferred


def _tools(body: Mapping[str, Any], schemas: SchemaBudget) -> dict[str, tuple[Tool, bool]]:
    """The custom tools declared, by name, each with whether it is deferred (their schemas
    count in `schemas`: OpenAI's bounds, over the request's schemas together)."""
    tools = body.get("tools")
    if tools is None:
        return {}
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise invalid("tools", f"Invalid 'tools': a list of at most {MAX_TOOLS}.")
    declared = {}
    for k, tool in enumerate(tools):
        if isinstance(tool, Mapping) and tool.get("type") == TOOLSET:
            continue  # an MCP server's (mcp.py), read with `mcp_servers`
        parsed, deferred = _tool(tool, f"tools[{k}]", schemas)
        if parsed.name in declared:
            raise invalid("tools", "Invalid 'tools': tool names must be unique.")
        declared[parsed.name] = (parsed, deferred)
    return declared


def _tools_in_effect(
    declared: dict[str, tuple[Tool, bool]], changes: list[ToolChange], schemas: SchemaBudget
) -> tuple[Tool, ...]:
    """The tools the model is given: those declared and not deferred, after the system
    messages' changes in order, as vLLM's Messages server resolves them (a template sees
    one list: the tools in effect at the conversation's end): a `tool_addition` of a
    `tool_reference` loads a declared tool (a deferred one: Claude Code's tool search),
    one of a `tool_definition` declares it, a `tool_removal` takes one away."""
    tools = dict(declared)
    removed: set[str] = set()
    for at, kind, change in changes:
        if change.get("type") == "tool_definition" and kind == "tool_addition":
            _refuse_unknown(change, frozenset({"type", "definition"}), f"{at}.tool.")
            tool, deferred = _tool(change.get("definition"), f"{at}.tool.definition", schemas)
            name = tool.name
            tools[name] = (tool, deferred)
        elif change.get("type") == "tool_reference":
            _refuse_unknown(change, frozenset({"type", "name"}), f"{at}.tool.")
            name = str(change.get("name"))[:64]
            if name not in tools:
                raise invalid(
                    f"{at}.tool.name",
                    f"{kind} references tool '{name}', which is not declared in tools.",
                )
            if kind == "tool_addition":
                tools[name] = (tools[name][0], False)
        else:
            raise invalid(
                f"{at}.tool.type",
                f"{at}.tool.type: 'tool_reference'"
                + (" or 'tool_definition'." if kind == "tool_addition" else "."),
            )
        if kind == "tool_removal":
            removed.add(name)
        else:
            removed.discard(name)
    if len(tools) > MAX_TOOLS:
        raise invalid("tools", f"Invalid 'tools': at most {MAX_TOOLS}, those added included.")
    return tuple(t for name, (t, deferred) in tools.items() if not deferred and name not in removed)


def _tool_choice(body: Mapping[str, Any], tools: tuple[Tool, ...]) -> tuple[str, bool | None]:
    """Our tool_choice ("" when not given) and parallel_tool_calls (None: the default)."""
    choice = body.get("tool_choice")
    if choice is None:
        return "", None
    if not isinstance(choice, Mapping):
        raise invalid("tool_choice", "Invalid type for 'tool_choice': expected an object.")
    kind = choice.get("type")
    known = {"type", "disable_parallel_tool_use"} | ({"name"} if kind == "tool" else set())
    _refuse_unknown(choice, frozenset(known), "tool_choice.")
    disable = _flag(choice, "disable_parallel_tool_use", "tool_choice.")
    parallel = False if disable and tools else None
    if kind == "none":
        return ("none" if tools else ""), None
    if kind not in ("auto", "any", "tool"):
        raise invalid("tool_choice.type", "Invalid value: 'auto', 'any', 'tool' or 'none'.")
    if kind == "auto" and not tools and body.get("tools"):  # every tool deferred
        return "", None
    if not tools:
        raise invalid("tool_choice", "'tool_choice' needs 'tools'.")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    name = choice.get("name")
    if not isinstance(name, str) or name not in {tool.name for tool in tools}:
        raise invalid("tool_choice.name", "Invalid 'name': the name of one of 'tools'.")
    return name, parallel


def _stop_sequences(body: Mapping[str, Any]) -> tuple[str, ...]:
    value = body.get("stop_sequences")
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise invalid("stop_sequences", "Invalid type: expected a list of strings.")
    if len(value) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in value):
        raise invalid(
            "stop_sequences",
            f"Invalid value: at most {MAX_STOP} of at most {MAX_STOP_CHARS} characters each.",
        )
    return tuple(s for s in value if s)


def _user(body: Mapping[str, Any]) -> str:
    metadata = body.get("metadata")
    if metadata is None:
        return ""
    if not isinstance(metadata, Mapping):
        raise invalid("metadata", "Invalid type for 'metadata': expected an object.")
    _refuse_unknown(metadata, frozenset({"user_id"}), "metadata.")
    user = _string(metadata, "user_id", "metadata.") or ""
    if len(user) > MAX_USER_CHARS:
        raise invalid("metadata.user_id", f"Invalid value: at most {MAX_USER_CHARS} characters.")
    return user


#: `thinking`'s types, and the fields each takes besides its type.
_THINKING = {
    "enabled": frozenset({"type", "budget_tokens", "display"}),
    "adaptive": frozenset({"type", "display"}),
    "disabled": frozenset({"type"}),
}
#: `thinking.display` values: shown (Anthropic's "summarized": here the whole of it), or
#: left out.
_DISPLAYS = ("summarized", "omitted")


def _thinking(body: Mapping[str, Any]) -> tuple[int | None, bool, bool]:
    """`thinking`, as vLLM's own Messages server reads it: the budget of `enabled`
    (vLLM's `thinking_token_budget`), whether thinking is shown (not when `disabled`),
    and whether it is turned off (`disabled`). Its `display: "omitted"`: `_omitted`."""
    thinking = body.get("thinking")
    if thinking is None:
        return None, True, False
    kind = thinking.get("type") if isinstance(thinking, Mapping) else None
    if not isinstance(kind, str) or kind not in _THINKING:  # a list or object: unhashable
        raise invalid("thinking.type", "thinking.type: 'enabled', 'adaptive' or 'disabled'.")
    _refuse_unknown(thinking, _THINKING[kind], "thinking.")
    display = _string(thinking, "display", "thinking.")
    if display is not None and display not in _DISPLAYS:
        raise invalid("thinking.display", "thinking.display: 'summarized' or 'omitted'.")
    budget = None
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not _is_int(budget) or not 1024 <= budget <= UINT32_MAX:
            raise invalid(
                "thinking.budget_tokens",
                "thinking.budget_tokens: an integer of at least 1024 is required.",
            )
    return budget, kind != "disabled", kind == "disabled"


def _omitted(body: Mapping[str, Any]) -> bool:
    """Whether `thinking.display` is "omitted": as Anthropic's API answers it, each
    thinking block is there with its `signature` and an empty `thinking` (the client
    sends it back for the conversation to go on), its tokens still counted."""
    thinking = body.get("thinking")
    return isinstance(thinking, Mapping) and thinking.get("display") == "omitted"


#: `output_config.effort` values: Anthropic's, each one of vLLM's reasoning efforts.
EFFORTS = ("low", "medium", "high", "xhigh", "max")
_OUTPUT_CONFIG = frozenset({"effort", "format"})
_FORMAT = frozenset({"type", "schema"})


def _output_config(
    body: Mapping[str, Any], schemas: SchemaBudget
) -> tuple[ResponseFormat | None, str]:
    """`output_config`, as vLLM's own Messages server reads it: its `format` (a JSON
    schema the answer follows, which Anthropic guarantees: strict) and its `effort`
    (vLLM's `reasoning_effort`; "": not given). The top-level `output_format` (the
    structured-outputs beta's, which Anthropic's API still takes and older SDKs'
    `parse` send) is the same `format`; both at once is a 400."""
    config = body.get("output_config")
    legacy = body.get("output_format")
    if config is None and legacy is None:
        return None, ""
    if config is not None and not isinstance(config, Mapping):
        raise invalid("output_config", "output_config: expected an object.")
    config = config or {}
    _refuse_unknown(config, _OUTPUT_CONFIG, "output_config.")
    effort = _string(config, "effort", "output_config.") or ""
    if effort and effort not in EFFORTS:
        raise invalid("output_config.effort", f"output_config.effort: one of {', '.join(EFFORTS)}.")
    spec, where = config.get("format"), "output_config.format"
    if legacy is not None:
        if spec is not None:
            raise invalid(
                "output_format", "output_format: give output_config.format or output_format."
            )
        spec, where = legacy, "output_format"
    if spec is None:
        return None, effort
    if not isinstance(spec, Mapping) or spec.get("type") != "json_schema":
        raise invalid(f"{where}.type", f"{where}.type: 'json_schema'.")
    _refuse_unknown(spec, _FORMAT, f"{where}.")
    schema = spec.get("schema")
    if not isinstance(schema, Mapping):
        raise invalid(f"{where}.schema", f"{where}.schema: an object is required.")
    schemas.check(schema, f"{where}.schema")
    text = orjson.dumps(schema).decode()
    return ResponseFormat("json_schema", text, "json_schema", strict=True), effort


#: The most edits a request may list (Anthropic's are one of each type).
MAX_EDITS = 3
_EDITS = (CLEAR_THINKING, CLEAR_TOOL_USES, COMPACT)
_CLEAR_THINKING_FIELDS = frozenset({"type", "keep"})
_CLEAR_TOOL_USES_FIELDS = frozenset(
    {"type", "trigger", "keep", "clear_at_least", "exclude_tools", "clear_tool_inputs"}
)


def _keep(edit: Mapping[str, Any], where: str) -> int | None:
    """How many of the last assistant turns with thinking keep it (None: all)."""
    keep = edit.get("keep", {"type": "thinking_turns", "value": 1})
    if keep == "all":
        return None
    value = keep.get("value") if isinstance(keep, Mapping) else None
    if not isinstance(keep, Mapping) or keep.get("type") != "thinking_turns":
        raise invalid(where, f"{where}: 'all' or {{type: 'thinking_turns', value}}.")
    _refuse_unknown(keep, frozenset({"type", "value"}), where + ".")
    if not _is_int(value) or not 1 <= value <= UINT32_MAX:
        raise invalid(f"{where}.value", f"{where}.value: an integer of at least 1.")
    return value


def _amount(
    edit: Mapping[str, Any], key: str, where: str, kinds: tuple[str, ...]
) -> tuple[str, int] | None:
    """An edit's `{type, value}` object (`trigger`, `keep`, `clear_at_least`): its type,
    one of `kinds`, and its value, an integer of at least 0 (None: not given)."""
    amount = edit.get(key)
    if amount is None:
        return None
    where = f"{where}.{key}"
    names = " or ".join(f"'{kind}'" for kind in kinds)
    if not isinstance(amount, Mapping) or amount.get("type") not in kinds:
        raise invalid(f"{where}.type", f"{where}.type: {names}.")
    _refuse_unknown(amount, frozenset({"type", "value"}), where + ".")
    value = amount.get("value")
    if not _is_int(value) or not 0 <= value <= UINT32_MAX:
        raise invalid(f"{where}.value", f"{where}.value: an integer of at least 0.")
    return amount["type"], value


def _names(edit: Mapping[str, Any], key: str, where: str) -> frozenset[str]:
    names = edit.get(key)
    if names is None:
        return frozenset()
    if (
        not isinstance(names, list)
        or len(names) > MAX_TOOLS
        or not all(isinstance(name, str) for name in names)
    ):
        raise invalid(f"{where}.{key}", f"{where}.{key}: a list of at most {MAX_TOOLS} tool names.")
    return frozenset(names)


def _tool_clearing(edit: Mapping[str, Any], where: str) -> ToolClearing:
    """A `clear_tool_uses_20250919` edit, checked, its defaults filled in."""
    _refuse_unknown(edit, _CLEAR_TOOL_USES_FIELDS, where + ".")
    trigger = _amount(edit, "trigger", where, ("input_tokens", "tool_uses"))
    keep = _amount(edit, "keep", where, ("tool_uses",))
    least = _amount(edit, "clear_at_least", where, ("input_tokens",))
    inputs = edit.get("clear_tool_inputs")
    clears: bool | frozenset[str] = False
    if isinstance(inputs, list):
        clears = _names(edit, "clear_tool_inputs", where)
    elif inputs is not None:
        if not isinstance(inputs, bool):
            raise invalid(
                f"{where}.clear_tool_inputs",
                f"{where}.clear_tool_inputs: a boolean or a list of tool names.",
            )
        clears = inputs
    clearing = ToolClearing(
        keep=KEEP_TOOL_USES if keep is None else keep[1],
        clear_at_least=0 if least is None else least[1],
        exclude=_names(edit, "exclude_tools", where),
        inputs=clears,
    )
    if trigger is None:
        return clearing
    kind, value = trigger
    if kind == "tool_uses":
        return replace(clearing, trigger_tokens=None, trigger_uses=value)
    return replace(clearing, trigger_tokens=value)


def _context_management(
    body: Mapping[str, Any], messages: tuple[Message, ...]
) -> tuple[tuple[Message, ...], ContextEdits | None]:
    """`context_management` (Anthropic's beta context editing), checked:
    `clear_thinking_20251015` applied to `messages` (the thinking of all but the last
    `keep` assistant turns that have some left out), `clear_tool_uses_20250919` read for
    the route to apply (it clears by the prompt's tokens: `context_editing.edit`),
    `compact_20260112` read for the route to apply after them (compaction.py)."""
    config = body.get("context_management")
    if config is None:
        return messages, None
    if not isinstance(config, Mapping):
        raise invalid("context_management", "context_management: expected an object.")
    _refuse_unknown(config, frozenset({"edits"}), "context_management.")
    edits = config.get("edits") or []
    if not isinstance(edits, list) or len(edits) > MAX_EDITS:
        raise invalid(
            "context_management.edits",
            f"context_management.edits: a list of at most {MAX_EDITS} edits.",
        )
    thinking_edit: Mapping[str, Any] | None = None
    tools: ToolClearing | None = None
    compacting: Compaction | None = None
    for i, edit in enumerate(edits):
        where = f"context_management.edits[{i}]"
        kind = edit.get("type") if isinstance(edit, Mapping) else None
        if not isinstance(edit, Mapping) or kind not in _EDITS:
            raise invalid(
                f"{where}.type",
                f"{where}.type: '{CLEAR_THINKING}', '{CLEAR_TOOL_USES}' or '{COMPACT}'.",
            )
        if kind == COMPACT:
            if compacting is not None:
                raise invalid(f"{where}.type", f"{where}: '{COMPACT}' may be given once.")
            compacting = parse_edit(edit, where)
            continue
        if kind == CLEAR_TOOL_USES:
            if tools is not None:
                raise invalid(f"{where}.type", f"{where}: '{CLEAR_TOOL_USES}' may be given once.")
            tools = _tool_clearing(edit, where)
            continue
        if i > 0:
            raise invalid(
                f"{where}.type",
                f"{where}: '{CLEAR_THINKING}' must be the first edit, and given once.",
            )
        _refuse_unknown(edit, _CLEAR_THINKING_FIELDS, where + ".")
        thinking = body.get("thinking")
        if not isinstance(thinking, Mapping) or thinking.get("type") == "disabled":
            raise invalid(
                "thinking",
                f"`{CLEAR_THINKING}` strategy requires `thinking` to be enabled or adaptive",
            )
        thinking_edit = edit
    keep = _keep(thinking_edit, "context_management.edits[0].keep") if thinking_edit else None
    if thinking_edit is None or keep is None:
        return messages, ContextEdits(tools=tools, compaction=compacting)
    edited = list(messages)
    kept = cleared = 0
    for i in range(len(edited) - 1, -1, -1):
        message = edited[i]
        if message.role != "assistant" or not message.reasoning:
            continue
        if kept < keep:
            kept += 1
            continue
        edited[i] = replace(message, reasoning="")
        cleared += 1
    if not cleared:
        return messages, ContextEdits(tools=tools, compaction=compacting)
    return tuple(edited), ContextEdits(cleared, messages, tools, compacting)


def _refuse_threads(body: Mapping[str, Any]) -> None:
    """`thread` (Anthropic's server-held conversation state) is refused with Anthropic's
    `thread_unsupported_request` code: its SDK's tool runner, which threads its turns by
    default, then goes on without a thread, sending the whole conversation each turn."""
    if body.get("thread") is not None:
        raise APIError(
            400,
            "thread: Threads (server-held conversation state) are not supported by this "
            "gateway: send the whole conversation without 'thread'.",
            param="thread",
            code="thread_unsupported_request",
        )


def _asks_nothing(body: Mapping[str, Any]) -> None:
    """`service_tier` is served at the values that ask nothing of a self-hosted model
    (no priority capacity); else a 400."""
    tier = body.get("service_tier")
    if tier is not None and (not isinstance(tier, str) or tier not in SERVICE_TIERS):
        raise invalid("service_tier", "Invalid 'service_tier': 'auto' or 'standard_only'.")


def _prompt(
    body: Any, request_id: str, known: frozenset[str]
) -> tuple[str | None, dict[str, Any], ContextEdits | None, dict[str, tuple[McpTool, ...]]]:
    """The model, the GenerateRequest fields that shape the prompt, what its
    `context_management` did to its messages (None: it asked for no editing), and the
    MCP servers' listings its conversation holds."""
    model = model_of(body)
    if not model:
        raise invalid("model", "Field required: 'model'.")
    _refuse_threads(body)
    _refuse_unknown(body, known)
    _asks_nothing(body)
    # checked for both; its budget is the answer's (`parse_messages`), its turning
    # off shapes a template's prompt as an effort does
    _, _, off = _thinking(body)
    schemas = SchemaBudget()
    listed: dict[str, tuple[McpTool, ...]] = {}
    conversation, changes = _messages(body, listed)
    tools = _tools_in_effect(_tools(body, schemas), changes, schemas)
    choice, parallel = _tool_choice(body, tools)
    answer, effort = _output_config(body, schemas)  # the effort shapes a template's prompt
    messages, edits = _context_management(body, conversation)
    fields = {
        "messages": messages,
        "tools": tools,
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "response_format": answer,
        # as vLLM's Messages server: `disabled` wins over `output_config.effort`
        "reasoning": (
            ReasoningParams(off=True) if off else ReasoningParams(effort=effort) if effort else None
        ),
        "request_id": request_id,
    }
    if body["messages"][-1].get("role") == "assistant":
        fields.update(_prefill(body, messages))
    return model, fields, edits, listed


def parse_messages(body: Any, request_id: str = "") -> ParsedRequest:
    """A /v1/messages body, checked (for the request `request_id`)."""
    model, fields, edits, listed = _prompt(body, request_id, MESSAGE_FIELDS)
    mcp = connector(body)
    mcp.listed = {**listed, **mcp.listed}  # a toolset's own listing wins
    max_tokens = _int(body, "max_tokens", 1, UINT32_MAX)
    if max_tokens is None:
        raise invalid("max_tokens", "Field required: 'max_tokens'.")
    top_k = _int(body, "top_k", 0, UINT32_MAX) or None
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 0, 1),
        top_p=_number(body, "top_p", 0, 1, low_open=True),
        top_k=top_k,
        max_tokens=max_tokens,
    )
    budget, shown, _ = _thinking(body)
    if budget is not None:
        if budget >= max_tokens:
            raise invalid(
                "thinking.budget_tokens", "thinking.budget_tokens: must be less than max_tokens."
            )
        effort = fields["reasoning"].effort if fields["reasoning"] is not None else ""
        fields["reasoning"] = ReasoningParams(effort=effort, budget=budget)
    request = GenerateRequest(
        model or "",
        sampling=sampling,
        stop=_stop_sequences(body),
        user=_user(body),
        **fields,
    )
    stream = _flag(body, "stream")
    compaction = _compaction(body, edits, mcp)
    if request.continue_final_message and (compaction is not None or mcp.servers):
        # an answer of several turns: the next turn would go on from the prefill's end
        raise invalid(
            f"messages[{len(body['messages']) - 1}]",
            "A final assistant message (a prefill) is not supported by this gateway with "
            "compaction or the MCP connector's servers.",
        )
    omitted = _omitted(body)
    if edits is None and not mcp.servers and compaction is None and not omitted:
        return ParsedRequest(model, request, stream, False, show_reasoning=shown)
    return MessagesRequest(
        model,
        request,
        stream,
        False,
        show_reasoning=shown,
        edits=edits,
        mcp=mcp,
        compaction=compaction,
        thinking_omitted=omitted,
    )


def _prefill(body: Mapping[str, Any], messages: tuple[Message, ...]) -> dict[str, bool]:
    """A final assistant message, as Anthropic takes it: a prefill the answer continues
    (the prompt left open after its text: vLLM's `continue_final_message`; the answer
    holds only what follows), refused where Anthropic refuses one: with trailing
    whitespace, with thinking on, or holding tool calls (they want their results)."""
    where = f"messages[{len(body['messages']) - 1}]"
    thinking = body.get("thinking")
    if isinstance(thinking, Mapping) and thinking.get("type") != "disabled":
        raise invalid(
            "thinking", "A final assistant message (a prefill) cannot be used with thinking."
        )
    last = messages[-1] if messages else None
    if last is None or last.role != "assistant":  # (edits cleared it; a compaction's summary)
        return {}
    if last.tool_calls:
        raise invalid(
            f"{where}.content",
            "A final assistant message (a prefill) cannot hold tool_use blocks: their "
            "tool_result blocks must follow in a user message.",
        )
    if last.content != last.content.rstrip():
        raise invalid(
            f"{where}.content", "final assistant content cannot end with trailing whitespace"
        )
    return {"add_generation_prompt": False, "continue_final_message": True}


def _compaction(
    body: Mapping[str, Any], edits: ContextEdits | None, mcp: Connector
) -> Compaction | None:
    """The compaction a Messages body asks (the `compaction` parameter, or the
    `compact_20260112` edit), which an answer of the MCP connector's turns cannot take."""
    given = parse_parameter(body.get("compaction"))
    if given is not None and body.get("context_management") is not None:
        raise invalid("compaction", "compaction: cannot be combined with context_management.")
    compaction = given or (edits.compaction if edits is not None else None)
    if compaction is not None and mcp.servers:
        raise invalid(
            "compaction" if given else "context_management.edits",
            "Compaction and the MCP connector's servers (mcp_servers) are not supported "
            "together by this gateway.",
        )
    return compaction


@dataclass(frozen=True, slots=True)
class MessagesRequest(ParsedRequest):
    """A Messages request that asked for context editing or named MCP servers: the
    edits it asked (`edits`; None: none), and once the route applied them, the edits
    that cleared something (its answer's `applied_edits`); its MCP servers (`mcp`), and
    once the route listed their tools, the turns' plan."""

    edits: ContextEdits | None = None
    applied: tuple[Applied, ...] = ()
    mcp: Connector = field(default_factory=Connector)
    plan: McpPlan | None = None
    #: The compaction it asks (compaction.py; None: none).
    compaction: Compaction | None = None
    #: `thinking.display: "omitted"`: its thinking blocks empty (`_omitted`).
    thinking_omitted: bool = False


@dataclass(frozen=True, slots=True)
class ConnectorRequest(MessagesRequest):
    """A Messages request whose answer takes turns around its MCP servers' calls."""

    turns: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class CompactingRequest(MessagesRequest):
    """A Messages request whose answer begins with its conversation's summary
    (gateway/edge/compacting.py: `Compacting`): its `generate` is the summary's turn,
    `asked` the request as the client asked it."""

    turns: ClassVar[bool] = True
    asked: GenerateRequest | None = None

    def continuation(self) -> GoesOn | None:
        """After the summary: the system prompt and the summary (None: paused)."""
        if self.compaction is None or self.compaction.pause or self.asked is None:
            return None
        return partial(going_on, self.asked)


def parse_count(
    body: Any, request_id: str = ""
) -> tuple[GenerateRequest, ContextEdits | None, Connector]:
    """A /v1/messages/count_tokens body: the prompt it would make, what its
    `context_management` did to it (None: not asked), and its MCP servers (their tools
    the route lists, for the count to hold them as the answer's first turn does)."""
    model, fields, edits, listed = _prompt(body, request_id, COUNT_FIELDS)
    parse_parameter(body.get("compaction"))  # checked; the count is of the prompt sent
    mcp = connector(body)
    mcp.listed = {**listed, **mcp.listed}
    return GenerateRequest(model or "", **fields), edits, mcp
