"""A `POST /v1/responses` body → the request's options and its input items, then
our `GenerateRequest`, or a 400 naming the parameter at fault (OpenAI's shape).

The body is read in two steps because a turn that continues a conversation
(`previous_response_id`) needs the store before it can be a `GenerateRequest`:
`parse` checks the body on its own and puts its input items in the stored form
(every item with an id, every message's content as parts); `generate_request` then turns
the conversation (the stored turns' items, then this body's) into chat messages.

What is served (OpenAI's reference): `input` as a string or items (messages with
text and image parts, `function_call` (a namespace's with its `namespace`),
`function_call_output`, `reasoning`, `compaction` (a summary of ours:
compact.py), and `item_reference`: kept as `{type, id}` here, read
from the store by the route (`resolve`); an output item's id names its response,
`output_item_id`), `instructions`, function `tools` and `namespace` tools (their
functions given to the model flattened: `namespace__name`), `tool_choice`,
`parallel_tool_calls`, `text.format` (`text`, `json_object`, `json_schema`), vLLM's
`structured_outputs` (as chat reads it; not with `text.format`),
`max_output_tokens`, `temperature`, `top_p`, `metadata`, `client_metadata` (checked,
then dropped), `user`, `truncation` (`"auto"`: truncation.py), `store`, `stream`,
`previous_response_id`, `conversation` (conversations.py: its items before this
turn's, and the turn appended to it), `prompt_cache_key` (the conversation's key for
session affinity), `reasoning` (`effort`, and `summary`: the whole reasoning as its one
part, as these models do not summarize), `top_logprobs`, and `include`'s
`reasoning.encrypted_content` (the reasoning as an opaque string of ours, which a
stateless agent sends back) and `message.output_text.logprobs`. Everything else OpenAI
defines is refused by name unless it is at the value that asks nothing (`UNSERVED`;
`include`'s other values); other tool types, item types and content parts are refused
by the path that names them. Unknown fields are ignored, as the chat route ignores them.
"""

from __future__ import annotations

import base64
import binascii
import re
import secrets
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn

import orjson

from gateway.edge.compacting import summary_message
from gateway.edge.errors import APIError, invalid
from gateway.edge.mcp.servers import McpServer
from gateway.edge.openai.schema_limits import SchemaBudget
from gateway.edge.openai.validation import (
    _IMAGE_URL,
    _NAME,
    MAX_IMAGES,
    MAX_LOGPROBS,
    MAX_TOOLS,
    SERVICE_TIERS,
    UINT32_MAX,
    _flag,
    _int,
    _sampling,
    _stop,
    _string,
    _unserved,
    _user,
    model_of,
    reasoning_effort,
    text_options,
    with_structured_outputs,
)
from gateway.edge.openai.validation import UNSERVED as VLLM_UNSERVED
from gateway.edge.openai.validation import _reasoning as vllm_reasoning
from gateway.edge.responses.mcp import MCP, MCP_ITEMS, mcp_item, mcp_turn, parse_server
from gateway.edge.responses.mcp import shown as shown_server
from gateway.protocol.types import (
    ContentPart,
    GenerateRequest,
    Message,
    ReasoningParams,
    ResponseFormat,
    SamplingParams,
    Tool,
    ToolCall,
)

#: A stored item, as the API shows it (`GET .../input_items`).
Item = dict[str, Any]

#: OpenAI's bounds on `metadata`.
MAX_METADATA = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
#: The longest id a client may name (ours are about 50 characters).
MAX_ID_CHARS = 128
#: The longest `prompt_cache_key` (a session key).
MAX_CACHE_KEY_CHARS = 256
#: What joins a namespace's name and its function's in the name the model sees (OpenAI's
#: function names allow no dot; workers behind an OpenAI-compatible server check them).
NAMESPACE_JOIN = "__"
#: Bounds on `client_metadata` (a client's own ids, kept from the workers): `metadata`'s,
#: but longer values, as Codex sends a JSON object of its turn's ids (about 750 characters).
MAX_CLIENT_METADATA_VALUE = 4096
#: Roles of an input message (OpenAI's; `system` and `developer` are both instructions).
ROLES = frozenset({"user", "assistant", "system", "developer"})

#: vLLM's Responses fields beyond OpenAI's and its sampling and reasoning extras, refused
#: as on chat where they ask for something.
VLLM_RESPONSES_UNSERVED = (
    "mm_processor_kwargs",
    "priority",
    "cache_salt",
    "vllm_xargs",
    "kv_transfer_params",
    "request_id",
    "session_id",
    "watermarking",
    "media_io_kwargs",
    "mm_payload",
    "return_mm_kwargs",
    "ec_transfer_params",
)
#: Parameters of OpenAI's Responses API this gateway does not serve, with the value
#: that asks nothing of it (None: any value but null is refused).
UNSERVED: dict[str, Any] = {
    # vLLM's Responses extras that ask for what the gateway does not do (its sampling
    # and reasoning extras are served, as on chat)
    **{name: VLLM_UNSERVED[name] for name in VLLM_RESPONSES_UNSERVED},
    "thinking_token_budget": None,  # chat's; vLLM's Responses server has no such field
    # vLLM's Responses server's own
    "enable_response_messages": False,
    "previous_input_messages": None,
    "background": False,
    "prompt": None,
    "moderation": None,  # OpenAI's moderation of the input and the output
    "image": None,  # OpenAI's image-generation options
    "access_programs": None,
    # OpenAI's prompt caching: the engines cache every prefix in memory by themselves
    "prompt_cache_retention": "in_memory",
    "prompt_cache_options": None,
}
#: `include`'s values served: the reasoning as an opaque string, and the text's logprobs.
ENCRYPTED = "reasoning.encrypted_content"
LOGPROBS = "message.output_text.logprobs"
#: `reasoning.summary`'s values (OpenAI's; each is served as the whole reasoning).
SUMMARIES = ("auto", "concise", "detailed")
#: What begins an `encrypted_content` of ours: the format's version.
OPAQUE_PREFIX = "furnace.r1."
#: The most reasoning (UTF-8 bytes, decompressed) the `encrypted_content` of one request's
#: items may hold, all together: a body's size by default (`max_body_bytes`), so what
#: decompressing costs is what reading the body could cost.
MAX_OPAQUE_BYTES = 4 * 1024 * 1024
#: An input item that names a stored response's output item by its `id` (what the Vercel AI
#: SDK sends back for an earlier step's reasoning and messages, `store` being the default).
REFERENCE = "item_reference"
#: A compaction item's type (`/v1/responses/compact`'s summary, sent back).
COMPACTION = "compaction"
#: What begins the ids of a response's output items (`output_item_id`).
OUTPUT_PREFIXES = frozenset({"msg", "fc", "rs", "mcpl", "mcp", "mcpr", "cmp"})
_OUTPUT_DIGITS = re.compile(r"[0-9a-f]{52}")
#: Text parts of a message's content (a refusal is text the assistant said).
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}


@dataclass(frozen=True, slots=True)
class ResponsesBody:
    """A checked body: what to ask the worker (`generate_request` finishes it), and `echo`, the
    request's own fields as the response object repeats them."""

    model: str | None
    items: tuple[Item, ...]
    instructions: str | None
    previous_response_id: str | None
    store: bool
    stream: bool
    sampling: SamplingParams
    tools: tuple[Tool, ...]
    tool_choice: str
    parallel_tool_calls: bool | None
    response_format: ResponseFormat | None
    user: str
    session: str
    echo: dict[str, Any]
    reasoning: ReasoningParams | None = None
    #: `stream_options.include_obfuscation`: the stream's delta events padded.
    obfuscate: bool = False
    #: `reasoning.summary` as asked (None: none): the reasoning shown as its summary.
    summary: str | None = None
    #: `include: ["reasoning.encrypted_content"]`: reasoning items carry it.
    encrypted: bool = False
    #: With `include: ["message.output_text.logprobs"]`, the alternatives per token
    #: (`top_logprobs`, 0 by default); None: no logprobs.
    logprobs: int | None = None
    #: `conversation`'s id (None: none): the conversation this turn reads and extends.
    conversation: str | None = None
    #: A namespace's functions by the flat name the model calls them: (namespace, name).
    namespaced: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    #: `truncation: "auto"`: items dropped from the conversation's beginning to fit the
    #: model's context (truncation.py, in the route).
    truncate: bool = False
    #: vLLM's `stop` (its Responses server takes chat's), and its options of the text
    #: (`include_stop_str_in_output`, `skip_special_tokens`: GenerateRequest's fields).
    stop: tuple[str, ...] = ()
    text_options: Mapping[str, Any] = field(default_factory=dict)
    #: Remote MCP servers among the tools (`{"type": "mcp"}`: mcp.py), in order.
    mcp: tuple[McpServer, ...] = ()
    #: `context_management`'s compaction: the prompt's tokens from which the answer
    #: compacts the conversation first (0: the model's `COMPACT_SHARE`); None: it never does.
    compact_threshold: int | None = None


def new_id(prefix: str) -> str:
    """An id in OpenAI's style: `prefix_` and 48 hex digits."""
    return f"{prefix}_{secrets.token_hex(24)}"


def output_item_id(prefix: str, response_id: str, index: int) -> str:
    """The id of a response's output item: `prefix_`, the response's 48 hex digits and the
    item's index in 4 more, so that an `item_reference` to it finds the stored response
    that holds it (`referenced_response`)."""
    return f"{prefix}_{response_id.removeprefix('resp_')}{index:04x}"


def referenced_response(item_id: str) -> str | None:
    """The id of the response whose output item `item_id` is (`output_item_id`'s), or
    None where it is no such id."""
    prefix, _, digits = item_id.partition("_")
    if prefix not in OUTPUT_PREFIXES or not _OUTPUT_DIGITS.fullmatch(digits):
        return None
    return f"resp_{digits[:48]}"


def resolve(items: Sequence[Item], found: Mapping[str, Item]) -> tuple[Item, ...]:
    """The items with each `item_reference` replaced by the item it names (`found`, by
    id: the stored output items); a reference to none is OpenAI's 404, naming it."""
    resolved = []
    for i, item in enumerate(items):
        if item["type"] == REFERENCE:
            item = found.get(item["id"]) or _not_found(item["id"], f"input[{i}].id")
        resolved.append(item)
    return tuple(resolved)


def _not_found(item_id: str, where: str) -> NoReturn:
    raise APIError(
        404,
        f"Item with id '{item_id}' not found. Items are not persisted when `store` is set "
        "to false. Try again with `store` set to true, or remove this item from your input.",
        param=where,
    )


# -- input items ----------------------------------------------------------------


def _part(part: Any, where: str, images: list[int]) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, Mapping) else None
    field = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
    if field is not None:
        text = part.get(field)
        if not isinstance(text, str):
            raise invalid(
                f"{where}.{field}", f"Invalid type for '{where}.{field}': expected a string."
            )
        if kind == "output_text":
            return {"type": kind, "text": text, "annotations": []}
        return {"type": kind, field: text}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str) or not _IMAGE_URL.match(url):
            raise invalid(
                f"{where}.image_url",
                "Invalid 'image_url': expected an http(s) URL or a data:image/ URI "
                "('file_id' is not supported).",
            )
        images[0] += 1
        if images[0] > MAX_IMAGES:
            raise invalid(where, f"At most {MAX_IMAGES} images in a request.")
        detail = part.get("detail", "auto")
        if detail not in ("auto", "low", "high"):
            raise invalid(f"{where}.detail", "Invalid 'detail': auto, low or high.")
        return {"type": kind, "image_url": url, "detail": detail}
    raise invalid(
        where,
        "Only content parts of type 'input_text', 'input_image', 'output_text' and "
        f"'refusal' are supported{f', not {kind[:40]!r}' if isinstance(kind, str) else ''}.",
    )


def _content(content: Any, where: str, images: list[int]) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "input_text", "text": content}]
    if not isinstance(content, list):
        raise invalid(where, f"Invalid type for '{where}': expected a string or a list of parts.")
    return [_part(part, f"{where}[{j}]", images) for j, part in enumerate(content)]


def _message(item: Mapping[str, Any], where: str, images: list[int]) -> Item:
    role = item.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise invalid(f"{where}.role", f"Invalid value: must be one of {', '.join(sorted(ROLES))}.")
    content = _content(item.get("content"), f"{where}.content", images)
    if role == "assistant":  # what the model said is output text, as OpenAI stores it
        content = [
            {"type": "output_text", "text": p["text"], "annotations": []}
            if p["type"] == "input_text"
            else p
            for p in content
        ]
    return {"type": "message", "id": _item_id(item, where, "msg"), "role": role, "content": content}


def _item_id(item: Mapping[str, Any], where: str, prefix: str) -> str:
    """The item's own id, kept as given (an agent sends back an answer's items, ids and
    all, and reads them back by it), or a new one."""
    value = item.get("id")
    if value is None:
        return new_id(prefix)
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS:
        raise invalid(
            f"{where}.id", f"Invalid '{where}.id': a string of 1 to {MAX_ID_CHARS} chars."
        )
    return value


def _call_id(item: Mapping[str, Any], where: str) -> str:
    call_id = _string(item, "call_id", f"{where}.")
    if not call_id or len(call_id) > MAX_ID_CHARS:
        raise invalid(f"{where}.call_id", f"'{where}.call_id' is required (at most 128 chars).")
    return call_id


def _name(item: Mapping[str, Any], where: str) -> str:
    """A function's name (a tool's, a call's), as OpenAI allows them."""
    name = item.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise invalid(f"{where}.name", "Invalid name: 1-64 of a-z, A-Z, 0-9, _ and -.")
    return name


def _function_call(item: Mapping[str, Any], where: str) -> Item:
    """A call the model made, sent back; with its `namespace` where it called a
    namespace's function (the prompt names it as the tools do: `flat_name`)."""
    name = _name(item, where)
    arguments = item.get("arguments")
    if not isinstance(arguments, str):
        raise invalid(f"{where}.arguments", "Invalid type: expected a string of JSON.")
    call = {
        "type": "function_call",
        "id": _item_id(item, where, "fc"),
        "call_id": _call_id(item, where),
        "name": name,
        "arguments": arguments,
        "status": "completed",
    }
    namespace = item.get("namespace")
    if namespace is not None:
        if not isinstance(namespace, str) or not _NAME.fullmatch(namespace):
            raise invalid(
                f"{where}.namespace", "Invalid namespace: 1-64 of a-z, A-Z, 0-9, _ and -."
            )
        call["namespace"] = namespace
    return call


def _function_output(item: Mapping[str, Any], where: str, images: list[int]) -> Item:
    output = item.get("output")
    if not isinstance(output, str):
        parts = _content(output, f"{where}.output", images)
        if any(p["type"] != "input_text" for p in parts):
            raise invalid(f"{where}.output", "Only text is supported in a function's output.")
        output = "".join(p["text"] for p in parts)
    return {
        "type": "function_call_output",
        "id": _item_id(item, where, "fco"),
        "call_id": _call_id(item, where),
        "output": output,
        "status": "completed",
    }


def _texts(value: Any, where: str, kind: str) -> list[str]:
    """The texts of a list of `{"type": kind, "text": ...}` parts (None: no parts)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid(where, f"Invalid type for '{where}': expected a list of parts.")
    texts = []
    for j, part in enumerate(value):
        text = part.get("text") if isinstance(part, Mapping) else None
        if not isinstance(text, str) or part.get("type") != kind:
            raise invalid(
                f"{where}[{j}]", f'Invalid part: expected {{"type": "{kind}", "text": ...}}.'
            )
        texts.append(text)
    return texts


def opaque(text: str) -> str:
    """A reasoning's `encrypted_content`: opaque, not encrypted (no secret: the reasoning
    is shown to the client anyway), so that a stateless agent can send it back: the
    version prefix, then the compressed UTF-8 text in base64url."""
    packed = zlib.compress(text.encode(), 6)
    return OPAQUE_PREFIX + base64.urlsafe_b64encode(packed).rstrip(b"=").decode("ascii")


#: What a 400 says of an `encrypted_content` another service made: a reasoning's, and a
#: compaction's.
FOREIGN_REASONING = (
    "Encrypted reasoning from another service (OpenAI's) cannot be read by these models: "
    "send the reasoning item without it."
)
FOREIGN_COMPACTION = (
    "A compaction item from another service (OpenAI's) cannot be read by these models: "
    "send the conversation's items instead, or compact it here (/v1/responses/compact)."
)


def unopaque(value: str, where: str, budget: list[int], foreign: str = FOREIGN_REASONING) -> str:
    """The text an `encrypted_content` of ours holds (a reasoning's, a compaction's); a
    400 naming `where` for one that is not ours (saying `foreign`), is damaged, or holds
    more than the request's `budget` (the bytes left of `MAX_OPAQUE_BYTES`; it is spent)."""
    if not value.startswith(OPAQUE_PREFIX):
        raise invalid(where, f"Invalid '{where}': it was not made by this gateway. {foreign}")
    encoded = value[len(OPAQUE_PREFIX) :]
    inflate = zlib.decompressobj()
    try:
        packed = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4))
        raw = inflate.decompress(packed, budget[0] + 1)
    except (binascii.Error, ValueError, zlib.error):
        raw, inflate = b"", zlib.decompressobj()
    if len(raw) > budget[0] or inflate.unconsumed_tail:
        raise invalid(
            where,
            f"Invalid '{where}': the text it holds is over {MAX_OPAQUE_BYTES} bytes "
            "(all of a conversation's encrypted content together).",
        )
    try:
        if not inflate.eof or inflate.unused_data:
            raise ValueError
        text = raw.decode()
    except ValueError:
        raise invalid(
            where, f"Invalid '{where}': damaged; send it back as this gateway gave it."
        ) from None
    budget[0] -= len(raw)
    return text


def _reasoning_item(item: Mapping[str, Any], where: str, budget: list[int]) -> Item:
    """A reasoning item an agent sends back with an answer's other output items: kept,
    and its text given to the assistant turn after it (`messages_of`). Its
    `encrypted_content` must be one of ours (read here, so a damaged one is a 400 now)."""
    summary = _texts(item.get("summary"), f"{where}.summary", "summary_text")
    content = _texts(item.get("content"), f"{where}.content", "reasoning_text")
    kept: Item = {
        "type": "reasoning",
        "id": _item_id(item, where, "rs"),
        "summary": [{"type": "summary_text", "text": t} for t in summary],
        "content": [{"type": "reasoning_text", "text": t} for t in content],
        "status": "completed",
    }
    sealed = item.get("encrypted_content")
    if sealed is not None:
        if not isinstance(sealed, str):
            raise invalid(f"{where}.encrypted_content", "Invalid type: expected a string.")
        unopaque(sealed, f"{where}.encrypted_content", budget)
        kept["encrypted_content"] = sealed
    return kept


def _compaction_item(item: Mapping[str, Any], where: str, budget: list[int]) -> Item:
    """A compaction item (`/v1/responses/compact`'s, sent back): kept, and its summary
    (its `encrypted_content`, one of ours, read here so a damaged one is a 400 now) the
    user message the conversation goes on from (`messages_of`)."""
    sealed = item.get("encrypted_content")
    if not isinstance(sealed, str):
        raise invalid(
            f"{where}.encrypted_content",
            f"'{where}.encrypted_content' is required: the compaction's, as it was given.",
        )
    unopaque(sealed, f"{where}.encrypted_content", budget, FOREIGN_COMPACTION)
    return {"type": COMPACTION, "id": _item_id(item, where, "cmp"), "encrypted_content": sealed}


def thought_of(item: Item, budget: list[int]) -> str:
    """A reasoning item's text: its content's, else its summary's (ours, with a summary
    asked, holds the whole reasoning there), else its `encrypted_content`'s (one of ours,
    checked when it came in; read within the conversation's `budget`, so a deep stored
    conversation of them costs no more to read again than one request's)."""
    parts = item.get("content") or item["summary"]
    if parts:
        return "".join(part["text"] for part in parts)
    sealed = item.get("encrypted_content")
    return unopaque(sealed, "input", budget) if sealed else ""


def _items(body: Mapping[str, Any]) -> tuple[Item, ...]:
    value = body.get("input")
    if isinstance(value, str):
        return (_message({"role": "user", "content": value}, "input", [0]),)
    if not isinstance(value, list) or not value:
        raise invalid("input", "'input' is required: a string or a non-empty list of items.")
    return input_items(value, "input", references=True)


def input_items(value: list[Any], name: str, references: bool = False) -> tuple[Item, ...]:
    """A list of input items (`name`'s, as a 400 names them) in the stored form: a
    request's `input`, or the items added to a conversation (conversations.py); with
    `references` (a request's), an `item_reference` is kept as `{type, id}`, for the
    route to `resolve` from the store."""
    images = [0]
    budget = [MAX_OPAQUE_BYTES]  # the reasoning that `encrypted_content` may hold
    items = []
    seen: set[str] = set()
    for i, item in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(item, Mapping):
            raise invalid(where, "Invalid type: expected an object.")
        kind = item.get("type", "message")
        if kind == "message":
            items.append(_message(item, where, images))
        elif kind == "function_call":
            items.append(_function_call(item, where))
        elif kind == "function_call_output":
            items.append(_function_output(item, where, images))
        elif kind == "reasoning":
            items.append(_reasoning_item(item, where, budget))
        elif kind == COMPACTION:
            items.append(_compaction_item(item, where, budget))
        elif isinstance(kind, str) and kind in MCP_ITEMS:  # a list or object: unhashable
            items.append(mcp_item(item, where, kind))
        elif kind == REFERENCE and references:
            if item.get("id") is None:
                raise invalid(f"{where}.id", f"'{where}.id' is required: the item's id.")
            items.append({"type": REFERENCE, "id": _item_id(item, where, "")})
        else:
            shown = repr(kind[:40]) if isinstance(kind, str) else "this type"
            served = ", 'reasoning', 'compaction'"
            served += " and 'item_reference'" if references else ""
            raise invalid(
                f"{where}.type",
                f"Input items of type {shown} are not supported: only 'message', "
                f"'function_call', 'function_call_output', the 'mcp_' items{served}.",
            )
        if items[-1]["id"] in seen:  # the store's pages are read `after` an id
            raise invalid(f"{where}.id", f"Duplicate item id '{items[-1]['id']}' in '{name}'.")
        seen.add(items[-1]["id"])
    return tuple(items)


def _chat_part(part: dict[str, Any]) -> ContentPart:
    if part["type"] == "input_image":
        return ContentPart("image_url", url=part["image_url"], detail=part["detail"])
    return ContentPart("text", part.get("text") or part.get("refusal") or "")


def compacted(items: Sequence[Item]) -> Sequence[Item]:
    """The items a conversation's prompt is made of: before its last compaction item,
    which stands for them, only the messages of the user and the instructions (as
    `/v1/responses/compact` keeps them)."""
    last = next((i for i in range(len(items) - 1, -1, -1) if items[i]["type"] == COMPACTION), 0)
    if not last:
        return items
    kept = [item for item in items[:last] if kept_in_compaction(item)]
    return [*kept, *items[last:]]


def kept_in_compaction(item: Item) -> bool:
    """Whether a compaction keeps the item as it came: a message but the assistant's."""
    return bool(item["type"] == "message" and item["role"] != "assistant")


def messages_of(items: Sequence[Item]) -> tuple[Message, ...]:
    """Stored items as chat messages (of those a compaction left: `compacted`): a
    message's text parts joined and its images in order; function calls join the
    assistant message just before them (or make one); a function's output is a `tool`
    message; a compaction item is its summary's user message."""
    items = compacted(items)
    messages: list[Message] = []
    thought = ""  # a reasoning item's text, for the assistant turn after it
    budget = [MAX_OPAQUE_BYTES]  # what the conversation's `encrypted_content` may hold
    for item in items:
        kind = item["type"]
        if kind == "message":
            parts = [_chat_part(p) for p in item["content"]]
            images = tuple(p.url for p in parts if p.type == "image_url")
            text = "".join(p.text for p in parts)
            # the parts as they came (order, detail) where an image is among them, as chat's
            shown = tuple(parts) if images else ()
            role = item["role"]
            reasoning = thought if role == "assistant" else ""
            messages.append(Message(role, text, images, parts=shown, reasoning=reasoning))
            thought = ""
        elif kind == "function_call":
            name = flat_name(item.get("namespace"), item["name"])
            _join_call(messages, ToolCall(item["call_id"], name, item["arguments"]), thought)
            thought = ""
        elif kind == "function_call_output":
            messages.append(Message("tool", item["output"], tool_call_id=item["call_id"]))
            thought = ""
        elif kind == "reasoning":
            thought += thought_of(item, budget)
        elif kind == COMPACTION:  # the conversation it summarizes goes on from it
            summary = unopaque(item["encrypted_content"], "input", budget, FOREIGN_COMPACTION)
            messages.append(summary_message(summary))
            thought = ""
        elif kind in MCP_ITEMS:  # a call the gateway ran (or asked approval for)
            call, told = mcp_turn(item)
            if call is not None:
                _join_call(messages, call, thought)
                thought = ""
            if told is not None:
                messages.append(Message("tool", told[1], tool_call_id=told[0]))
    return tuple(messages)


def _join_call(messages: list[Message], call: ToolCall, thought: str) -> None:
    """A call joins the assistant message just before it, or makes one (after a
    reasoning item, whose text goes with it)."""
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant" and not thought:
        messages[-1] = replace(last, tool_calls=(*last.tool_calls, call))
    else:
        messages.append(Message("assistant", "", (), (call,), reasoning=thought))


# -- tools and formats ------------------------------------------------------------


def flat_name(namespace: str | None, name: str) -> str:
    """The name the model sees for a function: in a namespace, the two names joined by
    `NAMESPACE_JOIN` (one name, as every chat template and tool parser writes calls)."""
    return f"{namespace}{NAMESPACE_JOIN}{name}" if namespace else name


def _function_tool(
    tool: Mapping[str, Any], where: str, budget: SchemaBudget, namespace: str = "", about: str = ""
) -> tuple[Tool, dict[str, Any]]:
    """A function tool (a namespace's: under its flattened name, the namespace's
    description `about` before its own), and as the response object shows it."""
    name = _name(tool, where)
    parameters = tool.get("parameters")
    if parameters is not None and not isinstance(parameters, Mapping):
        raise invalid(f"{where}.parameters", "Invalid type: expected an object.")
    if parameters is not None:
        budget.check(parameters, f"{where}.parameters")
    description = _string(tool, "description", f"{where}.") or ""
    # OpenAI's default for a Responses function tool is strict
    strict = tool.get("strict") is None or _flag(tool, "strict", f"{where}.")
    told = "\n\n".join(text for text in (about, description) if text)
    parsed = Tool(
        flat_name(namespace, name),
        told,
        orjson.dumps(parameters).decode() if parameters is not None else "",
        strict,
    )
    shown = {
        "type": "function",
        "name": name,
        "description": description or None,
        "parameters": parameters,
        "strict": strict,
    }
    return parsed, shown


def _refuse_type(kind: Any, where: str, served: str) -> NoReturn:
    shown_kind = repr(kind[:40]) if isinstance(kind, str) else "this type"
    raise invalid(f"{where}.type", f"Tools of type {shown_kind} are not supported: only {served}.")


def _tools(
    body: Mapping[str, Any], budget: SchemaBudget, servers: list[McpServer]
) -> tuple[tuple[Tool, ...], list[dict[str, Any]], dict[str, tuple[str, str]]]:
    """The function tools as the model sees them (a namespace's flattened), each as the
    response object shows it, and the namespaced ones' flat names → (namespace, name);
    remote MCP servers (`mcp` tools) go to `servers`, their tools listed later."""
    tools = body.get("tools")
    if tools is None:
        return (), [], {}
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise invalid("tools", f"Invalid 'tools': expected a list of at most {MAX_TOOLS}.")
    parsed: dict[str, Tool] = {}
    shown: list[dict[str, Any]] = []
    namespaced: dict[str, tuple[str, str]] = {}

    def add(tool: Tool, where: str) -> None:
        if tool.name in parsed:
            raise invalid(
                f"{where}.name",
                f"Invalid 'tools': two functions are named {tool.name!r} (a namespace's "
                f"functions are named namespace{NAMESPACE_JOIN}name).",
            )
        if len(parsed) == MAX_TOOLS:
            raise invalid("tools", f"Invalid 'tools': at most {MAX_TOOLS} functions in all.")
        parsed[tool.name] = tool

    for k, tool in enumerate(tools):
        where = f"tools[{k}]"
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        if kind == "function":
            function, shown_function = _function_tool(tool, where, budget)
            add(function, where)
            shown.append(shown_function)
            continue
        if kind == MCP:
            server = parse_server(tool, where)
            if any(other.label == server.label for other in servers):
                raise invalid(
                    f"{where}.server_label",
                    f"Invalid 'tools': two MCP servers are labelled {server.label!r}.",
                )
            servers.append(server)
            shown.append(shown_server(server))
            continue
        if kind != "namespace":
            _refuse_type(kind, where, "'function', 'namespace' and 'mcp'")
        namespace = _name(tool, where)
        about = _string(tool, "description", f"{where}.") or ""
        members = tool.get("tools")
        if not isinstance(members, list) or not members:
            raise invalid(f"{where}.tools", "Invalid type: expected a non-empty list of tools.")
        shown_members = []
        for j, member in enumerate(members):
            inner = f"{where}.tools[{j}]"
            if not isinstance(member, Mapping) or member.get("type") != "function":
                _refuse_type(
                    member.get("type") if isinstance(member, Mapping) else None,
                    inner,
                    "'function' in a namespace",
                )
            function, shown_function = _function_tool(member, inner, budget, namespace, about)
            add(function, inner)
            namespaced[function.name] = (namespace, shown_function["name"])
            shown_members.append(shown_function)
        shown.append(
            {"type": "namespace", "name": namespace, "description": about, "tools": shown_members}
        )
    return tuple(parsed.values()), shown, namespaced


def _tool_choice(body: Mapping[str, Any], tools: tuple[Tool, ...]) -> tuple[str, Any]:
    """The choice in our terms, and as the response object shows it."""
    choice = body.get("tool_choice")
    if choice is None:
        return "", "auto"
    if isinstance(choice, Mapping):
        name = choice.get("name")
        if choice.get("type") != "function" or not isinstance(name, str):
            kind = choice.get("type")
            shown = repr(kind[:40]) if isinstance(kind, str) else "this"
            raise invalid(
                "tool_choice",
                f"Invalid 'tool_choice': a choice of type {shown} is not supported; "
                'none, auto, required or {"type": "function", "name": ...}.',
            )
        if name not in {tool.name for tool in tools}:
            raise invalid("tool_choice", f"Invalid 'tool_choice': no tool is named {name[:64]!r}.")
        return name, {"type": "function", "name": name}
    if choice not in ("none", "auto", "required"):
        raise invalid("tool_choice", "Invalid 'tool_choice': none, auto, required or a function.")
    if choice == "none":
        return ("none" if tools else ""), "none"
    if not tools:
        raise invalid("tool_choice", "'tool_choice' is only allowed when 'tools' are given.")
    return str(choice), choice


def _text(
    body: Mapping[str, Any], budget: SchemaBudget
) -> tuple[ResponseFormat | None, dict[str, Any]]:
    """`text.format` in our terms, and `text` as the response object shows it."""
    text = body.get("text")
    if text is None:
        return None, {"format": {"type": "text"}}
    if not isinstance(text, Mapping):
        raise invalid("text", "Invalid type for 'text': expected an object.")
    if text.get("verbosity") not in (None, "medium"):
        raise invalid("text.verbosity", "'text.verbosity' is not supported by this gateway.")
    spec = text.get("format")
    if spec is None:
        return None, {"format": {"type": "text"}}
    kind = spec.get("type") if isinstance(spec, Mapping) else None
    if kind == "text":
        return None, {"format": {"type": "text"}}
    if kind == "json_object":
        return ResponseFormat("json_object"), {"format": {"type": "json_object"}}
    if kind != "json_schema":
        raise invalid(
            "text.format", "Invalid 'text.format': type text, json_object or json_schema."
        )
    assert isinstance(spec, Mapping)
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise invalid("text.format.name", "Invalid name: 1-64 of a-z, A-Z, 0-9, _ and -.")
    schema = spec.get("schema")
    if not isinstance(schema, Mapping):
        raise invalid("text.format.schema", "'text.format.schema' is required: an object.")
    budget.check(schema, "text.format.schema")
    strict = _flag(spec, "strict", "text.format.")
    description = _string(spec, "description", "text.format.")
    shown = {
        "type": "json_schema",
        "name": name,
        "schema": schema,
        "strict": strict,
        "description": description,
    }
    format_ = ResponseFormat("json_schema", orjson.dumps(schema).decode(), name, strict)
    return format_, {"format": shown}


# -- the rest -----------------------------------------------------------------------


def _metadata(
    body: Mapping[str, Any], name: str = "metadata", longest: int = MAX_METADATA_VALUE
) -> dict[str, str]:
    """`metadata` (or `client_metadata`): at most 16 pairs of strings, keys of at most 64
    characters, values of at most `longest`."""
    value = body.get(name)
    if value is None:
        return {}
    if not isinstance(value, Mapping) or len(value) > MAX_METADATA:
        raise invalid(name, f"Invalid '{name}': an object of at most {MAX_METADATA} pairs.")
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY or not isinstance(item, str):
            raise invalid(name, f"Invalid '{name}': keys of at most 64 chars, string values.")
        if len(item) > longest:
            raise invalid(name, f"Invalid '{name}': values of at most {longest} characters.")
    return dict(value)


def _refuse_unserved(body: Mapping[str, Any]) -> None:
    _unserved(body, UNSERVED)
    if body.get("service_tier") not in (None, *SERVICE_TIERS):
        raise invalid("service_tier", "'service_tier' is not supported by this gateway.")
    if body.get("truncation") not in (None, "disabled", "auto"):
        raise invalid("truncation", "Invalid value for 'truncation': 'auto' or 'disabled'.")


def _include(body: Mapping[str, Any]) -> frozenset[str]:
    """`include`'s values: the two served; any other is refused, naming it."""
    value = body.get("include")
    if value is None:
        return frozenset()
    if not isinstance(value, list):
        raise invalid("include", "Invalid type for 'include': expected a list of strings.")
    for name in value:
        if name not in (ENCRYPTED, LOGPROBS):
            shown = repr(name[:64]) if isinstance(name, str) else "this value"
            raise invalid(
                "include",
                f"'include' of {shown} is not supported by this gateway: only "
                f"'{ENCRYPTED}' and '{LOGPROBS}'.",
            )
    return frozenset(value)


def _obfuscate(body: Mapping[str, Any], stream: bool) -> bool:
    """Whether the stream's delta events are padded (`stream_options.include_obfuscation`,
    OpenAI's one key there): off unless asked for, as vLLM's server sends no padding
    (OpenAI's default is on); options without `stream` ask nothing."""
    options = body.get("stream_options")
    if options is None:
        return False
    if not isinstance(options, Mapping):
        raise invalid("stream_options", "Invalid type for 'stream_options': an object.")
    for key in options:  # the Responses API defines one key; others are refused by name
        if key != "include_obfuscation":
            raise invalid(
                f"stream_options.{key[:64]}",
                f"Unrecognized key in 'stream_options': {key[:64]!r}.",
            )
    return _flag(options, "include_obfuscation", "stream_options.") and stream


def conversation_id(value: Any) -> str:
    """A `conversation` parameter's id: the id, or `{"id": ...}`, as OpenAI takes it;
    else a 400 naming `conversation`."""
    if isinstance(value, Mapping):
        value = value.get("id")
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS:
        raise invalid(
            "conversation",
            "Invalid 'conversation': a conversation's id (1 to 128 characters), or {\"id\": ...}.",
        )
    return value


def _id(body: Mapping[str, Any], name: str, limit: int = MAX_ID_CHARS) -> str | None:
    value = _string(body, name)
    if value is not None and not 0 < len(value) <= limit:
        raise invalid(name, f"Invalid '{name}': 1 to {limit} characters.")
    return value


def parse(body: Any) -> ResponsesBody:
    """A /v1/responses body, checked."""
    model = model_of(body)
    _refuse_unserved(body)
    instructions = _string(body, "instructions")
    items = _items(body)
    schemas = SchemaBudget()  # the tools' and the format's, together
    servers: list[McpServer] = []
    tools, shown_tools, namespaced = _tools(body, schemas, servers)
    tool_choice, shown_choice = _tool_choice(body, tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", "Invalid type: expected a boolean.")
    response_format, text = _text(body, schemas)
    response_format = with_structured_outputs(
        body, response_format, schemas, tool_choice, "text.format"
    )
    max_output_tokens = _int(body, "max_output_tokens", 1, UINT32_MAX)
    # OpenAI's temperature and top_p, and vLLM's sampling extras (its Responses server
    # takes chat's: top_k, min_p, penalties, seed, logit_bias, ...), read as chat reads them
    sampling = _sampling(body, max_output_tokens, "max_output_tokens")
    temperature, top_p = sampling.temperature, sampling.top_p
    stream = _flag(body, "stream")
    obfuscate = _obfuscate(body, stream)
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise invalid("store", "Invalid type for 'store': expected a boolean.")
    user = _user(body)
    previous = _id(body, "previous_response_id")
    conversation = None
    if body.get("conversation") is not None:
        if previous is not None:  # OpenAI's refusal of the two together
            raise invalid(
                "conversation",
                "Mutually exclusive parameters: Ensure you are only providing one of: "
                "'previous_response_id' or 'conversation'.",
            )
        conversation = conversation_id(body["conversation"])
    session = _id(body, "prompt_cache_key", MAX_CACHE_KEY_CHARS) or ""
    # checked, not sent to the workers nor repeated (OpenAI's response has no such field)
    _metadata(body, "client_metadata", MAX_CLIENT_METADATA_VALUE)
    effort, summary = _reasoning(body)
    include = _include(body)
    # OpenAI's alternatives per token, shown with the include alone (as vLLM's server)
    top_logprobs = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    echo = {
        "instructions": instructions,
        "max_output_tokens": max_output_tokens,
        "metadata": _metadata(body),
        "parallel_tool_calls": True if parallel is None else parallel,
        "previous_response_id": previous,
        "temperature": 1.0 if temperature is None else temperature,
        "text": text,
        "tool_choice": shown_choice,
        "tools": shown_tools,
        "top_p": 1.0 if top_p is None else top_p,
        "truncation": "auto" if body.get("truncation") == "auto" else "disabled",
        "user": _string(body, "user"),
        "safety_identifier": _string(body, "safety_identifier"),
        # it bounds the calls of remote MCP tools the gateway runs in one answer
        # (gateway/edge/mcp/turns.py): function calls are the client's to bound
        "max_tool_calls": _int(body, "max_tool_calls", 0, UINT32_MAX),
        "store": store is not False,
        "background": False,
        "reasoning": {"effort": effort or None, "summary": summary},
        "service_tier": "default",
        "top_logprobs": top_logprobs or 0,
    }
    if conversation is not None:
        echo["conversation"] = {"id": conversation}
    return ResponsesBody(
        model=model,
        items=items,
        instructions=instructions,
        previous_response_id=previous,
        store=store is not False,
        stream=stream,
        sampling=sampling,
        stop=_stop(body) if "stop" in body else (),
        text_options=text_options(body),
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel if tools or servers else None,
        response_format=response_format,
        user=user,
        session=session,
        echo=echo,
        reasoning=_reasoning_params(body, effort),
        obfuscate=obfuscate,
        summary=summary,
        encrypted=ENCRYPTED in include,
        logprobs=(top_logprobs or 0) if LOGPROBS in include else None,
        conversation=conversation,
        namespaced=namespaced,
        truncate=body.get("truncation") == "auto",
        mcp=tuple(servers),
        compact_threshold=_context_management(body, servers),
    )


def _context_management(body: Mapping[str, Any], servers: Sequence[McpServer]) -> int | None:
    """`context_management` (OpenAI's server-side compaction): a list of one
    `{"type": "compaction", "compact_threshold": N}` (N omitted: 0, the model's share), or
    none; an answer of MCP turns does not compact."""
    value = body.get("context_management")
    if value is None or value == []:
        return None
    if not isinstance(value, list) or len(value) != 1 or not isinstance(value[0], Mapping):
        raise invalid(
            "context_management",
            "Invalid 'context_management': a list of one entry, {type: 'compaction'}.",
        )
    entry = value[0]
    if entry.get("type") != COMPACTION:
        raise invalid(
            "context_management[0].type",
            "Invalid 'context_management[0].type': only 'compaction' is supported.",
        )
    extra = sorted(k for k in entry.keys() - {"type", "compact_threshold"} if entry[k] is not None)
    if extra:
        raise invalid(f"context_management[0].{extra[0]}", f"Unknown parameter: '{extra[0]}'.")
    threshold = entry.get("compact_threshold")
    if threshold is not None and (
        isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1
    ):
        raise invalid(
            "context_management[0].compact_threshold",
            "Invalid 'context_management[0].compact_threshold': a positive integer.",
        )
    if servers:
        raise invalid(
            "context_management",
            "Compaction ('context_management') and remote MCP tools are not supported "
            "together by this gateway.",
        )
    return threshold or 0


def _reasoning(body: Mapping[str, Any]) -> tuple[str, str | None]:
    """`reasoning`'s `effort` ("": none given) and `summary` (or the deprecated
    `generate_summary`; None: none asked)."""
    value = body.get("reasoning")
    if value is None:
        return "", None
    if not isinstance(value, Mapping):
        raise invalid("reasoning", "Invalid type for 'reasoning': expected an object.")
    summary = None
    for name in ("generate_summary", "summary"):  # `summary` wins where both are given
        asked = value.get(name)
        if asked is not None:
            if asked not in SUMMARIES:
                raise invalid(
                    f"reasoning.{name}",
                    f"Invalid value for 'reasoning.{name}': auto, concise or detailed.",
                )
            summary = str(asked)
    return reasoning_effort(value, "effort", "reasoning.") or "", summary


def _reasoning_params(body: Mapping[str, Any], effort: str) -> ReasoningParams | None:
    """`reasoning.effort`, with vLLM's reasoning extras (`include_reasoning`,
    `chat_template_kwargs`, as chat reads them); None: none asks anything."""
    asked = "include_reasoning" in body or "chat_template_kwargs" in body
    extras = vllm_reasoning(body) if asked else None
    if extras is None:
        return ReasoningParams(effort=effort) if effort else None
    return replace(extras, effort=effort) if effort else extras


def prompt_messages(instructions: str | None, items: Sequence[Item]) -> tuple[Message, ...]:
    """The prompt's messages: `instructions` as the system message, then the items'."""
    messages = messages_of(items)
    if instructions:
        messages = (Message("system", instructions), *messages)
    return messages


def generate_request(
    body: ResponsesBody, history: Sequence[Item], request_id: str, session: str
) -> GenerateRequest:
    """The request for the worker: `instructions` as the system message, then the
    conversation so far (`history`: the stored turns' input and output items), then
    this turn's input."""
    messages = prompt_messages(body.instructions, [*history, *body.items])
    return GenerateRequest(
        body.model or "",
        messages=messages,
        sampling=body.sampling,
        request_id=request_id,
        tools=body.tools,
        tool_choice=body.tool_choice,
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=body.response_format,
        stop=body.stop,
        user=body.user,
        session=session,
        reasoning=body.reasoning,
        logprobs=body.logprobs,
        **body.text_options,
    )
