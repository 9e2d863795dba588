"""Specs: the Responses API's `truncation: "auto"` through the official `openai` SDK
against the real gateway and its demo worker: an input too long for the model's context
is answered with items dropped from its beginning (never the instructions or system
messages, never a function call without its output, never the last user turn), a
`previous_response_id` chain is cut the same way and stored whole, `disabled` (the
default) is still a 400, and a model whose context is unknown, or whose server cannot
count, refuses it by name. The counting itself: gateway/edge/responses/truncation.py.

The demo's context is 64 tokens; its tokens are words (every message's), and it echoes
the last message (`gateway.worker.demo`), so an answer's usage shows the prompt sent."""

from __future__ import annotations

import time

import openai
import pytest
from starlette.responses import JSONResponse

from gateway.config import ModelConfig
from gateway.edge.responses.truncation import cut_points, kept
from tests.support.clients import openai_sdk
from tests.support.openai_server import OpenAIServer
from tests.support.servers import DEMO_MODEL
from tests.support.waiting import HANG_GUARD

KEY_ENV = "FURNACE_TEST_TRUNCATION_KEY"


def words(tag: str, n: int) -> str:
    """`n` distinct words: tag0 tag1 ..."""
    return " ".join(f"{tag}{i}" for i in range(n))


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


#: 2 + 30 + 20 + 20 + 5 + 3 words, and the instructions' 2: 82, past the demo's 64.
LONG = [
    {"role": "developer", "content": "be formal"},
    user(words("a", 30)),
    assistant(words("b", 20)),
    user(words("c", 20)),
    assistant(words("d", 5)),
    user("the last words"),
]


@pytest.fixture
def counts(workers, monkeypatch) -> list[int]:
    """The prompts the demo worker counted (their tokens), in order."""
    engine = workers.demo_engine
    counted: list[int] = []
    count_tokens = engine.count_tokens

    async def counting(request):
        tokens = await count_tokens(request)
        counted.append(tokens)
        return tokens

    monkeypatch.setattr(engine, "count_tokens", counting)
    return counted


def test_an_input_too_long_is_answered_with_its_oldest_items_dropped(api, counts):
    response = api.responses.create(
        model=DEMO_MODEL, instructions="be brief", input=LONG, truncation="auto"
    )
    assert response.status == "completed" and response.truncation == "auto"
    assert response.output_text == "the last words"
    # sent: the instructions, the developer message, then from the second user turn on
    assert response.usage.input_tokens == 2 + 2 + 20 + 5 + 3
    assert counts == [82, 32]  # the whole prompt, then the cut it estimated
    # the stored input is what was sent by the client, whole
    items = api.responses.input_items.list(response.id, order="asc").data
    assert [item.content[0].text for item in items] == [item["content"] for item in LONG]


def test_disabled_is_still_a_400(api):
    for extra in ({}, {"truncation": "disabled"}):
        with pytest.raises(openai.BadRequestError) as refused:
            api.responses.create(model=DEMO_MODEL, instructions="be brief", input=LONG, **extra)
        assert refused.value.body["code"] == "context_length_exceeded"
        assert refused.value.body["param"] == "input"


def test_a_prompt_that_fits_is_sent_whole_after_one_count(api, counts):
    response = api.responses.create(
        model=DEMO_MODEL,
        input=[user("one two"), assistant("three"), user("four")],
        truncation="auto",
    )
    assert response.output_text == "four" and response.usage.input_tokens == 4
    assert response.truncation == "auto" and counts == [4]


def test_the_answers_room_is_kept_for_max_output_tokens(api):
    body = [user(words("a", 30)), assistant(words("b", 5)), user(words("c", 15))]
    # 50 tokens leave 14 for the answer: with 20 asked, the first turn is dropped
    response = api.responses.create(
        model=DEMO_MODEL, input=body, truncation="auto", max_output_tokens=20
    )
    assert response.usage.input_tokens == 15 and response.status == "completed"
    assert response.output_text == words("c", 15)
    # without it, one token of room is all the worker's check wants: sent whole
    whole = api.responses.create(model=DEMO_MODEL, input=body, truncation="auto")
    assert whole.usage.input_tokens == 50


def test_a_previous_response_chain_is_truncated_and_stored_whole(api):
    first = api.responses.create(model=DEMO_MODEL, input=words("a", 10))
    second = api.responses.create(
        model=DEMO_MODEL, input=words("b", 20), previous_response_id=first.id
    )
    assert second.usage.input_tokens == 40  # 10 + 10 + 20
    # 40 + 20 + 5 = 65: past what leaves a token of 64; the first turn goes
    third = api.responses.create(
        model=DEMO_MODEL,
        input=words("c", 5),
        previous_response_id=second.id,
        truncation="auto",
    )
    assert third.usage.input_tokens == 20 + 20 + 5 and third.output_text == words("c", 5)
    assert third.truncation == "auto" and third.previous_response_id == second.id
    # the stored conversation is whole: a next turn without truncation is too long
    with pytest.raises(openai.BadRequestError) as refused:
        api.responses.create(model=DEMO_MODEL, input="more", previous_response_id=third.id)
    assert refused.value.body["code"] == "context_length_exceeded"
    fourth = api.responses.create(
        model=DEMO_MODEL, input="more", previous_response_id=third.id, truncation="auto"
    )
    # the whole conversation is 10+10+20+20+5+5+1 = 71: again the first turn goes
    assert fourth.usage.input_tokens == 20 + 20 + 5 + 5 + 1 and fourth.output_text == "more"


def test_a_conversations_items_are_truncated_and_the_turn_appended_whole(api):
    conversation = api.conversations.create(items=[user(words("a", 31)), assistant(words("b", 31))])
    response = api.responses.create(
        model=DEMO_MODEL, input="and now", conversation=conversation.id, truncation="auto"
    )
    # 31 + 31 + 2 = 64 leaves no token of 64: the conversation's turn goes
    assert response.usage.input_tokens == 2 and response.output_text == "and now"
    items = api.conversations.items.list(conversation.id, order="asc").data
    assert len(items) == 4  # its own two, this turn's input and its answer
    api.conversations.delete(conversation.id)


def test_a_function_call_stays_with_its_output(api, counts):
    tool = {"type": "function", "name": "lookup", "parameters": {"type": "object"}}
    body = [
        user(words("a", 32)),
        {"type": "function_call", "call_id": "call_1", "name": "lookup", "arguments": "{}"},
        user(words("b", 10)),  # the user spoke before the call's output came back
        {"type": "function_call_output", "call_id": "call_1", "output": words("c", 20)},
        user("go on"),
    ]
    response = api.responses.create(
        model=DEMO_MODEL, input=body, tools=[tool], tool_choice="none", truncation="auto"
    )
    # 32 + 10 + 20 + 2 = 64 leaves no token of 64; dropping the first turn alone would cut
    # the call from its output: the call, its output and the turn between them go too
    assert response.usage.input_tokens == 2 and response.output_text == "go on"
    assert counts == [64, 2]


def test_the_last_user_turn_is_kept_or_the_usual_400(api):
    too_long = [user("hello"), assistant("hi"), user(words("x", 70))]
    with pytest.raises(openai.BadRequestError) as refused:
        api.responses.create(model=DEMO_MODEL, input=too_long, truncation="auto")
    body = refused.value.body
    assert body["code"] == "context_length_exceeded" and body["param"] == "input"
    assert "truncation" in body["message"]
    # an agent's turn: its user message and the calls after it are never dropped
    tool = {"type": "function", "name": "lookup", "parameters": {"type": "object"}}
    turn = [
        user(words("a", 30)),
        assistant(words("b", 5)),
        user("ask it"),
        {"type": "function_call", "call_id": "call_9", "name": "lookup", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_9", "output": words("o", 40)},
    ]
    response = api.responses.create(
        model=DEMO_MODEL, input=turn, tools=[tool], tool_choice="none", truncation="auto"
    )
    assert response.usage.input_tokens == 2 + 40  # 77 in all: the turn before it went


def test_a_stream_and_a_background_response_are_truncated(api):
    with api.responses.stream(
        model=DEMO_MODEL, instructions="be brief", input=LONG, truncation="auto"
    ) as stream:
        list(stream)
        streamed = stream.get_final_response()
    assert streamed.usage.input_tokens == 32 and streamed.output_text == "the last words"
    created = api.responses.create(
        model=DEMO_MODEL, instructions="be brief", input=LONG, truncation="auto", background=True
    )
    assert created.truncation == "auto"
    deadline = time.monotonic() + HANG_GUARD
    while (done := api.responses.retrieve(created.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert done.status == "completed" and done.usage is not None
    assert done.usage.input_tokens == 32 and done.truncation == "auto"


def test_a_count_with_truncation_counts_what_would_be_sent(api):
    counted = api.responses.input_tokens.count(
        model=DEMO_MODEL, instructions="be brief", input=LONG, truncation="auto"
    )
    assert counted.input_tokens == 32
    whole = api.responses.input_tokens.count(model=DEMO_MODEL, instructions="be brief", input=LONG)
    assert whole.input_tokens == 82


def test_the_kept_items_begin_at_a_user_message_and_keep_instructions():
    items = [
        {"type": "message", "id": "m0", "role": "system", "content": []},
        {"type": "message", "id": "m1", "role": "user", "content": []},
        {"type": "reasoning", "id": "r2", "summary": [], "content": []},
        {"type": "message", "id": "m3", "role": "assistant", "content": []},
        {"type": "function_call", "id": "f4", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "message", "id": "m5", "role": "user", "content": []},
        {"type": "function_call_output", "id": "o6", "call_id": "c", "output": ""},
        {"type": "message", "id": "m7", "role": "developer", "content": []},
        {"type": "message", "id": "m8", "role": "user", "content": []},
    ]
    # m1 has only the system message before it; m5 would cut call c from its output
    assert cut_points(items) == [8]
    assert [item["id"] for item in kept(items, 8)] == ["m0", "m7", "m8"]


# -- models it cannot be served for ---------------------------------------------------------


async def _models_without_context(self, request):
    return JSONResponse({"data": [{"id": self.model}]})  # no `max_model_len`


@pytest.mark.parametrize("context", ["unknown", "uncountable"])
def test_a_model_it_cannot_be_served_for_refuses_it_by_name(
    context, gateway_with, server_loop, monkeypatch
):
    if context == "unknown":
        monkeypatch.setattr(OpenAIServer, "_models", _models_without_context)
    server = OpenAIServer("plain-upstream", "sk-truncation", None)
    server_loop.call(server.start())
    monkeypatch.setenv(KEY_ENV, server.key)
    try:
        known = {"max_model_len": 4096} if context == "uncountable" else {}
        model = ModelConfig(
            "plain-upstream",
            workers=(server.url,),
            upstream="openai",
            api_key_env=KEY_ENV,
            **known,
        )
        gw = gateway_with(models=(model,))
        with openai_sdk(gw.url) as api:
            with pytest.raises(openai.BadRequestError) as refused:
                api.responses.create(model="plain-upstream", input="hi", truncation="auto")
            body = refused.value.body
            assert body["param"] == "truncation"
            why = "context length is unknown" if context == "unknown" else "cannot count"
            assert why in body["message"]
            # without it, served
            answer = api.responses.create(model="plain-upstream", input="hi")
            assert answer.output_text == "hello"
    finally:
        server_loop.call(server.stop())
