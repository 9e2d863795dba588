"""The Responses API on every kind of worker behind the gateway (tests/support/
conformance.py lists them), through the official SDK, whole and streamed: an answer
with its usage, a required function call whose arguments follow their schema, a
json_schema answer that validates, and a conversation continued from the store.

The route turns each into the same GenerateRequest as chat completions, so what a
kind serves for chat it serves here; a real engine's text is junk, so only the
demo's (which echoes) is compared."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.support.conformance import Engine, greedy
from tests.support.surface import MAX_TOKENS, SCHEMAS, TOOLS, WEATHER

#: The surface suite's tools in the Responses API's (flat) shape.
FLAT_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]


def budget(engine: Engine) -> int:
    return min(MAX_TOKENS, engine.max_context - 24)


def _answer(sdk, body, stream):
    if not stream:
        return sdk.responses.create(**body), []
    with sdk.responses.stream(**body) as events:
        seen = list(events)
    # the last event carries the response: response.completed, or response.incomplete
    # (a real engine's answer cut at max_output_tokens), which the SDK's
    # get_final_response() does not take
    assert seen and seen[-1].type in ("response.completed", "response.incomplete"), seen[-1:]
    return seen[-1].response, seen


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_answer_with_its_usage(sdk, engine: Engine, stream):
    body = greedy(engine, input="one two three", max_output_tokens=8)
    response, events = _answer(sdk, body, stream)
    assert response.status in ("completed", "incomplete")
    assert response.usage.input_tokens > 0 and 0 < response.usage.output_tokens <= 8
    if engine.echoes:
        assert response.output_text == "one two three"
    if stream:
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[-1].type in ("response.completed", "response.incomplete")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_required_function_call_follows_its_schema(sdk, engine: Engine, stream):
    body = greedy(
        engine,
        input="what is the weather in Paris",
        tools=FLAT_TOOLS,
        tool_choice="required",
        max_output_tokens=budget(engine),
    )
    response, _ = _answer(sdk, body, stream)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls
    for call in calls:
        if call.status == "completed" and response.status == "completed":
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_json_schema_answer_validates(sdk, engine: Engine, stream):
    body = greedy(
        engine,
        input="describe the weather as JSON",
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER}},
        max_output_tokens=budget(engine),
    )
    response, _ = _answer(sdk, body, stream)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), WEATHER)


def test_a_conversation_continues_from_the_store(sdk, engine: Engine):
    first = sdk.responses.create(**greedy(engine, input="alpha beta", max_output_tokens=4))
    second = sdk.responses.create(
        **greedy(engine, input="gamma", previous_response_id=first.id, max_output_tokens=4)
    )
    assert second.previous_response_id == first.id
    # the first turn's input and output are in the second's prompt
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    if engine.echoes:
        assert second.output_text == "gamma"
