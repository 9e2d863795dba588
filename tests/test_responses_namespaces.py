"""Specs: the Responses API's `namespace` tools (OpenAI's grouping of function tools, as
Codex sends its sub-agent tools) and `client_metadata`, through the official `openai` SDK
against the real gateway and its demo worker.

A namespace's functions reach the model flattened, as `namespace__name`, the namespace's
description before each one's own; the model's call comes back by its own `name` and its
`namespace`, whole and streamed, and a call sent back with its `namespace` is the
flattened name in the prompt again. The demo calls a tool whose name is a word of the last
message, and otherwise echoes it."""

from __future__ import annotations

import json

import pytest

from gateway.edge.responses.params import MAX_CLIENT_METADATA_VALUE, messages_of, parse
from tests.support.requests import assert_openai_error
from tests.support.servers import DEMO_MODEL

LOOKUP = {
    "type": "function",
    "name": "lookup",
    "description": "Look a customer up.",
    "parameters": {
        "type": "object",
        "properties": {"customer": {"type": "string"}},
        "required": ["customer"],
        "additionalProperties": False,
    },
    "strict": False,
}
CRM = {"type": "namespace", "name": "crm", "description": "The CRM's tools.", "tools": [LOOKUP]}
#: What Codex sends as its `client_metadata`: its ids, one of them a JSON object of its
#: turn's (about 750 characters, more with longer ids).
CODEX_METADATA = {
    "session_id": "01a244e7-d1dc-72f0-87f0-eebd38d1969f",
    "x-codex-turn-metadata": json.dumps({f"field_{i}": "x" * 36 for i in range(20)}),
}


def test_a_namespaces_functions_reach_the_model_flattened_with_its_description():
    body = parse({"model": DEMO_MODEL, "input": "hi", "tools": [CRM, {**LOOKUP, "name": "other"}]})
    flat, other = body.tools
    assert flat.name == "crm__lookup"
    assert flat.description == "The CRM's tools.\n\nLook a customer up."
    assert other.name == "other" and other.description == "Look a customer up."
    assert body.namespaced == {"crm__lookup": ("crm", "lookup")}


def test_a_call_of_a_namespaced_function_comes_back_by_its_name_and_namespace(api):
    answer = api.responses.create(model=DEMO_MODEL, input="crm__lookup Ada", tools=[CRM])
    [call] = answer.output
    assert call.type == "function_call"
    assert (call.name, call.namespace) == ("lookup", "crm")
    assert json.loads(call.arguments) == {"customer": ""}  # the demo's minimal instance
    # the response shows the tools as they were given
    [tool] = answer.tools
    assert tool.type == "namespace" and tool.name == "crm" and tool.tools[0].name == "lookup"
    # continued from the store: the stored call is the flat name in the prompt again
    second = api.responses.create(
        model=DEMO_MODEL,
        previous_response_id=answer.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "found"}],
        tools=[CRM],
    )
    assert second.output_text == "found"


def test_a_streamed_call_of_a_namespaced_function(api):
    with api.responses.stream(model=DEMO_MODEL, input="crm__lookup", tools=[CRM]) as stream:
        events = list(stream)
        final = stream.get_final_response()
    added = next(e for e in events if e.type == "response.output_item.added")
    assert (added.item.name, added.item.namespace) == ("lookup", "crm")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.name == "lookup"
    [call] = final.output
    assert (call.name, call.namespace) == ("lookup", "crm")


def test_history_with_a_namespaced_call_is_served_statelessly(api):
    """Codex's way: `store: false`, its whole history sent back, calls with their
    namespace."""
    history = [
        {"role": "user", "content": "crm__lookup Ada"},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "lookup",
            "namespace": "crm",
            "arguments": '{"customer": "Ada"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "Ada Lovelace"},
    ]
    answer = api.responses.create(model=DEMO_MODEL, store=False, input=history, tools=[CRM])
    assert answer.output_text == "Ada Lovelace"
    # the prompt names the call as the tools do
    messages = messages_of(parse({"model": DEMO_MODEL, "input": history}).items)
    assert messages[1].tool_calls[0].name == "crm__lookup"


def test_client_metadata_is_taken_and_not_repeated(api):
    answer = api.responses.create(
        model=DEMO_MODEL, input="hello", extra_body={"client_metadata": CODEX_METADATA}
    )
    assert answer.output_text == "hello"
    assert "client_metadata" not in answer.model_dump()


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        # a flat name taken by another function: the 400 names the later one
        ({"tools": [{**LOOKUP, "name": "crm__lookup"}, CRM]}, "tools[1].tools[0].name"),
        ({"tools": [CRM, CRM]}, "tools[1].tools[0].name"),
        (
            {"tools": [{**CRM, "tools": [{"type": "custom", "name": "x"}]}]},
            "tools[0].tools[0].type",
        ),
        ({"tools": [{**CRM, "tools": []}]}, "tools[0].tools"),
        ({"tools": [{**CRM, "name": "c.r.m"}]}, "tools[0].name"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        (
            {
                "input": [
                    {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}
                    | {"namespace": 7}
                ]
            },
            "input[0].namespace",
        ),
        ({"client_metadata": {"k": 1}}, "client_metadata"),
        ({"client_metadata": {"k": "v" * (MAX_CLIENT_METADATA_VALUE + 1)}}, "client_metadata"),
        ({"client_metadata": {f"k{i}": "v" for i in range(17)}}, "client_metadata"),
    ],
)
def test_what_is_not_served_is_refused_by_name(client, extra, param):
    body = {"model": DEMO_MODEL, "input": "hi", **extra}
    answer = client.post("/v1/responses", json=body)
    assert answer.status_code == 400, answer.text
    assert assert_openai_error(answer)["param"] == param
