"""Specs: OpenAI's Responses input-token count (`POST /v1/responses/input_tokens`, the
SDK's `responses.input_tokens.count`) against the real gateway and its demo worker,
which counts a prompt's words as its answers' usage does: the count is the prompt the
same body would send (instructions, tools, a stored conversation), as chat's
`usage.prompt_tokens` reports it; what a count does not take is refused by name; teams
count on their own conversations only, and a count uses no tokens. The counting itself
on each upstream: tests/test_count_tokens.py."""

from __future__ import annotations

import anyio
import httpx
import openai
import orjson
import pytest
import respx

from gateway.edge.responses.params import generate_request, parse
from gateway.upstreams.openai_http import OpenAIHttpUpstream
from tests.support.clients import openai_sdk
from tests.support.keys import bearer, keyed, new_key
from tests.support.metrics import scrape, value
from tests.support.requests import assert_openai_error
from tests.support.servers import DEMO_MODEL
from tests.support.waiting import HANG_GUARD

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
#: The same tool as chat takes it.
CHAT_WEATHER = {
    "type": "function",
    "function": {k: v for k, v in WEATHER.items() if k != "type"},
}
PATH = "/v1/responses/input_tokens"


def test_a_count_is_the_prompt_chat_would_report(api):
    counted = api.responses.input_tokens.count(
        model=DEMO_MODEL,
        instructions="be brief",
        input=[
            {"role": "user", "content": "how is the weather"},
            {"role": "assistant", "content": "ask me"},
            {"role": "user", "content": [{"type": "input_text", "text": "in Paris today"}]},
        ],
        tools=[WEATHER],
        tool_choice="auto",
        parallel_tool_calls=False,
        text={"format": {"type": "json_object"}},
        truncation="disabled",
    )
    assert counted.object == "response.input_tokens"
    chat = api.chat.completions.create(
        model=DEMO_MODEL,
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "how is the weather"},
            {"role": "assistant", "content": "ask me"},
            {"role": "user", "content": "in Paris today"},
        ],
        tools=[CHAT_WEATHER],
        max_tokens=4,
    )
    assert chat.usage is not None
    assert counted.input_tokens == chat.usage.prompt_tokens == 11


def test_a_count_is_the_answers_input_tokens(api):
    body = {"model": DEMO_MODEL, "instructions": "say it", "input": "one two three"}
    counted = api.responses.input_tokens.count(**body)
    answered = api.responses.create(**body)
    assert answered.usage is not None
    assert counted.input_tokens == answered.usage.input_tokens == 5


def test_a_continuation_counts_its_stored_conversation(api):
    first = api.responses.create(model=DEMO_MODEL, input="alpha beta")
    assert first.output_text == "alpha beta"  # the demo echoes
    counted = api.responses.input_tokens.count(
        model=DEMO_MODEL, input="gamma", previous_response_id=first.id
    )
    chat = api.chat.completions.create(
        model=DEMO_MODEL,
        messages=[
            {"role": "user", "content": "alpha beta"},
            {"role": "assistant", "content": "alpha beta"},
            {"role": "user", "content": "gamma"},
        ],
        max_tokens=4,
    )
    answered = api.responses.create(model=DEMO_MODEL, input="gamma", previous_response_id=first.id)
    assert chat.usage is not None and answered.usage is not None
    assert counted.input_tokens == chat.usage.prompt_tokens == answered.usage.input_tokens == 5
    with pytest.raises(openai.NotFoundError) as missing:
        api.responses.input_tokens.count(
            model=DEMO_MODEL, input="gamma", previous_response_id="resp_never"
        )
    assert missing.value.body["code"] == "previous_response_not_found"


def test_a_conversations_items_count_and_the_count_appends_nothing(api):
    conversation = api.conversations.create(
        items=[
            {"type": "message", "role": "user", "content": "alpha beta"},
            {"type": "message", "role": "assistant", "content": "alpha beta"},
        ]
    )
    counted = api.responses.input_tokens.count(
        model=DEMO_MODEL, input="gamma", conversation=conversation.id
    )
    assert len(api.conversations.items.list(conversation.id).data) == 2
    answered = api.responses.create(model=DEMO_MODEL, input="gamma", conversation=conversation.id)
    assert answered.usage is not None
    assert counted.input_tokens == answered.usage.input_tokens == 5
    with pytest.raises(openai.NotFoundError):
        api.responses.input_tokens.count(model=DEMO_MODEL, input="gamma", conversation="conv_x")
    with pytest.raises(openai.BadRequestError) as both:
        api.responses.input_tokens.count(
            model=DEMO_MODEL,
            input="gamma",
            conversation=conversation.id,
            previous_response_id=answered.id,
        )
    assert both.value.body["param"] == "conversation"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"max_output_tokens": 5}, "max_output_tokens"),  # a generation's, not a count's
        ({"stream": True}, "stream"),
        ({"store": False}, "store"),
        ({"background": True}, "background"),
        ({"personality": "friendly"}, "personality"),
        ({"conversation": 123}, "conversation"),
        ({"truncation": "none"}, "truncation"),  # as POST /v1/responses refuses it
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input[0].type"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"reasoning": "high"}, "reasoning"),
        ({"instructions": 3}, "instructions"),
        ({"previous_response_id": ""}, "previous_response_id"),
    ],
)
def test_what_a_count_does_not_take_is_refused_by_name(client, extra, param):
    answer = client.post(PATH, json={"model": DEMO_MODEL, "input": "hi", **extra})
    assert answer.status_code == 400, answer.text
    error = assert_openai_error(answer)
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_refusals_reach_the_sdk_in_openai_shape(api, client):
    with pytest.raises(openai.BadRequestError) as refused:
        api.responses.input_tokens.count(model=DEMO_MODEL, input="hi", personality="friendly")
    assert refused.value.body["param"] == "personality"
    unknown = client.post(PATH, json={"model": DEMO_MODEL, "input": "hi", "temperature": 1})
    error = assert_openai_error(unknown)
    assert (error["param"], error["code"]) == ("temperature", "unknown_parameter")
    not_json = client.post(PATH, json=["not", "an", "object"])
    assert not_json.status_code == 400 and assert_openai_error(not_json)["param"] is None


def test_an_unknown_model_is_a_404_whatever_else_is_wrong(api, client):
    with pytest.raises(openai.NotFoundError) as refused:
        api.responses.input_tokens.count(model="nope", input="hi")
    assert refused.value.body["code"] == "model_not_found"
    answer = client.post(PATH, json={"model": "nope", "input": "hi", "stream": True})
    assert answer.status_code == 404 and assert_openai_error(answer)["code"] == "model_not_found"


def test_a_count_uses_no_tokens_and_is_one_request(api, gateway):
    before = scrape(gateway.url)
    api.responses.input_tokens.count(model=DEMO_MODEL, input="five words are counted here")
    after = scrape(gateway.url)
    tokens = "furnace_gateway_prompt_tokens_total"
    assert value(after, tokens, model=DEMO_MODEL) == value(before, tokens, model=DEMO_MODEL)
    labels = {"model": DEMO_MODEL, "route": PATH, "outcome": "completed", "status": "200"}
    counted = "furnace_gateway_requests_total"
    assert value(after, counted, **labels) == value(before, counted, **labels) + 1


def test_teams_count_with_their_keys_and_their_own_conversations(gateway_with):
    search, ads = new_key("search"), new_key("ads")
    gw = gateway_with(**keyed({"search": {}, "ads": {}}, {search: "search", ads: "ads"}))
    with openai_sdk(gw.url, search) as mine, openai_sdk(gw.url, ads) as theirs:
        first = mine.responses.create(model=DEMO_MODEL, input="secret words")
        counted = mine.responses.input_tokens.count(input="more", previous_response_id=first.id)
        assert counted.input_tokens == 5  # the team's first model: the body named none
        with pytest.raises(openai.NotFoundError) as hidden:
            theirs.responses.input_tokens.count(input="more", previous_response_id=first.id)
        assert hidden.value.body["param"] == "previous_response_id"
        with pytest.raises(openai.AuthenticationError):
            openai_sdk(gw.url, "sk-wrong").responses.input_tokens.count(model=DEMO_MODEL, input="a")
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        assert http.post(PATH, json={"input": "hi"}).status_code == 401
        answer = http.post(PATH, json={"input": "hi there"}, headers=bearer(ads))
        assert answer.json() == {"object": "response.input_tokens", "input_tokens": 2}


@respx.mock
def test_an_openai_server_counts_the_responses_prompt_with_its_tokenize_route():
    """An OpenAI-compatible worker (vLLM's server) is asked `/tokenize` for the prompt
    this route reads: the instructions as the system message, the items, the tools."""
    route = respx.post("http://upstream.test/tokenize").respond(
        200, json={"count": 23, "max_model_len": 1024, "tokens": [1] * 23}
    )
    body = parse(
        {"model": DEMO_MODEL, "instructions": "be brief", "input": "hi", "tools": [WEATHER]}
    )

    async def count() -> int:
        async with httpx.AsyncClient() as http:
            upstream = OpenAIHttpUpstream("http://upstream.test/v1", http, raw_http=False)
            return await upstream.count_tokens(generate_request(body, [], "r", ""), HANG_GUARD)

    assert anyio.run(count) == 23
    sent = orjson.loads(route.calls.last.request.content)
    assert [m["role"] for m in sent["messages"]] == ["system", "user"]
    assert sent["tools"][0]["function"]["name"] == "get_weather"
