"""Specs: Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`)
through the official `anthropic` SDK against the real gateway and demo workers:
whole and streamed answers with Anthropic's events, a tool-use round trip,
count_tokens, and Anthropic's error types and status codes for what is refused
(the body, the key, the model, a team's limit, a full worker), never OpenAI's
shape. The demo echoes the last message's words; its tokens are words."""

from __future__ import annotations

import asyncio
import base64
import json
import re
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anthropic
import httpx
import pydantic
import pytest

from gateway.config import ModelConfig
from gateway.edge.anthropic.context_editing import (
    CLEARED_RESULT,
    ContextEdits,
    ToolClearing,
)
from gateway.edge.anthropic.context_editing import edit as edit_context
from gateway.edge.anthropic.validation import parse_messages
from gateway.protocol.types import Event, GenerateRequest, Message, Tool, ToolCall
from gateway.worker.demo import DemoEngine
from tests.support.keys import keyed, new_key
from tests.support.metrics import scrape, value
from tests.support.requests import whole_input
from tests.support.script_engine import ScriptEngine
from tests.support.scripted_worker import SCRIPTED_MODEL, script
from tests.support.servers import DEMO_MODEL
from tests.support.waiting import HANG_GUARD

WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
#: A 1x1 PNG.
PIXEL = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489"
        "0000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082"
    )
).decode()


@pytest.fixture
def sdk() -> Iterator[Callable[..., anthropic.Anthropic]]:
    """Makes SDK clients for a gateway URL and key; closes them after the test (a client
    left to the garbage collector warns, and warnings are errors)."""
    made: list[anthropic.Anthropic] = []

    def make(url: str, key: str | None = "unused", **options: Any) -> anthropic.Anthropic:
        client = anthropic.Anthropic(
            base_url=url, api_key=key, max_retries=0, timeout=HANG_GUARD, **options
        )
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()


@pytest.fixture
def claude(gateway, sdk) -> anthropic.Anthropic:
    return sdk(gateway.url)


def say(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def anthropic_error(response: httpx.Response) -> dict:
    """The body is an error in Anthropic's shape; its `error` object."""
    body = response.json()
    assert body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["message"], body
    return body["error"]  # type: ignore[no-any-return]


# -- answers -----------------------------------------------------------------


def test_a_message_is_answered_with_text_stop_reason_and_usage(claude):
    message = claude.messages.create(
        model=DEMO_MODEL, max_tokens=16, system="be brief", messages=say("hello there world")
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.model == DEMO_MODEL
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == "hello there world"
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    # the whole input: another module may have sent this prompt to the shared demo worker
    # first, and its prefix cache's share is `cache_read_input_tokens`
    assert (whole_input(message.usage), message.usage.output_tokens) == (5, 3)


def test_max_tokens_ends_the_answer_with_its_reason(claude):
    message = claude.messages.create(model=DEMO_MODEL, max_tokens=2, messages=say("a b c d"))
    assert message.content[0].text == "a b"
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 2


def test_system_blocks_sampling_and_metadata_are_taken(claude):
    message = claude.messages.create(
        model=DEMO_MODEL,
        max_tokens=8,
        system=[{"type": "text", "text": "one two", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": "first turn"},
            {"role": "assistant", "content": [{"type": "text", "text": "an answer"}]},
            {"role": "user", "content": [{"type": "text", "text": "last words"}]},
        ],
        stop_sequences=["zzz"],
        metadata={"user_id": "user-1"},
        cache_control={"type": "ephemeral"},
        thinking={"type": "disabled"},  # what asks nothing is taken
        service_tier="standard_only",
        # sampling the SDK no longer names, which older clients send
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5},
    )
    assert message.content[0].text == "last words"
    assert whole_input(message.usage) == 8  # every message's words, the system's too


def test_system_messages_within_the_conversation_are_taken_where_they_come(claude):
    """Claude Code puts its reminders in `system` messages after the user's: each is a
    system message at its place; tool results pair across one."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}
    message = claude.messages.create(
        model=DEMO_MODEL,
        max_tokens=8,
        tools=[WEATHER_TOOL],
        messages=[
            *say("weather please"),
            {"role": "assistant", "content": [call]},
            {"role": "system", "content": "a reminder of five words"},
            {"role": "user", "content": [result]},
            {"role": "system", "content": [{"type": "text", "text": "two more"}]},
            *say("thanks then"),
        ],
    )
    assert message.content[0].text == "thanks then"
    assert whole_input(message.usage) == 2 + 5 + 1 + 2 + 2


def test_claude_codes_billing_header_is_left_out_of_the_prompt(claude):
    """Its hash changes with every version: in the prompt, it would start every
    conversation with different tokens, so no prefix cache could keep one."""
    header = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.9.abc; x;"}
    asked = {"model": DEMO_MODEL, "max_tokens": 8, "messages": say("hello")}
    plain = claude.messages.create(**asked, system="be brief")
    headed = claude.messages.create(**asked, system=[header, {"type": "text", "text": "be brief"}])
    assert whole_input(headed.usage) == whole_input(plain.usage) == 3


def test_deferred_tools_are_left_out_of_the_models_tools(claude):
    """`defer_loading` (Claude Code's tool search): the model is not given the tool until
    the client loads it; the demo calls each tool named in the message it is given."""
    deferred = {**WEATHER_TOOL, "name": "get_time", "defer_loading": True}
    asked = {"model": DEMO_MODEL, "max_tokens": 32, "tools": [WEATHER_TOOL, deferred]}
    message = claude.messages.create(**asked, messages=say("get_weather and get_time"))
    assert [block.name for block in message.content if block.type == "tool_use"] == ["get_weather"]
    only = claude.messages.create(**{**asked, "tools": [deferred]}, messages=say("get_time now"))
    assert only.content[0].text == "get_time now"
    with pytest.raises(anthropic.BadRequestError) as named:
        claude.messages.create(
            **asked, messages=say("x"), tool_choice={"type": "tool", "name": "get_time"}
        )
    assert "tool_choice.name" in named.value.body["error"]["message"]


def change(kind: str, **tool: Any) -> dict[str, Any]:
    """A system message that changes the tools in effect (one `tool_addition` or
    `tool_removal` block)."""
    return {"role": "system", "content": [{"type": kind, "tool": tool}]}


def test_system_messages_add_and_remove_tools_mid_conversation(claude):
    """Claude Code's mid-conversation tool changes (as vLLM's Messages server resolves
    them: the tools in effect at the conversation's end): a deferred tool loaded by
    reference, a tool declared by definition, one taken away."""
    deferred = {**WEATHER_TOOL, "defer_loading": True}
    asked: dict[str, Any] = {"model": DEMO_MODEL, "max_tokens": 32, "tools": [deferred]}
    ask = say("get_weather or get_time")

    def called(*messages: dict[str, Any]) -> list[str]:
        answer = claude.messages.create(**asked, messages=[*messages, *ask])
        return [block.name for block in answer.content if block.type == "tool_use"]

    loaded = change("tool_addition", type="tool_reference", name="get_weather")
    assert called() == []
    assert called(loaded) == ["get_weather"]
    timer = {**WEATHER_TOOL, "name": "get_time"}
    declared = change("tool_addition", type="tool_definition", definition=timer)
    assert called(loaded, declared) == ["get_weather", "get_time"]
    removed = change("tool_removal", type="tool_reference", name="get_weather")
    assert called(loaded, declared, removed) == ["get_time"]
    for bad, named in [
        (change("tool_addition", type="tool_reference", name="nope"), "tool.name"),
        (change("tool_removal", type="tool_definition", definition=timer), "tool.type"),
        (
            change("tool_addition", type="tool_definition", definition={"name": 1}),
            "tool.definition",
        ),
    ]:
        with pytest.raises(anthropic.BadRequestError) as raised:
            called(bad)
        assert f"messages[0].content[0].{named}" in raised.value.body["error"]["message"]
    # a tool search's result (Claude Code's ToolSearch) loads what it references
    search = {**WEATHER_TOOL, "name": "ToolSearch"}
    use = {"type": "tool_use", "id": "toolu_9", "name": "ToolSearch", "input": {}}
    found = {"type": "tool_reference", "tool_name": "get_weather"}
    result = {"type": "tool_result", "tool_use_id": "toolu_9", "content": [found]}
    searched = [
        *say("find the weather tool"),
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [result, {"type": "text", "text": "get_weather now"}]},
    ]
    answer = claude.messages.create(**{**asked, "tools": [search, deferred]}, messages=searched)
    assert [b.name for b in answer.content if b.type == "tool_use"] == ["get_weather"]
    result["content"] = [{**found, "tool_name": "nope"}]
    with pytest.raises(anthropic.BadRequestError) as unknown:
        claude.messages.create(**{**asked, "tools": [search, deferred]}, messages=searched)
    assert "messages[2].content[0].content[0].tool.name" in unknown.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as in_a_turn:
        claude.messages.create(
            **asked, messages=[{"role": "user", "content": loaded["content"]}, *ask]
        )
    assert "messages[0].content[0].type" in in_a_turn.value.body["error"]["message"]


def test_images_go_to_workers_that_take_them(claude):
    """The demo takes no images: both sources reach its feature check, which names them."""
    for source in (
        {"type": "base64", "media_type": "image/png", "data": PIXEL},
        {"type": "url", "url": "https://example.com/a.png"},
    ):
        content = [{"type": "image", "source": source}, {"type": "text", "text": "what is it"}]
        with pytest.raises(anthropic.BadRequestError) as raised:
            claude.messages.create(
                model=DEMO_MODEL, max_tokens=4, messages=[{"role": "user", "content": content}]
            )
        assert "image_url" in raised.value.body["error"]["message"]
    bad = {"type": "base64", "media_type": "image/tiff", "data": PIXEL}
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.messages.create(
            model=DEMO_MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "image", "source": bad}]}],
        )
    assert "messages[0].content[0].source.media_type" in raised.value.body["error"]["message"]


MEMO = {"type": "text", "media_type": "text/plain", "data": "the code word is plum"}


def test_a_document_is_a_paragraph_of_its_message_after_its_title_and_context(claude):
    """A text document, and a content one (in a tool result too), reach the model as
    paragraphs of the message's text, each document's title and context first."""
    document = {
        "type": "document",
        "source": MEMO,
        "title": "memo",
        "context": "from the archive",
        "citations": {"enabled": False},
        "cache_control": {"type": "ephemeral"},
    }
    content = [{"type": "text", "text": "read"}, document, {"type": "text", "text": "say it"}]
    body = {
        "model": DEMO_MODEL,
        "max_tokens": 32,
        "messages": [{"role": "user", "content": content}],
    }
    parsed = parse_messages(body)
    assert parsed.generate.messages[-1].content == (
        "read\n\nmemo\n\nfrom the archive\n\nthe code word is plum\n\nsay it"
    )
    message = claude.messages.create(**body)  # the demo echoes the words it was given
    assert message.content[0].text == "read memo from the archive the code word is plum say it"
    inner = {"type": "content", "content": [{"type": "text", "text": "found"}]}
    turns = [
        {"role": "user", "content": "look"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t",
                    "content": [{"type": "document", "source": inner}],
                }
            ],
        },
    ]
    parsed = parse_messages({"model": DEMO_MODEL, "max_tokens": 4, "messages": turns})
    assert parsed.generate.messages[-1].content == "found"


def test_a_stream_sends_anthropics_events_in_order(claude):
    with claude.messages.stream(
        model=DEMO_MODEL, max_tokens=16, messages=say("one two three")
    ) as stream:
        kinds = []
        texts = []
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta":
                assert event.delta.type == "text_delta"
                texts.append(event.delta.text)
        final = stream.get_final_message()
    assert "".join(texts) == "one two three" == final.content[0].text
    raw = [k for k in kinds if k not in ("text",)]  # the SDK's own helper events aside
    assert raw[:2] == ["message_start", "content_block_start"]  # the SDK drops pings
    assert raw[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert final.stop_reason == "end_turn"
    assert (whole_input(final.usage), final.usage.output_tokens) == (3, 3)


def test_the_stream_on_the_wire_names_each_event(gateway):
    body = {"model": DEMO_MODEL, "max_tokens": 4, "messages": say("a b"), "stream": True}
    answer = httpx.post(gateway.url + "/v1/messages", json=body, timeout=HANG_GUARD)
    assert answer.headers["content-type"].startswith("text/event-stream")
    names = [line[7:] for line in answer.text.splitlines() if line.startswith("event: ")]
    payloads = [
        json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: ")
    ]
    assert names == [p["type"] for p in payloads]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = payloads[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert whole_input(start["usage"]) == 2


# -- tools ---------------------------------------------------------------------


def test_a_tool_use_cut_by_max_tokens_has_the_same_input_whole_and_streamed(claude):
    """`input` is an object even when `max_tokens` cut the call's JSON: what a whole
    answer holds is what the SDK reads from the stream's partial JSON."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "bbbbbbbbbbb": {"type": "string"}},
        "required": ["a", "bbbbbbbbbbb"],
    }
    ask = {
        "model": DEMO_MODEL,
        "max_tokens": 1,
        "tools": [{"name": "f", "input_schema": schema}],
        "tool_choice": {"type": "any"},
        "messages": say("x"),
    }
    whole = claude.messages.create(**ask)
    with claude.messages.stream(**ask) as events:
        streamed = events.get_final_message()
    assert whole.stop_reason == streamed.stop_reason == "max_tokens"
    (cut,) = [block.input for block in whole.content if block.type == "tool_use"]
    assert isinstance(cut, dict)
    assert cut == next(b.input for b in streamed.content if b.type == "tool_use")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_tool_use_round_trip(claude, stream):
    ask = {
        "model": DEMO_MODEL,
        "max_tokens": 32,
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "auto"},
        "messages": say("call get_weather please"),
    }
    if stream:
        with claude.messages.stream(**ask) as events:
            deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
            first = events.get_final_message()
        assert "input_json_delta" in deltas
    else:
        first = claude.messages.create(**ask)
    assert first.stop_reason == "tool_use"
    (use,) = [block for block in first.content if block.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input, dict) and "city" in use.input
    second = claude.messages.create(
        **{
            **ask,
            "messages": [
                *ask["messages"],
                {
                    "role": "assistant",
                    "content": [b.model_dump(mode="json") for b in first.content],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": use.id, "content": "sunny and mild"}
                    ],
                },
            ],
        }
    )
    assert second.stop_reason == "end_turn"
    assert second.content[0].text == "sunny and mild"


def _turns(result_id: str | None) -> list[dict]:
    """A tool round: the call, then the user's turn (with a result for `result_id`)."""
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
    reply: list[dict] = [{"type": "text", "text": "and?"}]
    if result_id is not None:
        reply.insert(0, {"type": "tool_result", "tool_use_id": result_id, "content": "sunny"})
    return [
        *say("weather?"),
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": reply},
    ]


@pytest.mark.parametrize(
    ("result_id", "says"),
    [("toolu_2", "Unexpected `tool_use_id`"), (None, "without `tool_result` blocks")],
    ids=["a result for another call", "no result"],
)
def test_a_tool_call_and_its_result_come_in_pairs(claude, result_id, says):
    """As Anthropic's API: each tool_use answered by a tool_result in the next turn,
    and no result for a call that was not made."""
    body = {"model": DEMO_MODEL, "max_tokens": 8, "tools": [WEATHER_TOOL]}
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.messages.create(**body, messages=_turns(result_id))
    assert says in raised.value.body["error"]["message"]
    assert claude.messages.create(**body, messages=_turns("toolu_1")).stop_reason == "end_turn"


def test_tool_choice_any_tool_and_none(claude):
    base = {"model": DEMO_MODEL, "max_tokens": 32, "tools": [WEATHER_TOOL], "messages": say("hi")}
    forced = claude.messages.create(**base, tool_choice={"type": "tool", "name": "get_weather"})
    assert [b.type for b in forced.content] == ["tool_use"]
    assert forced.content[0].name == "get_weather"
    anything = claude.messages.create(**base, tool_choice={"type": "any"})
    assert anything.stop_reason == "tool_use"
    none = claude.messages.create(
        **{**base, "messages": say("call get_weather")}, tool_choice={"type": "none"}
    )
    assert [b.type for b in none.content] == ["text"] and none.stop_reason == "end_turn"


@anthropic.beta_tool
def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: the city
    """
    return "sunny and mild"


@pytest.mark.parametrize("stream", [False, True])
def test_the_sdks_tool_runner_goes_on_without_a_thread(claude, stream):
    """The SDK's tool runner threads its turns by default (`thread`: server-held
    conversation state, which the gateway does not hold); the refusal's
    `thread_unsupported_request` code makes it send the whole conversation instead."""
    asked: dict[str, Any] = {"model": DEMO_MODEL, "max_tokens": 32, "tools": [get_weather]}
    if stream:
        streams = claude.beta.messages.tool_runner(
            **asked, messages=say("call get_weather"), stream=True
        )
        first, second = [events.get_final_message() for events in streams]
    else:
        runner = claude.beta.messages.tool_runner(**asked, messages=say("call get_weather"))
        first, second = list(runner)
    assert first.stop_reason == "tool_use" and first.content[0].name == "get_weather"
    assert second.stop_reason == "end_turn" and second.content[0].text == "sunny and mild"
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.beta.messages.thread(model=DEMO_MODEL, max_tokens=8).send(say("a")[0])
    error = raised.value.body["error"]
    assert error["details"] == {"error_code": "thread_unsupported_request"}
    assert error["type"] == "invalid_request_error" and "thread" in error["message"]


def test_omitted_thinking_is_an_empty_signed_block_whole_and_streamed(claude):
    """`thinking.display: "omitted"` as Anthropic's API answers it: the thinking block
    is there, its `thinking` empty and its `signature` set (streamed: no thinking_delta,
    its signature_delta), and it goes back with the next turn as any thinking block."""
    asked: dict[str, Any] = {
        "model": DEMO_MODEL,
        "max_tokens": 16,
        "messages": say("a b c"),
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "low"},  # the demo thinks
    }
    whole = claude.messages.create(**asked)
    with claude.messages.stream(**asked) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        streamed = stream.get_final_message()
    assert deltas[0] == "signature_delta" and "thinking_delta" not in deltas
    for message in (whole, streamed):
        assert [block.type for block in message.content] == ["thinking", "text"]
        thinking = message.content[0]
        assert thinking.thinking == "" and thinking.signature  # type: ignore[union-attr]
        assert message.content[1].text == "a b c"  # type: ignore[union-attr]
    again = [*asked["messages"], {"role": "assistant", "content": whole.content}, *say("d e")]
    assert claude.messages.create(**{**asked, "messages": again}).content[1].text == "d e"


class Forecast(pydantic.BaseModel):
    city: str
    days: int
    sunny: bool


def test_output_config_format_answers_json_that_follows_the_schema(claude):
    # the SDK's structured outputs: `parse` sends the model's schema as output_config.format
    base = {"model": DEMO_MODEL, "max_tokens": 32, "messages": say("the forecast please")}
    parsed = claude.messages.parse(**base, output_format=Forecast)
    assert parsed.parsed_output == Forecast(city="", days=0, sunny=False)  # the demo's minimal
    assert parsed.stop_reason == "end_turn"
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    with claude.messages.stream(
        **base, output_config={"format": {"type": "json_schema", "schema": schema}}
    ) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["text"]
    assert json.loads(streamed.content[0].text) == {"n": 0}  # type: ignore[union-attr]


def test_the_structured_outputs_betas_output_format_is_output_config_format(claude):
    """Older SDKs' `beta.messages.parse` (the `structured-outputs-2025-11-13` beta) send
    the schema as a top-level `output_format`, which Anthropic's API still takes."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    legacy = {"type": "json_schema", "schema": schema}
    asked: dict[str, Any] = {
        "model": DEMO_MODEL,
        "max_tokens": 32,
        "messages": say("a number please"),
        "betas": ["structured-outputs-2025-11-13"],
    }
    answer = claude.beta.messages.create(**asked, extra_body={"output_format": legacy})
    assert json.loads(answer.content[0].text) == {"n": 0}  # type: ignore[union-attr]
    counted = claude.messages.count_tokens(
        model=DEMO_MODEL, messages=say("a"), extra_body={"output_format": legacy}
    )
    assert counted.input_tokens > 0
    both = {"output_format": legacy, "output_config": {"format": legacy}}
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.beta.messages.create(**asked, extra_body=both)
    assert raised.value.body["error"]["message"].startswith("output_format:")
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.beta.messages.create(**asked, extra_body={"output_format": {"type": "json"}})
    assert raised.value.body["error"]["message"].startswith("output_format.type:")


@pytest.mark.parametrize(
    ("output_config", "named"),
    [
        ("json", "output_config"),
        ({"format": {"type": "json_object"}}, "output_config.format.type"),
        ({"format": {"type": "json_schema"}}, "output_config.format.schema"),
        (
            {"format": {"type": "json_schema", "schema": {}, "name": "x"}},
            "output_config.format.name",
        ),
        ({"effort": "none"}, "output_config.effort"),
        ({"effort": "low", "verbosity": "low"}, "output_config.verbosity"),
    ],
)
def test_output_config_refusals_name_its_field(claude, output_config, named):
    body = {"model": DEMO_MODEL, "max_tokens": 8, "messages": say("a")}
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.post(
            "/v1/messages", body={**body, "output_config": output_config}, cast_to=httpx.Response
        )
    assert named in raised.value.body["error"]["message"]


# -- context editing (Claude Code's `context_management`) ----------------------------

#: Two earlier turns that thought (the demo counts a thought's words in the prompt, as a
#: template that renders them does), then the question.
THOUGHT_TURNS = [
    *say("first question"),
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "an early thought of five", "signature": "s"},
            {"type": "text", "text": "one"},
        ],
    },
    *say("second question"),
    {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "a later thought", "signature": "s"},
            {"type": "text", "text": "two"},
        ],
    },
    *say("third question"),
]
CONTEXT_BETA = ["context-management-2025-06-27"]


def clear_thinking(keep: object = None) -> dict[str, Any]:
    edit: dict[str, Any] = {"type": "clear_thinking_20251015"}
    if keep is not None:
        edit["keep"] = keep
    return {"edits": [edit]}


def test_claude_codes_clear_thinking_keep_all_asks_nothing(claude):
    """Claude Code sends this with thinking on: it keeps every thought, so nothing is
    cleared and the prompt is the one without it."""
    asked = {"model": DEMO_MODEL, "max_tokens": 8, "messages": THOUGHT_TURNS}
    plain = claude.messages.create(**asked, thinking={"type": "adaptive"})
    edited = claude.beta.messages.create(
        **asked,
        thinking={"type": "adaptive"},
        context_management=clear_thinking("all"),
        betas=CONTEXT_BETA,
    )
    assert edited.context_management is not None
    assert edited.context_management.applied_edits == []
    assert whole_input(edited.usage) == whole_input(plain.usage) == 16


@pytest.mark.parametrize("stream", [False, True])
def test_clear_thinking_leaves_earlier_turns_thoughts_out(claude, stream):
    """By default the last turn that thought keeps its thought: the first turn's five
    words leave the prompt, and the answer says so, whole or in its message_delta."""
    asked: dict[str, Any] = {
        "model": DEMO_MODEL,
        "max_tokens": 8,
        "messages": THOUGHT_TURNS,
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": clear_thinking(),
        "betas": CONTEXT_BETA,
    }
    if stream:
        with claude.beta.messages.stream(**asked) as events:
            deltas = [e for e in events if e.type == "message_delta"]
        (delta,) = deltas
        context, input_tokens = delta.context_management, whole_input(delta.usage)
    else:
        message = claude.beta.messages.create(**asked)
        context, input_tokens = message.context_management, whole_input(message.usage)
    assert input_tokens == 16 - 5
    assert context is not None
    (applied,) = context.applied_edits
    assert applied.type == "clear_thinking_20251015"
    assert (applied.cleared_thinking_turns, applied.cleared_input_tokens) == (1, 5)


def test_clear_thinking_keeps_the_turns_it_is_told(claude):
    asked: dict[str, Any] = {"model": DEMO_MODEL, "messages": THOUGHT_TURNS}
    thinking = {"type": "adaptive"}
    both = clear_thinking({"type": "thinking_turns", "value": 2})
    kept = claude.beta.messages.create(
        **asked, max_tokens=8, thinking=thinking, context_management=both, betas=CONTEXT_BETA
    )
    assert kept.context_management.applied_edits == []
    assert whole_input(kept.usage) == 16
    counted = claude.beta.messages.count_tokens(
        **asked,
        thinking=thinking,
        context_management=clear_thinking({"type": "thinking_turns", "value": 1}),
        betas=CONTEXT_BETA,
    )
    assert counted.input_tokens == 11
    assert counted.context_management.original_input_tokens == 16


def clear_tools(**options: Any) -> dict[str, Any]:
    return {"type": "clear_tool_uses_20250919", **options}


def tool_edit(**options: Any) -> dict[str, Any]:
    return {"edits": [clear_tools(**options)]}


@pytest.mark.parametrize(
    ("context_management", "thinking", "named"),
    [
        (
            {"edits": [{"type": "compact_20260112", "trigger": {"type": "input_tokens"}}]},
            "adaptive",
            "edits[0].trigger.value",
        ),
        ({"edits": [{"type": "other"}]}, "adaptive", "edits[0].type"),
        (clear_thinking(), "disabled", "requires `thinking` to be enabled or adaptive"),
        (clear_thinking(), None, "requires `thinking`"),
        (clear_thinking({"type": "thinking_turns", "value": 0}), "adaptive", "keep.value"),
        (clear_thinking({"type": "tool_uses", "value": 1}), "adaptive", "edits[0].keep"),
        ({"edits": [clear_thinking()["edits"][0]] * 2}, "adaptive", "edits[1]"),
        ({"edits": [clear_tools(), clear_thinking()["edits"][0]]}, "adaptive", "the first edit"),
        ({"edits": [clear_tools()] * 2}, "adaptive", "edits[1]"),
        (tool_edit(trigger={"type": "turns", "value": 1}), None, "edits[0].trigger.type"),
        (tool_edit(trigger={"type": "tool_uses", "value": -1}), None, "trigger.value"),
        (tool_edit(keep={"type": "input_tokens", "value": 1}), None, "edits[0].keep.type"),
        (tool_edit(clear_at_least={"type": "tool_uses", "value": 1}), None, "clear_at_least"),
        (tool_edit(exclude_tools="get_weather"), None, "edits[0].exclude_tools"),
        (tool_edit(clear_tool_inputs="yes"), None, "edits[0].clear_tool_inputs"),
        (tool_edit(other=1), None, "edits[0].other"),
        ({"edits": "x"}, "adaptive", "context_management.edits"),
        ({"edits": [], "other": 1}, "adaptive", "context_management.other"),
        ("all", "adaptive", "context_management"),
    ],
)
def test_context_management_refusals_name_the_field(claude, context_management, thinking, named):
    body: dict[str, Any] = {
        "model": DEMO_MODEL,
        "max_tokens": 8,
        "messages": THOUGHT_TURNS,
        "context_management": context_management,
    }
    if thinking is not None:
        body["thinking"] = {"type": thinking}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        sent = (
            body if path == "/v1/messages" else {k: v for k, v in body.items() if k != "max_tokens"}
        )
        with pytest.raises(anthropic.BadRequestError) as raised:
            claude.post(path, body=sent, cast_to=httpx.Response)
        assert named in raised.value.body["error"]["message"], raised.value.body


#: A result's words (the demo counts them as its tokens), and the placeholder's.
RESULT = "it was sunny and warm with a light wind from the west all day"
RESULT_WORDS, CLEARED_WORDS = len(RESULT.split()), len(CLEARED_RESULT.split())
SEARCH_TOOL = {**WEATHER_TOOL, "name": "search", "description": "Search the web."}


def tool_turns(*names: str) -> list[dict[str, Any]]:
    """A conversation where the model called each of `names` in turn, each result
    `RESULT`, then a last question."""
    turns = say("what happened")
    for i, name in enumerate(names):
        use = {"type": "tool_use", "id": f"toolu_{i}", "name": name, "input": {"city": "Paris"}}
        result = {"type": "tool_result", "tool_use_id": f"toolu_{i}", "content": RESULT}
        turns += [{"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}]
    return [*turns, *say("and now")]


def tools_asked(turns: list[dict[str, Any]], **edit: Any) -> dict[str, Any]:
    return {
        "model": DEMO_MODEL,
        "messages": turns,
        "tools": [WEATHER_TOOL, SEARCH_TOOL],
        "context_management": tool_edit(**edit),
        "betas": CONTEXT_BETA,
    }


@pytest.mark.parametrize("stream", [False, True])
def test_clear_tool_uses_replaces_all_but_the_last_three_results(claude, stream):
    """Past its trigger (the prompt's input tokens, counted by the model's tokenizer) the
    edit leaves the last three tool uses' results and replaces the older ones; the answer
    says how many uses and tokens it cleared, whole or in its message_delta."""
    turns = tool_turns(*["get_weather"] * 5)
    whole = 2 + 5 * RESULT_WORDS + 2
    trigger = {"type": "input_tokens", "value": whole - 1}
    asked = {**tools_asked(turns, trigger=trigger), "max_tokens": 8}
    if stream:
        with claude.beta.messages.stream(**asked) as events:
            (delta,) = [e for e in events if e.type == "message_delta"]
        context, input_tokens = delta.context_management, whole_input(delta.usage)
    else:
        message = claude.beta.messages.create(**asked)
        context, input_tokens = message.context_management, whole_input(message.usage)
    cleared = 2 * (RESULT_WORDS - CLEARED_WORDS)
    assert input_tokens == whole - cleared
    (applied,) = context.applied_edits
    assert applied.type == "clear_tool_uses_20250919"
    assert (applied.cleared_tool_uses, applied.cleared_input_tokens) == (2, cleared)


def test_clear_tool_uses_below_its_trigger_clears_nothing(claude):
    """Below its trigger (by default 100,000 input tokens; here also by tool uses) the
    prompt is sent as it came."""
    turns = tool_turns("get_weather", "get_weather")
    plain = claude.messages.create(
        model=DEMO_MODEL, max_tokens=8, messages=turns, tools=[WEATHER_TOOL, SEARCH_TOOL]
    )
    for edit in (
        {},
        {"trigger": {"type": "tool_uses", "value": 2}},
        {"keep": {"type": "tool_uses", "value": 2}},
    ):
        answer = claude.beta.messages.create(**tools_asked(turns, **edit), max_tokens=8)
        assert answer.context_management.applied_edits == []
        assert whole_input(answer.usage) == whole_input(plain.usage) == 4 + 2 * RESULT_WORDS


def test_clear_tool_uses_options_choose_what_is_cleared(claude):
    """`trigger` by tool uses, `keep`, `exclude_tools` passed over, and `clear_at_least`:
    an edit that cannot clear that many tokens clears nothing."""
    turns = tool_turns("search", "get_weather", "get_weather", "get_weather")
    by_uses = {
        "trigger": {"type": "tool_uses", "value": 3},
        "keep": {"type": "tool_uses", "value": 1},
    }
    saved = RESULT_WORDS - CLEARED_WORDS
    cases = [
        (by_uses, 3),
        ({**by_uses, "exclude_tools": ["search"]}, 2),
        ({**by_uses, "clear_at_least": {"type": "input_tokens", "value": 3 * saved}}, 3),
        ({**by_uses, "clear_at_least": {"type": "input_tokens", "value": 3 * saved + 1}}, 0),
        ({**by_uses, "keep": {"type": "tool_uses", "value": 0}}, 4),
        # Claude Code's own edit (its tool-result clearing after an idle session)
        (
            {
                **by_uses,
                "clear_at_least": {"type": "input_tokens", "value": 1},
                "exclude_tools": ["search"],
                "clear_tool_inputs": ["get_weather"],
            },
            2,
        ),
    ]
    for edit, uses in cases:
        answer = claude.beta.messages.create(**tools_asked(turns, **edit), max_tokens=8)
        assert whole_input(answer.usage) == 4 + 4 * RESULT_WORDS - uses * saved, edit
        report = answer.context_management.applied_edits
        assert [(e.cleared_tool_uses, e.cleared_input_tokens) for e in report] == (
            [(uses, uses * saved)] if uses else []
        ), edit


def test_both_edits_each_report_what_they_cleared(claude):
    """Thinking cleared first, then tool results: each edit's cleared tokens are its own,
    and count_tokens counts the prompt both leave, with the original's."""
    turns = tool_turns("get_weather", "get_weather")
    turns[1]["content"] = [
        {"type": "thinking", "thinking": "an early thought of five", "signature": "s"},
        *turns[1]["content"],
    ]
    turns[3]["content"] = [
        {"type": "thinking", "thinking": "a later thought", "signature": "s"},
        *turns[3]["content"],
    ]
    edits = {
        "edits": [
            {"type": "clear_thinking_20251015"},
            clear_tools(
                trigger={"type": "tool_uses", "value": 1}, keep={"type": "tool_uses", "value": 1}
            ),
        ]
    }
    asked = {**tools_asked(turns), "context_management": edits, "thinking": {"type": "adaptive"}}
    whole = 4 + 2 * RESULT_WORDS + 5 + 3
    saved = RESULT_WORDS - CLEARED_WORDS
    answer = claude.beta.messages.create(**asked, max_tokens=8)
    assert whole_input(answer.usage) == whole - 5 - saved
    report = [(e.type, e.cleared_input_tokens) for e in answer.context_management.applied_edits]
    assert report == [("clear_thinking_20251015", 5), ("clear_tool_uses_20250919", saved)]
    counted = claude.beta.messages.count_tokens(**asked)
    assert counted.input_tokens == whole - 5 - saved
    assert counted.context_management.original_input_tokens == whole


def test_clear_tool_inputs_clears_the_calls_of_the_results_it_clears():
    """`clear_tool_inputs`: every cleared use's input, or only the tools it names."""
    turns = (
        Message("user", "go"),
        Message("assistant", "", tool_calls=(ToolCall("a", "search", '{"q": 1}'),)),
        Message("tool", "found", tool_call_id="a"),
        Message("assistant", "", tool_calls=(ToolCall("b", "get_weather", '{"city": 2}'),)),
        Message("tool", "sunny", tool_call_id="b"),
        Message("user", "and now"),
    )

    async def count(messages: tuple[Message, ...]) -> int:
        return sum(len(m.content) for m in messages)

    def inputs(clears: bool | frozenset[str]) -> list[str]:
        clearing = ToolClearing(trigger_tokens=None, trigger_uses=0, keep=0, inputs=clears)
        edited, _ = asyncio.run(edit_context(turns, ContextEdits(tools=clearing), count))
        assert [edited[2].content, edited[4].content] == [CLEARED_RESULT] * 2
        return [m.tool_calls[0].arguments for m in edited if m.tool_calls]

    assert inputs(False) == ['{"q": 1}', '{"city": 2}']
    assert inputs(True) == ["{}", "{}"]
    assert inputs(frozenset({"search"})) == ["{}", '{"city": 2}']


@pytest.mark.parametrize(
    ("option", "served"),
    [
        ({"strict": True}, True),
        ({"eager_input_streaming": True}, True),
        ({"defer_loading": False}, True),
        ({"defer_loading": True}, True),
        ({"allowed_callers": ["direct"]}, True),
        ({"input_examples": []}, True),
        ({"input_examples": [{"city": "Paris"}]}, True),
        ({"allowed_callers": ["code_execution_20250825"]}, False),
        ({"input_examples": [{"city": 5}]}, False),
        ({"strict": "yes"}, False),
    ],
)
def test_a_tools_options_are_served_or_refused_by_name(claude, option, served):
    """What Claude Code's tools carry: served where it asks nothing of us, else a 400
    naming the option."""
    asked = {
        "model": DEMO_MODEL,
        "max_tokens": 8,
        "messages": say("weather in Paris"),
        "tools": [{**WEATHER_TOOL, **option}],
    }
    if served:
        assert claude.messages.create(**asked).stop_reason in ("end_turn", "tool_use")
        return
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.messages.create(**asked)
    assert f"tools[0].{next(iter(option))}" in raised.value.body["error"]["message"]


class ToolsSeen(DemoEngine):
    """The demo, keeping the tools each request gives the model."""

    def __init__(self) -> None:
        super().__init__("furnace-tools-seen")
        self.tools: list[tuple[Tool, ...]] = []

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        self.tools.append(request.tools)
        async for event in super().generate(request):
            yield event


def test_input_examples_reach_the_model_after_the_tools_description(gateway_with, serve_engines):
    """Anthropic's tool use examples: each checked against the tool's input_schema, then
    given to the model (the worker) after the tool's description."""
    engine = ToolsSeen()
    (worker,) = serve_engines(engine)
    gw = gateway_with(models=(ModelConfig(engine.model, workers=(worker.address,)),))
    examples = [{"city": "Paris"}, {"city": "Lyon"}]
    with anthropic.Anthropic(base_url=gw.url, api_key="x", timeout=HANG_GUARD) as client:
        client.messages.create(
            model=engine.model,
            max_tokens=8,
            messages=say("weather in Paris"),
            tools=[{**WEATHER_TOOL, "input_examples": examples}],
        )
    ((tool,),) = engine.tools
    assert tool.name == "get_weather"
    assert tool.description == (
        "The weather in a city.\n\nExamples of this tool's input:\n"
        '{"city":"Paris"}\n{"city":"Lyon"}'
    )


@pytest.mark.parametrize(
    ("examples", "param", "words"),
    [
        (
            [{"city": "Paris"}, {"town": "Lyon"}],
            "tools[0].input_examples[1]",
            "'city' is a required",
        ),
        ([{"city": ["Paris"]}], "tools[0].input_examples[0]", "at ['city']"),
        (["Paris"], "tools[0].input_examples[0]", "an input is an object"),
        ([{"city": "x"}] * 21, "tools[0].input_examples", "at most 20"),
        ({"city": "Paris"}, "tools[0].input_examples", "a list"),
        ([{"city": "x" * 17_000}], "tools[0].input_examples[0]", "at most 16384 bytes"),
    ],
)
def test_input_examples_the_schema_refuses_are_refused_naming_them(claude, examples, param, words):
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(
            model=DEMO_MODEL,
            max_tokens=8,
            messages=say("weather"),
            tools=[{**WEATHER_TOOL, "input_examples": examples}],
        )
    message = refused.value.body["error"]["message"]
    assert message.startswith(param) and words in message, message


def test_input_examples_skip_the_checks_a_client_could_make_slow(claude):
    """A client's regular expression against a client's string can backtrack for hours in
    Python's `re`, and uniqueItems is quadratic: neither is checked in an example (the
    answer comes at once), and the rest of the schema still is."""
    schema = {
        "type": "object",
        "properties": {
            "s": {"type": "string", "pattern": "^(a+)+$"},
            "xs": {"type": "array", "uniqueItems": True},
        },
        "patternProperties": {"^(b+)+$": {"type": "integer"}},
        "additionalProperties": False,
        "required": ["s"],
    }
    slow = {"s": "a" * 40 + "!", "xs": [{}] * 2000, "b" * 40 + "!": 1}
    tool = {"name": "slow", "input_schema": schema, "input_examples": [slow]}
    answer = claude.messages.create(
        model=DEMO_MODEL, max_tokens=8, messages=say("hi"), tools=[tool], timeout=HANG_GUARD
    )
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(
            model=DEMO_MODEL,
            max_tokens=8,
            messages=say("hi"),
            tools=[{**tool, "input_examples": [{"xs": []}]}],
        )
    assert "'s' is a required property" in refused.value.body["error"]["message"]


# -- count_tokens --------------------------------------------------------------------


def test_count_tokens_counts_what_the_answer_bills(claude):
    messages = say("how many words are here")
    counted = claude.messages.count_tokens(model=DEMO_MODEL, system="be brief", messages=messages)
    answered = claude.messages.create(
        model=DEMO_MODEL, max_tokens=8, system="be brief", messages=messages
    )
    assert counted.input_tokens == whole_input(answered.usage) == 7
    schema = {"type": "object", "properties": {}}
    shaped = claude.messages.count_tokens(  # a format asks nothing of the prompt here
        model=DEMO_MODEL,
        system="be brief",
        messages=messages,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert shaped.input_tokens == 7


def test_count_tokens_uses_no_tokens(claude, gateway):
    """A count is not a prompt the engine took: the token counters (and the ledger and
    budgets, which read the same record) do not move, the request is counted."""
    before = scrape(gateway.url)
    claude.messages.count_tokens(model=DEMO_MODEL, messages=say("five words are counted here"))
    after = scrape(gateway.url)
    tokens = "furnace_gateway_prompt_tokens_total"
    assert value(after, tokens, model=DEMO_MODEL) == value(before, tokens, model=DEMO_MODEL)
    requests = [k for k in after if k[0] == "furnace_gateway_requests_total"]
    assert sum(after[k] for k in requests) == sum(before.get(k, 0) for k in requests) + 1


def test_count_tokens_refuses_like_messages(gateway):
    url = gateway.url + "/v1/messages/count_tokens"
    missing = httpx.post(url, json={"model": DEMO_MODEL}, timeout=HANG_GUARD)
    assert missing.status_code == 400
    assert anthropic_error(missing)["type"] == "invalid_request_error"
    assert "messages" in anthropic_error(missing)["message"]
    unknown = httpx.post(url, json={"model": "nope", "messages": say("a")}, timeout=HANG_GUARD)
    assert unknown.status_code == 404 and anthropic_error(unknown)["type"] == "not_found_error"
    extra = httpx.post(
        url, json={"model": DEMO_MODEL, "messages": say("a"), "max_tokens": 3}, timeout=HANG_GUARD
    )
    assert extra.status_code == 400 and "max_tokens" in anthropic_error(extra)["message"]


# -- errors ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"messages": say("a")}, "max_tokens"),
        ({"max_tokens": 0, "messages": say("a")}, "max_tokens"),
        ({"max_tokens": 4, "messages": []}, "messages"),
        ({"max_tokens": 4, "messages": say("a"), "temperature": 1.5}, "temperature"),
        ({"max_tokens": 4, "messages": say("a"), "thinking": {"type": "enabled"}}, "thinking"),
        ({"max_tokens": 4, "messages": say("a"), "service_tier": "priority"}, "service_tier"),
        ({"max_tokens": 4, "messages": say("a"), "thinking": {"type": "x"}}, "thinking"),
        (  # a prefill, refused as Anthropic refuses it
            {"max_tokens": 4, "messages": [*say("a"), {"role": "assistant", "content": "b "}]},
            "trailing whitespace",
        ),
        (
            {
                "max_tokens": 2048,
                "messages": [*say("a"), {"role": "assistant", "content": "b"}],
                "thinking": {"type": "enabled", "budget_tokens": 1024},
            },
            "thinking",
        ),
        ({"max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
        (
            {"max_tokens": 4, "messages": [*say("a"), {"role": "system", "content": [{"a": 1}]}]},
            "messages[1].content[0].type",
        ),
        (
            {"max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
            "messages[0].content[0].source",
        ),
        (  # a PDF
            {
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "document",
                                "source": {
                                    "type": "base64",
                                    "media_type": "application/pdf",
                                    "data": "JVBERi0=",
                                },
                            }
                        ],
                    }
                ],
            },
            "messages[0].content[0].source.type",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "document", "source": MEMO, "citations": {"enabled": True}}
                        ],
                    }
                ],
            },
            "messages[0].content[0].citations",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "document", "source": {**MEMO, "media_type": "text/html"}}
                        ],
                    }
                ],
            },
            "messages[0].content[0].source.media_type",
        ),
        (
            {
                "max_tokens": 4,
                "messages": say("a"),
                "tools": [{"type": "web_search_20250305", "name": "w"}],
            },
            "tools[0].type",
        ),
        ({"max_tokens": 4, "messages": say("a"), "tool_choice": {"type": "any"}}, "tool_choice"),
        ({"max_tokens": 4, "messages": say("a"), "metadata": {"other": 1}}, "metadata.other"),
        ({"max_tokens": 4, "messages": say("a"), "stop_sequences": "x"}, "stop_sequences"),
        # an unhashable value looked up in a set was a 500
        ({"max_tokens": 4, "messages": say("a"), "service_tier": {"a": 1}}, "service_tier"),
        ({"max_tokens": 4, "messages": say("a"), "service_tier": ["auto"]}, "service_tier"),
        (
            {
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": {}, "data": PIXEL},
                            }
                        ],
                    }
                ],
            },
            "media_type",
        ),
        # empty content, which Anthropic's API refuses, was taken
        ({"max_tokens": 4, "messages": say("")}, "non-empty content"),
        ({"max_tokens": 4, "messages": [{"role": "user", "content": []}]}, "non-empty content"),
        (
            {
                "max_tokens": 4,
                "messages": [
                    {"role": "user", "content": "a"},
                    {"role": "assistant", "content": ""},
                    {"role": "user", "content": "b"},
                ],
            },
            "messages[1].content: all messages must have non-empty content",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}],
            },
            "text content blocks must be non-empty",
        ),
        (
            {
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "text", "text": " \n"}]}],
            },
            "text content blocks must contain non-whitespace text",
        ),
    ],
)
def test_bad_bodies_are_invalid_request_errors_naming_the_field(claude, body, named):
    with pytest.raises(anthropic.BadRequestError) as raised:
        claude.post("/v1/messages", body={"model": DEMO_MODEL, **body}, cast_to=httpx.Response)
    error = raised.value
    assert error.status_code == 400
    assert error.body["type"] == "error" and error.body["error"]["type"] == "invalid_request_error"
    assert named in error.body["error"]["message"]


def test_not_json_and_wrong_content_type_are_anthropic_shaped(gateway):
    url = gateway.url + "/v1/messages"
    garbage = httpx.post(
        url, content=b"{", headers={"content-type": "application/json"}, timeout=HANG_GUARD
    )
    assert (
        garbage.status_code == 400 and anthropic_error(garbage)["type"] == "invalid_request_error"
    )
    text = httpx.post(
        url, content=b"{}", headers={"content-type": "text/plain"}, timeout=HANG_GUARD
    )
    assert text.status_code == 415 and anthropic_error(text)["type"] == "invalid_request_error"


def test_another_method_is_refused_in_anthropics_shape_and_other_routes_keep_openais(gateway):
    answer = httpx.get(gateway.url + "/v1/messages", timeout=HANG_GUARD)
    assert answer.status_code == 405 and anthropic_error(answer)["type"] == "invalid_request_error"
    # below Anthropic's path: what its SDK calls and the gateway does not serve
    unknown = httpx.get(gateway.url + "/v1/messages/batches/msgbatch_x", timeout=HANG_GUARD)
    assert unknown.status_code == 404 and anthropic_error(unknown)["type"] == "not_found_error"
    other_api = httpx.get(gateway.url + "/v1/messages/models", timeout=HANG_GUARD)
    assert other_api.status_code == 404 and anthropic_error(other_api)["type"] == "not_found_error"
    batches = httpx.post(gateway.url + "/v1/messages/batches", json={}, timeout=HANG_GUARD)
    assert batches.status_code == 400
    assert anthropic_error(batches)["type"] == "invalid_request_error"
    other = httpx.get(gateway.url + "/v1/models/no-such-model", timeout=HANG_GUARD)
    assert other.status_code == 404 and "param" in other.json()["error"]


def test_an_unknown_model_is_not_found_error(claude):
    with pytest.raises(anthropic.NotFoundError) as raised:
        claude.messages.create(model="no-such-model", max_tokens=4, messages=say("a"))
    assert raised.value.body["error"]["type"] == "not_found_error"


def test_every_answer_carries_anthropics_request_id_header(claude):
    """The SDK reads `request-id` (a message's `_request_id`, an error's `request_id`):
    the gateway's own request id, as `x-request-id` says it."""
    raw = claude.messages.with_raw_response.create(
        model=DEMO_MODEL, max_tokens=4, messages=say("a")
    )
    assert raw.parse()._request_id == raw.headers["x-request-id"]
    with claude.messages.stream(model=DEMO_MODEL, max_tokens=4, messages=say("b")) as stream:
        assert stream.request_id == stream.response.headers["x-request-id"]
        stream.until_done()
    counted = claude.messages.count_tokens(model=DEMO_MODEL, messages=say("c"))
    assert counted._request_id
    with pytest.raises(anthropic.NotFoundError) as raised:
        claude.messages.create(model="no-such-model", max_tokens=4, messages=say("a"))
    assert raised.value.request_id == raised.value.response.headers["x-request-id"]
    assert raised.value.body["request_id"] == raised.value.request_id  # in the body too


def test_models_are_listed_and_retrieved_in_anthropics_shape(claude, gateway):
    """`client.models.list()` / `retrieve()` send `anthropic-version`, and are answered
    as Anthropic's Models API (pages by `limit`, `after_id`, `before_id`); the same
    paths keep OpenAI's shape for a request without it."""
    listed = claude.models.list()
    ids = [model.id for model in listed.data]
    assert DEMO_MODEL in ids and listed.has_more is False
    assert (listed.first_id, listed.last_id) == (ids[0], ids[-1])
    for model in listed.data:
        assert model.type == "model" and model.display_name == model.id
        assert model.lifecycle == "active" and model.created_at.year >= 2026
    demo = claude.models.retrieve(DEMO_MODEL)
    assert demo.id == DEMO_MODEL and demo.type == "model"
    first = claude.models.list(limit=1)
    assert len(first.data) == 1 and first.has_more is True
    assert [model.id for model in claude.models.list(limit=1)] == ids  # the SDK's pages
    assert [m.id for m in claude.models.list(before_id=ids[-1]).data] == ids[:-1]
    with pytest.raises(anthropic.NotFoundError) as raised:
        claude.models.retrieve("no-such-model")
    assert raised.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.models.list(limit=0)
    assert "limit" in refused.value.body["error"]["message"]
    openai_shape = httpx.get(gateway.url + "/v1/models", timeout=HANG_GUARD).json()
    assert openai_shape["object"] == "list" and openai_shape["data"][0]["object"] == "model"


def test_keys_in_x_api_key_or_authorization_and_a_wrong_one_is_authentication_error(
    gateway_with, sdk
):
    key = new_key("search")
    gw = gateway_with(**keyed({"search": {}}, {key: "search"}))
    by_api_key = sdk(gw.url, key).messages.create(
        model=DEMO_MODEL, max_tokens=4, messages=say("a b")
    )
    assert by_api_key.content[0].text == "a b"
    bearer = sdk(gw.url, None, auth_token=key)
    assert bearer.messages.create(model=DEMO_MODEL, max_tokens=4, messages=say("c")).content
    with pytest.raises(anthropic.AuthenticationError) as raised:
        sdk(gw.url, "sk-wrong").messages.create(model=DEMO_MODEL, max_tokens=4, messages=say("a"))
    assert raised.value.status_code == 401
    assert raised.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        sdk(gw.url, "sk-wrong").messages.count_tokens(model=DEMO_MODEL, messages=say("a"))
    with pytest.raises(anthropic.AuthenticationError) as raised:
        sdk(gw.url, "sk-wrong").models.list()  # the path OpenAI's clients share
    assert raised.value.body["error"]["type"] == "authentication_error"


def test_a_team_over_its_limit_gets_rate_limit_error(gateway_with, sdk):
    key = new_key("search")
    gw = gateway_with(**keyed({"search": {"tokens_per_minute": 30}}, {key: "search"}))
    with pytest.raises(anthropic.RateLimitError) as raised:
        sdk(gw.url, key).messages.create(model=DEMO_MODEL, max_tokens=50, messages=say("a"))
    assert raised.value.status_code == 429
    assert raised.value.body["error"]["type"] == "rate_limit_error"
    assert raised.value.response.headers.get("retry-after")


def test_a_full_worker_is_overloaded_error(claude, gateway):
    requests = "furnace_gateway_requests_total"
    labels = {"model": SCRIPTED_MODEL, "route": "/v1/messages", "outcome": "rejected"}
    before = scrape(gateway.url)
    with pytest.raises(anthropic.APIStatusError) as raised:
        claude.messages.create(
            model=SCRIPTED_MODEL, max_tokens=4, messages=say(script(status="RESOURCE_EXHAUSTED"))
        )
    assert raised.value.status_code == 529
    assert raised.value.body["error"]["type"] == "overloaded_error"
    assert raised.value.response.headers.get("retry-after")
    # the metrics (and the access line, from the same record) say what the client got
    after = scrape(gateway.url)
    for status, more in (("529", 1), ("503", 0)):
        counted = value(after, requests, **labels, status=status)
        assert counted - value(before, requests, **labels, status=status) == more


def test_a_failure_mid_stream_is_an_error_event(gateway):
    body = {
        "model": SCRIPTED_MODEL,
        "max_tokens": 8,
        "messages": say(script(texts=2, status="INTERNAL")),
        "stream": True,
    }
    answer = httpx.post(gateway.url + "/v1/messages", json=body, timeout=HANG_GUARD)
    assert answer.status_code == 200
    lines = answer.text.splitlines()
    assert "event: error" in lines
    error = json.loads(lines[lines.index("event: error") + 1][6:])
    assert error["type"] == "error" and error["error"]["type"] == "api_error"
    assert "message_stop" not in answer.text


@pytest.mark.parametrize(
    ("edit", "kind"),
    [
        (tool_edit(), "clear_tool_uses_20250919"),
        ({"edits": [{"type": "compact_20260112"}]}, "compact_20260112"),
    ],
)
def test_an_edit_that_counts_on_a_model_that_cannot_count_is_refused_in_anthropics_words(
    gateway_with, serve_engines, edit, kind
):
    """A model whose workers cannot count the prompt (an engine without a tokenizer; as an
    OpenAI-compatible server without `/tokenize`) refuses the edits that count it
    (`clear_tool_uses_20250919`, `compact_20260112`'s trigger) in the words of Anthropic's
    own refusal, which Claude Code reads to stop sending the edit."""
    (worker,) = serve_engines(ScriptEngine([]))
    models = (ModelConfig("script-engine", workers=(worker.address,)),)
    gw = gateway_with(models=models)
    with (
        anthropic.Anthropic(
            base_url=gw.url, api_key="unused", max_retries=0, timeout=HANG_GUARD
        ) as client,
        pytest.raises(anthropic.BadRequestError) as raised,
    ):
        client.beta.messages.create(
            model="script-engine",
            max_tokens=8,
            messages=[{"role": "user", "content": "count these words please"}],
            context_management=edit,
        )
    message = raised.value.body["error"]["message"]
    assert re.match(
        rf"^\S{{1,128}} does not support the \W?{kind}\W? context management strategy",
        message,
    ), message
