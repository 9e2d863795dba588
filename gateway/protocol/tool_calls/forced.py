"""Calls the request forces (`tool_choice` "required" or a function's name):
the JSON schema that guided decoding enforces, and the parsers of the answer
it forces, whatever the model's own call markers are.

The schemas are the ones vLLM's OpenAI server builds for these choices:

- a named function: the function's parameters (an object with no properties
  when it has none); the whole answer is that call's arguments;
- "required": an array of at least one (at most one when
  `parallel_tool_calls` is false) `{"name": <one of the tools>, "parameters":
  <its parameters>}`, the tools' `$defs` gathered at the top (one name may not
  mean two schemas).
"""

from __future__ import annotations

import json
from typing import Any

from gateway.protocol import errors
from gateway.protocol.tool_calls.base import (
    CallPiece,
    CallText,
    Parsed,
    ToolCallParser,
    compact,
    parse_object,
)
from gateway.protocol.types import Tool

REQUIRED = "required"
NOT_FORCED = frozenset({"", "none", "auto"})


def forced(tool_choice: str) -> bool:
    """Whether `tool_choice` forces calls: "required" or a function's name."""
    return tool_choice not in NOT_FORCED


def _parameters(tool: Tool) -> dict[str, Any]:
    schema = json.loads(tool.parameters) if tool.parameters else None
    if not schema:
        return {"type": "object", "properties": {}}
    if not isinstance(schema, dict):
        raise errors.Invalid(f"Tool {tool.name!r}: parameters must be an object.", param="tools")
    return schema


def _named(tools: tuple[Tool, ...], name: str) -> Tool:
    for tool in tools:
        if tool.name == name:
            return tool
    raise errors.Invalid(f"tool_choice names {name!r}, which is not in tools.", param="tool_choice")


def required_schema(
    tools: tuple[Tool, ...], tool_choice: str, parallel_tool_calls: bool | None
) -> str:
    """The JSON schema (JSON text) that forces the call(s) of `tool_choice`
    ("required" or a function's name; see `forced`)."""
    if not forced(tool_choice):
        raise ValueError(f"tool_choice {tool_choice!r} forces no call")
    if tool_choice != REQUIRED:
        return compact(_parameters(_named(tools, tool_choice)))
    if not tools:
        raise errors.Invalid('tool_choice "required" needs tools.', param="tool_choice")
    variants: list[dict[str, Any]] = []
    defs: dict[str, Any] = {}
    for tool in tools:
        parameters = dict(_parameters(tool))
        own = parameters.pop("$defs", {})
        if not isinstance(own, dict):
            raise errors.Invalid(f"Tool {tool.name!r}: $defs must be an object.", param="tools")
        for key, value in own.items():
            if defs.setdefault(key, value) != value:
                raise errors.Invalid(
                    f"Tools define {key!r} in $defs with different schemas.", param="tools"
                )
        variants.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.name]},
                    "parameters": parameters,
                },
                "required": ["name", "parameters"],
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": variants},
    }
    if parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return compact(schema)


class NamedCallParser(ToolCallParser):
    """The answer is the named function's arguments: its first piece opens the
    call, and the text streams on as the arguments (the grammar makes it a JSON
    object; an answer cut by `max_tokens` leaves them incomplete)."""

    def __init__(self, tools: tuple[Tool, ...], name: str) -> None:
        super().__init__(tools)
        self._name = _named(tools, name).name

    def feed(self, text: str) -> Parsed:
        if not text:
            return Parsed("")
        if not self.called:
            head = self.pieces(self._name, "")
            return Parsed("", (*head, CallPiece(0, "", "", text)))
        return Parsed("", (CallPiece(0, "", "", text),))

    def finish(self) -> Parsed:
        if not self.called:  # an empty answer is a call without arguments
            return Parsed("", tuple(self.pieces(self._name, "{}")))
        return Parsed("")


class RequiredCallsParser(ToolCallParser):
    """The answer is a JSON array of `{"name", "parameters"}`: each element is
    released as a call once it closes; what does not fit that shape is text."""

    def __init__(self, tools: tuple[Tool, ...]) -> None:
        super().__init__(tools)
        self._buffer = ""  # what no element holds yet
        self._opened = False  # past the `[`
        self._element: CallText | None = None  # inside an element: its text so far
        self._text = False  # the answer turned out not to be such an array

    def feed(self, text: str) -> Parsed:
        self._buffer += text
        if self._text:
            return self._as_text()
        calls: list[CallPiece] = []
        while True:
            if self._element is not None:
                closed = self._element.feed(self._buffer)
                self._buffer = ""
                if closed is None:
                    break
                value, self._buffer = closed
                self._element = None
                pieces = self.call(parse_object(value), ("parameters",))
                if pieces is None:
                    self._buffer = value + self._buffer
                    self._text = True
                    return Parsed(self._as_text().text, tuple(calls))
                calls.extend(pieces)
                continue
            stripped = self._buffer.lstrip()
            if not stripped:
                self._buffer = ""
                break
            head = stripped[0]
            if not self._opened and head == "[":
                self._opened, self._buffer = True, stripped[1:]
            elif self._opened and head in ",]":
                self._buffer = stripped[1:]
            elif self._opened and head == "{":
                self._buffer, self._element = stripped, CallText()
            else:
                self._text = True
                return Parsed(self._as_text().text, tuple(calls))
        return Parsed("", tuple(calls))

    def _as_text(self) -> Parsed:
        held = self._element.take() if self._element is not None else ""
        text, self._buffer, self._element = held + self._buffer, "", None
        return Parsed(self.show(text))

    def finish(self) -> Parsed:
        return self._as_text()
