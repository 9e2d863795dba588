"""The OpenAI surface product teams use, on every kind of worker behind the gateway
(tests/support/conformance.py lists them), through the official SDK, whole and
streamed: tool calls whose arguments follow their schema, structured outputs that
validate, logprobs of OpenAI's shapes and counts, n choices, and a clear 400 for
what a model's workers do not serve.

A real engine's text is junk; guided decoding is what makes its tool arguments and
JSON valid, so the schemas are bounded (enums, booleans) and a random model
finishes them in a few tokens."""

from __future__ import annotations

import json
import re
from collections import defaultdict

import jsonschema
import openai
import pytest

from tests.support.conformance import Engine, greedy
from tests.support.requests import user
from tests.support.surface import MAX_TOKENS, TOOLS, WEATHER, assert_valid, calls_of, text_of


def budget(engine: Engine) -> int:
    """`MAX_TOKENS`, within the engine's context beside a short prompt."""
    return min(MAX_TOKENS, engine.max_context - 24)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_required_tool_call_follows_its_schema(sdk, engine: Engine, stream):
    body = greedy(
        engine,
        messages=user("what is the weather in Paris"),
        tools=TOOLS,
        tool_choice="required",
        max_tokens=budget(engine),
    )
    calls, finish = calls_of(sdk, body, stream)
    assert_valid(calls)
    # A random model under the forced schema may append calls until max_tokens: the
    # calls it closed are still whole and valid.
    assert finish == "tool_calls" or (finish == "length" and not engine.echoes)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_named_tool_is_the_one_called(sdk, engine: Engine, stream):
    body = greedy(
        engine,
        messages=user("what time is it"),
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=budget(engine),
    )
    calls, finish = calls_of(sdk, body, stream)
    assert_valid(calls)
    assert {call.name for call in calls} == {"get_time"}
    assert finish == "stop"  # OpenAI's (and vLLM's) reason for a named call


def test_a_tool_answer_continues_the_conversation(sdk, engine: Engine):
    if not engine.tool_messages:
        pytest.skip("the engine's model has a chat template that refuses tool messages")
    first = sdk.chat.completions.create(
        **greedy(
            engine,
            messages=user("weather please"),
            tools=TOOLS,
            tool_choice="required",
            max_tokens=budget(engine),
        )
    )
    message = first.choices[0].message
    call = message.tool_calls[0]
    messages = [
        *user("weather please"),
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny and 21 degrees"},
    ]
    reply = sdk.chat.completions.create(
        **greedy(engine, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8)
    )
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason in ("stop", "length")
    if engine.echoes:
        assert reply.choices[0].message.content == "sunny and 21 degrees"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_json_schema_answer_validates(sdk, engine: Engine, stream):
    body = greedy(
        engine,
        messages=user("describe the weather as JSON"),
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "weather", "schema": WEATHER, "strict": True},
        },
        max_tokens=budget(engine),
    )
    text, finish = text_of(sdk, body, stream)
    assert finish == "stop"
    jsonschema.validate(json.loads(text), WEATHER)


def test_json_mode_answers_an_object(sdk, engine: Engine):
    choice = (
        sdk.chat.completions.create(
            **greedy(
                engine,
                messages=user("any JSON object"),
                response_format={"type": "json_object"},
                max_tokens=budget(engine),
            )
        )
    ).choices[0]
    if choice.finish_reason == "stop":  # a random model may run to max_tokens inside it
        assert isinstance(json.loads(choice.message.content), dict)


def _constrained(sdk, engine: Engine, stream: bool, text: str, constraint: dict) -> str:
    """The answer's text (whole or streamed) to `text` under `structured_outputs`."""
    body = greedy(engine, messages=user(text), max_tokens=budget(engine))
    body["extra_body"] = {"structured_outputs": constraint}
    answer, finish = text_of(sdk, body, stream)
    assert finish == "stop"
    return answer


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_choice_constrained_answer_is_one_of_the_choices(sdk, engine: Engine, stream):
    """vLLM's `structured_outputs.choice`: the answer is exactly one of them (the demo
    answers the one its prompt holds)."""
    choices = ["sunny", "rainy", "snowy"]
    answer = _constrained(sdk, engine, stream, "is it rainy today", {"choice": choices})
    assert answer in choices
    if engine.echoes:
        assert answer == "rainy"


@pytest.mark.parametrize(
    ("constraint", "matches"),
    [
        ({"regex": "[0-9]{3}-[a-c]{2}"}, re.compile("[0-9]{3}-[a-c]{2}").fullmatch),
        ({"grammar": 'root ::= "yes" | "no"'}, {"yes", "no"}.__contains__),
    ],
    ids=["regex", "grammar"],
)
def test_a_regex_or_grammar_constrained_answer_follows_it(sdk, engine: Engine, constraint, matches):
    """vLLM's `structured_outputs.regex` and `.grammar` (EBNF), on vLLM's engines; the
    demo lists neither: a 400 naming the parameter, before any engine is called."""
    (name,) = constraint
    if engine.echoes:
        with pytest.raises(openai.BadRequestError) as caught:
            _constrained(sdk, engine, False, "a code please", constraint)
        assert caught.value.body["param"] == f"structured_outputs.{name}"
        return
    assert matches(_constrained(sdk, engine, False, "a code please", constraint))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_have_openais_shape(sdk, engine: Engine, stream):
    body = greedy(engine, messages=user("a b c d"), logprobs=True, top_logprobs=2, max_tokens=4)
    if stream:
        chunks = list(
            sdk.chat.completions.create(**body, stream=True, stream_options={"include_usage": True})
        )
        entries = [
            entry
            for c in chunks
            if c.choices and c.choices[0].logprobs
            for entry in c.choices[0].logprobs.content or []
        ]
        tokens = chunks[-1].usage.completion_tokens
    else:
        reply = sdk.chat.completions.create(**body)
        entries = reply.choices[0].logprobs.content
        tokens = reply.usage.completion_tokens
    assert len(entries) == tokens
    for entry in entries:
        assert entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert all(top.logprob <= 0 for top in entry.top_logprobs)


def test_completion_logprobs_have_openais_shape(sdk, engine: Engine):
    reply = sdk.completions.create(**greedy(engine, prompt="a b c d", logprobs=2, max_tokens=4))
    logprobs = reply.choices[0].logprobs
    tokens = reply.usage.completion_tokens
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == tokens
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == tokens
    assert all(1 <= len(top) <= 3 for top in logprobs.top_logprobs)  # the token may add one
    # the tokens' texts are the answer's; past it, as in vLLM's server, only the first
    # bytes of a character the answer ended in, which its text leaves out
    joined, text = "".join(logprobs.tokens), reply.choices[0].text
    assert joined.startswith(text) and set(joined[len(text) :]) <= {"\ufffd"}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_n_choices_each_with_its_index_and_finish(sdk, engine: Engine, stream):
    body = greedy(engine, messages=user("a b c"), n=2, max_tokens=6)
    if engine.defaults.get("temperature") == 0:
        body["temperature"] = 1.0  # several greedy samples are one sample
    if stream:
        chunks = list(
            sdk.chat.completions.create(**body, stream=True, stream_options={"include_usage": True})
        )
        finishes: dict[int, list[str]] = defaultdict(list)
        texts: dict[int, str] = defaultdict(str)
        for chunk in chunks:
            for choice in chunk.choices:
                texts[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    finishes[choice.index].append(choice.finish_reason)
        assert sorted(finishes) == [0, 1]
        assert all(len(reasons) == 1 for reasons in finishes.values())
        usage = chunks[-1].usage
    else:
        reply = sdk.chat.completions.create(**body)
        assert [choice.index for choice in reply.choices] == [0, 1]
        texts = {choice.index: choice.message.content or "" for choice in reply.choices}
        usage = reply.usage
    assert 2 <= usage.completion_tokens <= 2 * 6
    if engine.echoes:
        assert texts == {0: "a b c", 1: "a b c"}
        assert usage.completion_tokens == 6


def test_what_the_workers_do_not_serve_is_a_400_naming_it(sdk, engine: Engine):
    if not engine.echoes:
        pytest.skip("the demo's workers list no image input; a real server's words differ")
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "what is it"}, image]}]
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(**greedy(engine, messages=messages))
    assert caught.value.body["param"].startswith("messages[0].content")
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(**greedy(engine, messages=user("x")), extra_body={"min_p": 0.5})
    assert caught.value.body["param"] == "min_p"
