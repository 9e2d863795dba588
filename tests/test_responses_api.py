"""Specs: OpenAI's Responses API (`/v1/responses`) through the official `openai` SDK
against the real gateway and its demo worker: whole and streamed answers with the
full event sequence, function calling round trips, structured output, stored
responses (retrieve, input items, delete, `previous_response_id`, on two replicas
sharing a real Redis), one team never seeing another's, the bounds, and what is not
served refused by name in OpenAI's shape.

The demo echoes the last message's words, one token per word (`gateway.worker.demo`),
and calls a tool whose name is a word of the last message."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from gateway.config import ModelConfig, RoutingConfig
from gateway.edge.responses import store as store_module
from gateway.edge.responses.store import Stored
from gateway.worker.demo import DemoEngine
from tests.support.clients import openai_sdk
from tests.support.keys import bearer, keyed, new_key
from tests.support.requests import assert_openai_error
from tests.support.scripted_worker import SCRIPTED_MODEL, script
from tests.support.servers import DEMO_MODEL
from tests.support.waiting import HANG_GUARD

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
#: The stream's events around a message of text, in order.
MESSAGE_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
MESSAGE_END = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


def _kinds(events) -> list[str]:
    return [event.type for event in events]


def _assert_sequenced(events) -> None:
    assert [event.sequence_number for event in events] == list(range(len(events)))


# -- whole and streamed answers ---------------------------------------------------------


def test_a_whole_response(api):
    response = api.responses.create(
        model=DEMO_MODEL,
        input="hello there world",
        instructions="be brief",
        metadata={"ticket": "7"},
        temperature=0.5,
        user="u-1",
        safety_identifier="sid-1",
        max_tool_calls=3,
    )
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.status == "completed" and response.incomplete_details is None
    assert response.output_text == "hello there world"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "completed" and message.id.startswith("msg_")
    assert response.model == DEMO_MODEL
    assert response.instructions == "be brief" and response.metadata == {"ticket": "7"}
    assert response.temperature == 0.5 and response.user == "u-1"
    assert response.safety_identifier == "sid-1" and response.max_tool_calls == 3
    usage = response.usage
    # the demo's prompt counts the words of every message, the instructions' too
    assert usage.input_tokens == 5 and usage.output_tokens == 3 and usage.total_tokens == 8
    # what the demo's prefix cache held of it from the session's earlier prompts (the
    # exact counts: test_cached_tokens.py)
    assert 0 <= usage.input_tokens_details.cached_tokens <= usage.input_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0


def test_a_streamed_response_sends_the_full_event_sequence(api):
    with api.responses.stream(model=DEMO_MODEL, input="one two three") as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = _kinds(events)
    assert kinds[:4] == MESSAGE_EVENTS
    # one delta per batch the worker sent (it may send several tokens in one)
    assert kinds[4:-4] and set(kinds[4:-4]) == {"response.output_text.delta"}
    assert kinds[-4:] == [*MESSAGE_END, "response.completed"]
    _assert_sequenced(events)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
        "one two three"
    )
    assert events[0].response.status == "in_progress"
    assert final.status == "completed" and final.output_text == "one two three"
    assert final.usage.output_tokens == 3
    assert final.id == events[0].response.id


@pytest.mark.parametrize("stream", [False, True])
def test_max_output_tokens_makes_an_incomplete_response(api, stream):
    body = {"model": DEMO_MODEL, "input": "a b c d e f", "max_output_tokens": 2}
    if stream:
        events = list(api.responses.create(**body, stream=True))
        assert events[-1].type == "response.incomplete"
        _assert_sequenced(events)
        response = events[-1].response
    else:
        response = api.responses.create(**body)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "a b"
    assert response.output[0].status == "incomplete"


def test_a_worker_failing_mid_stream_ends_it_with_error_and_response_failed(api):
    script = json.dumps({"texts": 2, "status": "INTERNAL"})
    events = list(api.responses.create(model=SCRIPTED_MODEL, input=script, stream=True))
    kinds = _kinds(events)
    assert kinds[-2:] == ["error", "response.failed"]
    _assert_sequenced(events)
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "engine_error"
    assert failed.output[0].status == "incomplete"  # what was said before the failure
    # a failure before the first event is a real status
    with pytest.raises(openai.InternalServerError):
        api.responses.create(model=SCRIPTED_MODEL, input=json.dumps({"status": "INTERNAL"}))


@pytest.mark.parametrize("plan", [{"hang": "after"}, {"status": "INTERNAL"}])
def test_a_stream_failing_before_its_first_text_still_opens_the_response(gateway_with, plan):
    """A timeout or a worker's failure after the head but before any text: the held
    opening goes out before the failure, so the SDK's stream reads it (it raised on an
    `output_text.done` before `response.created`); no item was opened (an item opens
    with its first text or reasoning), so none is closed."""
    gw = gateway_with(request_timeout=0.5)
    prompt = script(started=True, **plan)
    with (
        openai_sdk(gw.url) as api,
        api.responses.stream(model=SCRIPTED_MODEL, input=prompt) as stream,
    ):
        events = list(stream)
    assert _kinds(events) == [*MESSAGE_EVENTS[:2], "error", "response.failed"]
    _assert_sequenced(events)
    failed = events[-1].response
    assert failed.status == "failed" and failed.output == []
    assert failed.id == events[0].response.id


# -- tools and formats ----------------------------------------------------------------


def test_a_function_calling_round_trip(api):
    first = api.responses.create(
        model=DEMO_MODEL, input="call get_weather for Paris", tools=[WEATHER]
    )
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert json.loads(call.arguments) == {"city": ""}  # the demo's minimal instance
    assert first.tools[0].name == "get_weather" and first.tools[0].strict is True
    # continued from the store: only the tool's output is new
    second = api.responses.create(
        model=DEMO_MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[WEATHER],
    )
    assert second.output_text == "sunny" and second.previous_response_id == first.id
    # and without the store: the whole conversation in the input
    stateless = api.responses.create(
        model=DEMO_MODEL,
        store=False,
        input=[
            {"role": "user", "content": "call get_weather for Paris"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "cloudy"},
        ],
        tools=[WEATHER],
    )
    assert stateless.output_text == "cloudy"
    assert stateless.usage.input_tokens == second.usage.input_tokens


def test_a_streamed_function_call(api):
    with api.responses.stream(
        model=DEMO_MODEL, input="get_weather please", tools=[WEATHER], tool_choice="required"
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = _kinds(events)
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert "response.function_call_arguments.delta" in kinds
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    _assert_sequenced(events)
    [call] = final.output
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == call.arguments and json.loads(call.arguments) == {"city": ""}
    assert final.tool_choice == "required"


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_call_cut_by_max_output_tokens_is_incomplete(api, stream):
    """A call cut off mid-arguments (not valid JSON) is `incomplete`, as OpenAI marks it,
    alike in the stream's `output_item.done`, the whole answer and the stored one."""
    body = {"model": DEMO_MODEL, "input": "get_weather now", "tools": [WEATHER]}
    if stream:
        events = list(api.responses.create(**body, max_output_tokens=1, stream=True))
        [done] = [e for e in events if e.type == "response.output_item.done"]
        assert done.item.status == "incomplete"
        response = events[-1].response
    else:
        response = api.responses.create(**body, max_output_tokens=1)
    assert response.status == "incomplete"
    [call] = response.output
    assert call.type == "function_call" and call.status == "incomplete"
    with pytest.raises(ValueError):
        json.loads(call.arguments)
    assert api.responses.retrieve(response.id).output[0].status == "incomplete"
    # one that ends whole is still completed
    whole = api.responses.create(**body)
    assert whole.output[0].status == "completed" and json.loads(whole.output[0].arguments)


def test_json_schema_output(api):
    response = api.responses.create(
        model=DEMO_MODEL,
        input="who is it",
        text={
            "format": {"type": "json_schema", "name": "person", "schema": SCHEMA, "strict": True}
        },
    )
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    assert response.text.format.type == "json_schema" and response.text.format.name == "person"
    json_object = api.responses.create(
        model=DEMO_MODEL, input="json please", text={"format": {"type": "json_object"}}
    )
    assert json.loads(json_object.output_text) == {}


def test_vllms_structured_outputs_are_served_as_on_chat(api):
    """vLLM's `structured_outputs`, which its Responses server takes too: the demo answers
    the choice its input holds; with `text.format`, or a constraint the model's workers do
    not list, a 400 naming it."""
    choices = {"structured_outputs": {"choice": ["sunny", "rainy"]}}
    response = api.responses.create(model=DEMO_MODEL, input="is it rainy", extra_body=choices)
    assert response.output_text == "rainy"
    for extra, text, named in (
        (choices, {"format": {"type": "json_object"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "[a-z]+"}}, None, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": "sunny"}}, None, "structured_outputs.choice"),
    ):
        asked = {"text": text} if text else {}
        with pytest.raises(openai.BadRequestError) as refused:
            api.responses.create(model=DEMO_MODEL, input="x", extra_body=extra, **asked)
        assert refused.value.body["param"] == named


def test_vllms_sampling_extras_are_served_or_refused_by_name(api):
    """vLLM's Responses server takes chat's sampling and reasoning extras: served as on
    chat (`stop` ends the echo; `seed`, `top_k` taken), refused by name where the model's
    workers do not list them (`min_p` on the demo) or the gateway does not serve them."""
    cut = api.responses.create(
        model=DEMO_MODEL, input="one two three four", extra_body={"stop": ["three"], "seed": 3}
    )
    assert cut.output_text == "one two "
    kept = api.responses.create(
        model=DEMO_MODEL,
        input="one two three four",
        extra_body={"stop": ["three"], "include_stop_str_in_output": True},
    )
    assert kept.output_text == "one two three"
    assert (
        api.responses.create(
            model=DEMO_MODEL, input="a b", extra_body={"top_k": 5, "min_tokens": 1}
        ).output_text
        == "a b"
    )
    for extra, named in (
        ({"min_p": 0.5}, "min_p"),
        ({"chat_template_kwargs": {"x": 1}}, "chat_template_kwargs"),
        ({"top_k": "x"}, "top_k"),
        ({"stop": 5}, "stop"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
        ({"priority": 3}, "priority"),
        ({"request_id": "mine"}, "request_id"),
        ({"thinking_token_budget": 10}, "thinking_token_budget"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            api.responses.create(model=DEMO_MODEL, input="x", extra_body=extra)
        assert refused.value.body["param"] == named, extra


# -- stored responses -------------------------------------------------------------------


def test_retrieve_input_items_and_delete(api):
    created = api.responses.create(
        model=DEMO_MODEL,
        input=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "input_text", "text": "hi you"}]},
        ],
    )
    again = api.responses.retrieve(created.id)
    assert again.model_dump() == created.model_dump()
    items = api.responses.input_items.list(created.id, order="asc")
    assert [item.role for item in items.data] == ["developer", "user"]
    assert items.data[1].content[0].text == "hi you"
    assert items.first_id == items.data[0].id and not items.has_more
    newest = api.responses.input_items.list(created.id, limit=1)
    assert [item.role for item in newest.data] == ["user"] and newest.has_more
    api.responses.delete(created.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.delete(created.id)


def test_input_items_keep_the_ids_they_were_given(api, client):
    """An agent sends back an answer's items with their ids: the store keeps them, and
    gives new ids only to items sent without one; a bad or repeated id is refused."""
    given = [
        {"type": "message", "id": "msg_mine", "role": "user", "content": "call f"},
        {"type": "function_call", "id": "fc_mine", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "done"},
    ]
    created = api.responses.create(model=DEMO_MODEL, input=given)
    ids = [item.id for item in api.responses.input_items.list(created.id, order="asc").data]
    assert ids[:2] == ["msg_mine", "fc_mine"] and ids[2].startswith("fco_")
    for items, param in (
        ([{**given[0], "id": 7}], "input[0].id"),
        ([{**given[0], "id": ""}], "input[0].id"),
        ([given[0], {**given[0], "content": "again"}], "input[1].id"),
    ):
        answer = client.post("/v1/responses", json={"model": DEMO_MODEL, "input": items})
        assert answer.status_code == 400 and assert_openai_error(answer)["param"] == param


def test_an_unstored_response_cannot_be_read_or_continued(api):
    created = api.responses.create(model=DEMO_MODEL, input="x y", store=False)
    assert created.store is False
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(created.id)
    with pytest.raises(openai.NotFoundError) as refused:
        api.responses.create(model=DEMO_MODEL, input="z", previous_response_id=created.id)
    assert refused.value.body["param"] == "previous_response_id"


def test_an_item_reference_reads_the_stored_item(api, client):
    """`item_reference` (what the Vercel AI SDK sends for an earlier step's items, `store`
    being its default): the output item is read from the stored response that holds it,
    as if sent whole: the same prompt, and the turn's stored input holds the item."""
    weather = {"type": "function", "name": "weather", "parameters": {"type": "object"}}
    first = api.responses.create(
        model=DEMO_MODEL, input="weather now", tools=[weather], reasoning={"effort": "low"}
    )
    thought, call = first.output
    assert (thought.type, call.type) == ("reasoning", "function_call")
    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    refs = [{"type": "item_reference", "id": thought.id}, {"type": "item_reference", "id": call.id}]
    whole = [thought.model_dump(exclude_none=True), call.model_dump(exclude_none=True)]
    body = {"model": DEMO_MODEL, "tools": [weather], "reasoning": {"effort": "low"}}
    asked = {"role": "user", "content": "weather now"}
    turns = [
        client.post("/v1/responses", json={**body, "input": [asked, *sent, answer]})
        for sent in (refs, whole)
    ]
    assert [turn.status_code for turn in turns] == [200, 200], [turn.text for turn in turns]
    referenced, sent_whole = (turn.json() for turn in turns)
    assert referenced["output"][-1]["content"][0]["text"] == "sunny"
    # the same prompt (what the engine's prefix cache held of it apart)
    assert referenced["usage"]["input_tokens"] == sent_whole["usage"]["input_tokens"]
    items = api.responses.input_items.list(referenced["id"], order="asc").data
    assert [item.id for item in items[1:3]] == [thought.id, call.id]
    assert items[1].type == "reasoning" and items[2].name == "weather"
    counted = [
        client.post(
            "/v1/responses/input_tokens", json={**body, "input": [asked, *sent, answer]}
        ).json()["input_tokens"]
        for sent in (refs, whole)
    ]
    assert counted[0] == counted[1] == referenced["usage"]["input_tokens"]


def test_an_item_reference_to_nothing_stored_is_openais_404(api, client):
    """A reference to an item no stored response of the team holds (an unstored
    response's, one that never was, one that is not an output item's id) is OpenAI's
    404, naming it."""
    unstored = api.responses.create(model=DEMO_MODEL, input="x y", store=False)
    stored = api.responses.create(model=DEMO_MODEL, input="x y")
    never = stored.output[0].id[:-4] + "0001"  # the response has no second item
    for item_id in (unstored.output[0].id, never, "msg_mine", stored.id):
        refs = [{"type": "message", "role": "user", "content": "hi"}]
        refs.append({"type": "item_reference", "id": item_id})
        answer = client.post("/v1/responses", json={"model": DEMO_MODEL, "input": refs})
        assert answer.status_code == 404, answer.text
        error = assert_openai_error(answer)
        assert error["param"] == "input[1].id"
        assert error["message"].startswith(f"Item with id '{item_id}' not found.")


def test_an_item_reference_names_at_most_the_deepest_conversation(gateway_with):
    gw = gateway_with(responses_max_depth=2)
    refs = [{"type": "item_reference", "id": f"msg_{n:048x}0000"} for n in range(3)]
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        answer = http.post("/v1/responses", json={"model": DEMO_MODEL, "input": refs})
    assert answer.status_code == 400 and assert_openai_error(answer)["param"] == "input"


def test_a_streamed_response_is_stored(api):
    with api.responses.stream(model=DEMO_MODEL, input="kept words") as stream:
        final = stream.get_final_response()
    assert api.responses.retrieve(final.id).output_text == "kept words"


def test_a_conversation_continues_on_another_replica_sharing_redis(gateway_with, redis_server):
    one = gateway_with(redis_url=redis_server.url, redis_timeout=2.0)
    two = gateway_with(redis_url=redis_server.url, redis_timeout=2.0)
    with openai_sdk(one.url) as first_client, openai_sdk(two.url) as second_client:
        first = first_client.responses.create(model=DEMO_MODEL, input="alpha beta")
        assert second_client.responses.retrieve(first.id).output_text == "alpha beta"
        with second_client.responses.stream(
            model=DEMO_MODEL, input="gamma", previous_response_id=first.id
        ) as stream:
            second = stream.get_final_response()
        assert second.output_text == "gamma"
        # the conversation so far was in the prompt: 2 + 2 + 1 words
        assert second.usage.input_tokens == 5
        third = first_client.responses.create(
            model=DEMO_MODEL, input="delta", previous_response_id=second.id
        )
        assert third.usage.input_tokens == 7  # and 1 + 1 more
        items = first_client.responses.input_items.list(third.id)
        assert [item.content[0].text for item in items.data] == ["delta"]


def test_a_lost_redis_is_a_503_for_reads_and_answers_still_come(gateway_with, redis_server):
    gw = gateway_with(redis_url=redis_server.url, redis_timeout=0.2)
    with openai_sdk(gw.url) as api, httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        kept = api.responses.create(model=DEMO_MODEL, input="kept")
        redis_server.stop()
        for answer in (
            http.get(f"/v1/responses/{kept.id}"),
            http.delete(f"/v1/responses/{kept.id}"),
            http.post(
                "/v1/responses",
                json={"model": DEMO_MODEL, "input": "more", "previous_response_id": kept.id},
            ),
        ):
            assert answer.status_code == 503, answer.text
            assert assert_openai_error(answer)["type"] == "server_error"
        # storing fails after the answer: it is served all the same
        assert api.responses.create(model=DEMO_MODEL, input="served").output_text == "served"


def test_a_conversation_stays_on_the_worker_of_its_first_turn(gateway_with, serve_engines):
    engines = [DemoEngine(max_context=4096), DemoEngine(max_context=4096)]
    servers = serve_engines(*engines)
    # round robin would alternate the turns between the two workers
    routing = RoutingConfig(policy="round_robin")
    model = ModelConfig(DEMO_MODEL, workers=tuple(s.address for s in servers), routing=routing)
    gw = gateway_with(models=(model,))
    with openai_sdk(gw.url) as api:
        for conversation in range(2):
            turn = api.responses.create(model=DEMO_MODEL, input=f"start {conversation}")
            before = [engine.calls for engine in engines]
            for _ in range(3):
                turn = api.responses.create(
                    model=DEMO_MODEL, input="more", previous_response_id=turn.id
                )
            moved = [engine.calls - was for engine, was in zip(engines, before, strict=True)]
            assert sorted(moved) == [0, 3], moved
        # a first turn with an x-session-id keeps that key for its conversation
        headers = {"x-session-id": "my-conversation"}
        first = api.responses.create(model=DEMO_MODEL, input="a", extra_headers=headers)
        before = [engine.calls for engine in engines]
        api.responses.create(model=DEMO_MODEL, input="b", previous_response_id=first.id)
        api.responses.create(model=DEMO_MODEL, input="c", extra_headers=headers)
        moved = [engine.calls - was for engine, was in zip(engines, before, strict=True)]
        assert sorted(moved) == [0, 2], moved


def test_another_teams_response_is_not_found(gateway_with):
    search, ads = new_key("search"), new_key("ads")
    gw = gateway_with(**keyed({"search": {}, "ads": {}}, {search: "search", ads: "ads"}))
    with openai_sdk(gw.url, search) as mine, openai_sdk(gw.url, ads) as theirs:
        created = mine.responses.create(model=DEMO_MODEL, input="secret words")
        assert mine.responses.retrieve(created.id).id == created.id
        with pytest.raises(openai.NotFoundError):
            theirs.responses.retrieve(created.id)
        with pytest.raises(openai.NotFoundError):
            theirs.responses.input_items.list(created.id)
        with pytest.raises(openai.NotFoundError):
            theirs.responses.delete(created.id)
        with pytest.raises(openai.NotFoundError):
            theirs.responses.create(model=DEMO_MODEL, input="x", previous_response_id=created.id)
        reference = [{"type": "item_reference", "id": created.output[0].id}]
        with pytest.raises(openai.NotFoundError):
            theirs.responses.create(model=DEMO_MODEL, input=reference)
        assert mine.responses.retrieve(created.id).output_text == "secret words"


# -- bounds -------------------------------------------------------------------------------


def test_the_store_keeps_the_newest_per_team(gateway_with):
    gw = gateway_with(responses_per_team=2)
    with openai_sdk(gw.url) as api:
        ids = [api.responses.create(model=DEMO_MODEL, input=f"w{i}").id for i in range(3)]
        with pytest.raises(openai.NotFoundError):
            api.responses.retrieve(ids[0])
        assert [api.responses.retrieve(i).id for i in ids[1:]] == ids[1:]


def test_the_memory_store_bounds_a_teams_bytes(monkeypatch):
    def stored(n: int) -> Stored:
        return Stored({"id": f"resp_{n}", "output": []}, [{"text": "x" * 100}])

    size = len(stored(0).dumps())
    monkeypatch.setattr(store_module, "MEMORY_BYTES_PER_TEAM", 2 * size)
    memory = store_module.MemoryResponses(ttl=60, per_team=100)

    async def run() -> list[bool]:
        for n in range(3):
            await memory.put("search", stored(n))
        await memory.put("ads", stored(9))  # another team's bytes are its own
        return [await memory.get("search", f"resp_{n}") is not None for n in range(3)]

    assert asyncio.run(run()) == [False, True, True]


def test_conversation_depth_and_items_are_bounded(gateway_with):
    gw = gateway_with(responses_max_depth=2, max_messages=3)
    with openai_sdk(gw.url) as api:
        first = api.responses.create(model=DEMO_MODEL, input="a")
        second = api.responses.create(model=DEMO_MODEL, input="b", previous_response_id=first.id)
        with pytest.raises(openai.BadRequestError) as deep:
            api.responses.create(model=DEMO_MODEL, input="c", previous_response_id=second.id)
        assert deep.value.body["param"] == "previous_response_id"
        with pytest.raises(openai.BadRequestError) as many:
            api.responses.create(model=DEMO_MODEL, input=[{"role": "user", "content": "x"}] * 4)
        assert many.value.body["param"] == "input"


# -- refusals -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
        ({"truncation": "none"}, "truncation"),  # "auto": test_responses_truncation.py
        # `include`'s values other than the encrypted reasoning and the text's logprobs
        ({"include": ["file_search_call.results"]}, "include"),
        ({"include": "reasoning.encrypted_content"}, "include"),
        ({"reasoning": {"summary": "brief"}}, "reasoning.summary"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"conversation": 7}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"moderation": {"input": True}}, "moderation"),
        ({"max_tool_calls": -1}, "max_tool_calls"),
        ({"safety_identifier": "s" * 257}, "safety_identifier"),
        ({"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
        ({"prompt_cache_options": {"ttl": "1h"}}, "prompt_cache_options"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format"),
        ({"temperature": 3}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"metadata": {"k": 1}}, "metadata"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
        ({"input": [{"type": "item_reference"}]}, "input[0].id"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input[0].content[0]"),
        ({"input": []}, "input"),
        ({"store": "yes"}, "store"),
        (
            {"stream": True, "stream_options": {"include_usage": True}},
            "stream_options.include_usage",
        ),
        (
            {"stream": True, "stream_options": {"include_obfuscation": "yes"}},
            "stream_options.include_obfuscation",
        ),
    ],
)
def test_what_is_not_served_is_refused_by_name(client, extra, param):
    answer = client.post("/v1/responses", json={"model": DEMO_MODEL, "input": "hi", **extra})
    assert answer.status_code == 400, answer.text
    assert assert_openai_error(answer)["param"] == param


def test_the_checks_shared_with_chat_name_this_apis_parameters(gateway_with, workers):
    capped = ModelConfig(DEMO_MODEL, workers=(workers.demo.address,), max_tokens_limit=4)
    gw = gateway_with(models=(capped,))
    image = {"type": "input_image", "image_url": "https://example.com/a.png"}
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        for body, param in (
            # the demo's workers do not take images (the model's features)
            ({"input": [{"role": "user", "content": [image]}]}, "input"),
            # the model's cap on max_tokens (the input limits)
            ({"input": "hi", "max_output_tokens": 5}, "max_output_tokens"),
        ):
            answer = http.post("/v1/responses", json={"model": DEMO_MODEL, **body})
            assert answer.status_code == 400, answer.text
            error = assert_openai_error(answer)
            assert error["param"] == param and "max_tokens'" not in error["message"]


def test_store_reads_refuse_bad_queries(client, api):
    created = api.responses.create(model=DEMO_MODEL, input="q")
    for query, param in (("limit=0", "limit"), ("order=up", "order"), ("after=nope", "after")):
        answer = client.get(f"/v1/responses/{created.id}/input_items?{query}")
        assert answer.status_code == 400 and assert_openai_error(answer)["param"] == param
    answer = client.get(f"/v1/responses/{created.id}?stream=true")
    assert answer.status_code == 400 and assert_openai_error(answer)["param"] == "stream"
    # a bracketed name is the name: served, or refused, not passed over
    answer = client.get(f"/v1/responses/{created.id}/input_items?limit[]=0")
    assert answer.status_code == 400 and assert_openai_error(answer)["param"] == "limit"


def test_store_reads_take_bracketed_page_names(client, api):
    """`limit[]=1&order[]=asc` pages as `limit=1&order=asc` does."""
    created = api.responses.create(
        model=DEMO_MODEL,
        input=[
            {"role": "user", "content": "first"},
            {"role": "user", "content": "second"},
        ],
    )
    answer = client.get(f"/v1/responses/{created.id}/input_items?limit[]=1&order[]=asc")
    assert answer.status_code == 200, answer.text
    page = answer.json()
    assert len(page["data"]) == 1 and page["has_more"] is True
    assert page["data"][0]["content"][0]["text"] == "first"


def test_store_reads_take_the_sdks_include_brackets_as_include(api):
    """The SDK sends a list as `include[]=...`: refused by name like `include=...`, not
    served as if nothing was asked."""
    created = api.responses.create(model=DEMO_MODEL, input="q")
    include = ["message.output_text.logprobs"]
    with pytest.raises(openai.BadRequestError) as refused:
        api.responses.retrieve(created.id, include=include)
    assert refused.value.body["param"] == "include"
    with pytest.raises(openai.BadRequestError) as refused:
        api.responses.input_items.list(created.id, include=include)
    assert refused.value.body["param"] == "include"


def test_an_unknown_model_is_a_404_in_openai_shape(client):
    answer = client.post("/v1/responses", json={"model": "nope", "input": "hi"})
    assert answer.status_code == 404
    assert assert_openai_error(answer)["code"] == "model_not_found"


def test_a_keyed_gateway_refuses_without_a_key(gateway_with):
    key = new_key("search")
    gw = gateway_with(**keyed({"search": {}}, {key: "search"}))
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        assert http.post("/v1/responses", json={"input": "hi"}).status_code == 401
        assert http.get("/v1/responses/resp_x").status_code == 401
        served = http.post("/v1/responses", json={"input": "hi"}, headers=bearer(key))
        assert served.status_code == 200 and served.json()["model"] == DEMO_MODEL
