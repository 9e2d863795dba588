"""What the OpenAI-surface suites share: bounded schemas and tools a random model
finishes in a few tokens under guided decoding, and the tool calls of an answer as
the client sees them, whole or put together from a stream."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import jsonschema
import openai

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "celsius": {"type": "boolean"},
    },
    "required": ["city", "celsius"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
TOOLS = [
    {
        "type": "function",
        "function": {"name": name, "description": f"{name} of a place", "parameters": schema},
    }
    for name, schema in SCHEMAS.items()
]
#: Enough for a bounded call or object from a random model under guided decoding.
MAX_TOKENS = 96


class Call:
    """A tool call as the client sees it, whole or put together from a stream."""

    def __init__(self) -> None:
        self.id = ""
        self.name = ""
        self.arguments = ""


def text_of(sdk: openai.OpenAI, body: dict[str, Any], stream: bool) -> tuple[str, str | None]:
    """The text of one chat answer (whole, or its streamed pieces joined) and its finish
    reason."""
    if stream:
        chunks = list(sdk.chat.completions.create(**body, stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    choice = sdk.chat.completions.create(**body).choices[0]
    return choice.message.content or "", choice.finish_reason


def calls_of(
    sdk: openai.OpenAI, body: dict[str, Any], stream: bool
) -> tuple[list[Call], str | None]:
    """The tool calls of one answer and its finish reason."""
    if not stream:
        choice = sdk.chat.completions.create(**body).choices[0]
        calls = []
        for tool_call in choice.message.tool_calls or []:
            call = Call()
            call.id, call.name = tool_call.id, tool_call.function.name
            call.arguments = tool_call.function.arguments
            calls.append(call)
        return calls, choice.finish_reason
    by_index: dict[int, Call] = defaultdict(Call)
    finish = None
    for chunk in sdk.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            for piece in choice.delta.tool_calls or []:
                call = by_index[piece.index]
                if piece.id:
                    assert not call.id, "a call's id comes in its first piece only"
                    call.id = piece.id
                if piece.function and piece.function.name:
                    assert not call.name, "a call's name comes in its first piece only"
                    call.name = piece.function.name
                if piece.function and piece.function.arguments:
                    call.arguments += piece.function.arguments
            finish = choice.finish_reason or finish
    return [by_index[i] for i in sorted(by_index)], finish


def assert_valid(calls: list[Call]) -> None:
    assert calls, "the model made no call"
    for call in calls:
        assert call.id
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
