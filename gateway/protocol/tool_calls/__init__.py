"""Tool calls in a model's text: one incremental parser per choice, picked by
the format the model writes calls in (a model's setting, as vLLM's
`--tool-call-parser`), or, when the request forces calls, by the JSON that
guided decoding forces.

    base.py         the pieces, bounds, JSON scanner and call check every parser shares
    hermes.py       `<tool_call>{...}</tool_call>` (Hermes 2 Pro, Qwen 2.5, Qwen 3)
    llama3_json.py  `{"name": ..., "parameters": {...}}; ...` (Llama 3.x)
    forced.py       `tool_choice` "required" or named: the schema and its parsers
    stream.py       a parser's output as our events, with their tokens

Use: `for_request(request, parser_name)` gives the choice's parser (None when the
request has no tools in play); `ChoiceToolCalls(parser, index)` turns the text
an engine detokenizes into `Text` and `ToolCallDelta` events;
`required_schema(...)` is the schema to enforce when `forced(tool_choice)`.
"""

from __future__ import annotations

from collections.abc import Callable

from gateway.protocol import errors
from gateway.protocol.tool_calls.base import (
    MAX_CALL_CHARS,
    CallPiece,
    Parsed,
    ToolCallParser,
    new_call_id,
)
from gateway.protocol.tool_calls.forced import (
    NamedCallParser,
    RequiredCallsParser,
    forced,
    required_schema,
)
from gateway.protocol.tool_calls.hermes import HermesParser
from gateway.protocol.tool_calls.llama3_json import Llama3JsonParser
from gateway.protocol.tool_calls.stream import ChoiceToolCalls
from gateway.protocol.types import GenerateRequest, Tool

#: The formats by name (the names vLLM's `--tool-call-parser` uses).
PARSERS: dict[str, Callable[..., ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
}
#: The formats whose markers some models make special tokens: a request with tools in
#: play decodes special tokens too (vLLM's parser turns `skip_special_tokens` off so).
KEEP_SPECIAL_TOKENS = frozenset({"hermes"})


def parser(name: str, tools: tuple[Tool, ...], *, single: bool = False) -> ToolCallParser:
    """A new parser of format `name` for one choice of a request with `tools`;
    `single`: only its first call counts (`parallel_tool_calls` false)."""
    try:
        return PARSERS[name](tools, single=single)
    except KeyError:
        raise ValueError(f"unknown tool-call format {name!r} (known: {sorted(PARSERS)})") from None


def for_request(request: GenerateRequest, parser_name: str | None) -> ToolCallParser | None:
    """The parser of one choice of `request`: the forced call's when
    `tool_choice` forces one, else the model's format's (`parser_name`, None when
    the model has none) when tools may be called; None when no call can come
    (no tools, or `tool_choice` "none"). A request that lets the model call its
    tools when the model has no format is refused, naming `tools`."""
    choice = request.tool_choice
    if not request.tools or choice == "none":
        return None
    if choice == "required":
        return RequiredCallsParser(request.tools)
    if forced(choice):
        return NamedCallParser(request.tools, choice)
    if parser_name is None:
        raise errors.Invalid(
            "This model has no tool-call format configured; only tool_choice "
            '"required", a named function or "none" can be served.',
            param="tools",
        )
    return parser(parser_name, request.tools, single=request.parallel_tool_calls is False)


__all__ = [
    "KEEP_SPECIAL_TOKENS",
    "MAX_CALL_CHARS",
    "PARSERS",
    "CallPiece",
    "ChoiceToolCalls",
    "Parsed",
    "ToolCallParser",
    "for_request",
    "forced",
    "new_call_id",
    "parser",
    "required_schema",
]
