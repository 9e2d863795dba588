"""Answers for the OpenAI surface: n choices, logprobs, tool calls, JSON answers
and a completion's echo, in OpenAI's shapes, whole and streamed, through the
official openai SDK and raw SSE, against the demo worker (see
gateway/worker/demo.py for what it answers)."""

import json
import logging

import anyio
import openai
import pytest

from gateway.edge.openai.encoding import ChatEncoder, CompletionEncoder
from gateway.protocol.types import (
    Finished,
    FinishReason,
    Started,
    Text,
    TokenLogprob,
    ToolCallDelta,
)
from gateway.telemetry import RequestRecord
from tests.support.metrics import access_lines
from tests.support.requests import NO_CACHE, opened, sse_events, user
from tests.support.waiting import HANG_GUARD, wait_until

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "note": {"type": "string"},
            },
            "required": ["city", "days", "unit"],
        },
    },
}
WEATHER_ARGS = {"city": "", "days": 0, "unit": "celsius"}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string"}, "utc": {"type": "boolean"}},
            "required": ["zone", "utc"],
        },
    },
}
TIME_ARGS = {"zone": "", "utc": False}


@pytest.fixture
def sdk(gateway):
    # closed after the test: an unclosed client is a cycle whose socket the collector may
    # finalize first, a ResourceWarning in whichever test it runs in
    with openai.OpenAI(
        base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD
    ) as client:
        yield client


def async_sdk(gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=HANG_GUARD
    )


def chunks_of(client, path: str, body: dict) -> list[dict]:
    """A stream's chunks, [DONE] checked and dropped."""
    response = client.post(path, json={**body, "stream": True})
    assert response.status_code == 200, response.text
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    assert all(event != "[DONE]" for event in events[:-1])
    return events[:-1]


# n choices


def test_n_choices_whole_with_summed_usage(sdk):
    reply = sdk.chat.completions.create(model="furnace-demo", messages=user("one two three"), n=3)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert all(c.message.content == "one two three" for c in reply.choices)
    assert all(c.finish_reason == "stop" for c in reply.choices)
    assert reply.usage.prompt_tokens == 3  # the prompt once
    assert reply.usage.completion_tokens == 9  # 3 words in each of 3 choices
    assert reply.usage.total_tokens == 12

    completion = sdk.completions.create(model="furnace-demo", prompt="a b c", n=2, max_tokens=2)
    assert [(c.index, c.text, c.finish_reason) for c in completion.choices] == [
        (0, "a b", "length"),
        (1, "a b", "length"),
    ]
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (3, 4)


def test_n_choices_stream_interleaved_role_first_finish_each_usage_once(client):
    chunks = chunks_of(
        client,
        "/v1/chat/completions",
        {
            "model": "furnace-slow",
            "messages": user("a b c"),
            "n": 3,
            "stream_options": {"include_usage": True},
        },
    )
    *content, last = chunks
    assert last["choices"] == []
    assert last["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 9,
        "total_tokens": 12,
        **NO_CACHE,
    }
    assert all(c["usage"] is None for c in content)
    assert all(len(c["choices"]) == 1 for c in content)  # one choice per chunk
    by_index: dict[int, list[dict]] = {0: [], 1: [], 2: []}
    for chunk in content:
        by_index[chunk["choices"][0]["index"]].append(chunk["choices"][0])
    for choices in by_index.values():
        assert choices[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in choices) == "a b c"
        assert [c["finish_reason"] for c in choices[:-1]] == [None] * (len(choices) - 1)
        assert choices[-1] == {
            "index": choices[-1]["index"],
            "delta": {},
            "logprobs": None,
            "finish_reason": "stop",
        }
    indexes = [c["choices"][0]["index"] for c in content]
    assert indexes != sorted(indexes)  # interleaved as the events came, not one after another


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_continuous_usage_puts_each_choices_usage_so_far_in_every_chunk(client, path):
    # vLLM's `continuous_usage_stats`: every chunk carries its choice's usage so far (the
    # role's opening none of the answer yet, the finish all of it), as vLLM's server does
    body = {
        "model": "furnace-slow",
        "n": 2,
        "max_tokens": 8,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if path.endswith("chat/completions"):
        body["messages"] = user("a b c")
    else:
        body["prompt"] = "a b c"
    *content, last = chunks_of(client, path, body)
    assert last["choices"] == []
    assert last["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 6,
        "total_tokens": 9,
        **NO_CACHE,
    }
    seen: dict[int, list[tuple[str, int]]] = {0: [], 1: []}
    for chunk in content:
        (choice,) = chunk["choices"]
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == 3
        assert usage["total_tokens"] == 3 + usage["completion_tokens"]
        text = choice["delta"].get("content", "") if "delta" in choice else choice["text"]
        seen[choice["index"]].append((text, usage["completion_tokens"]))
    for said in seen.values():
        words = 0
        for text, so_far in said:
            words += len(text.split())
            assert so_far == words  # the demo's tokens are its words
        assert said[-1][1] == 3  # the finish chunk counts the whole choice
    if path.endswith("chat/completions"):
        assert all(said[0] == ("", 0) for said in seen.values())  # the role's opening


def test_continuous_usage_asks_nothing_without_include_usage(client):
    # as vLLM's server reads it: a modifier of `include_usage`
    body = {
        "model": "furnace-demo",
        "messages": user("a b"),
        "stream_options": {"continuous_usage_stats": True},
    }
    chunks = chunks_of(client, "/v1/chat/completions", body)
    assert all("usage" not in chunk for chunk in chunks)


def test_n_choices_stream_sdk_async(gateway):
    async def main() -> None:
        async with async_sdk(gateway) as sdk:
            stream = await sdk.completions.create(
                model="furnace-slow",
                prompt="x y z",
                n=2,
                stream=True,
                stream_options={"include_usage": True},
            )
            texts, reasons, usage = {0: "", 1: ""}, {}, None
            async for chunk in stream:
                for choice in chunk.choices:
                    texts[choice.index] += choice.text
                    if choice.finish_reason:
                        reasons[choice.index] = choice.finish_reason
                usage = chunk.usage or usage
            assert texts == {0: "x y z", 1: "x y z"}
            assert reasons == {0: "stop", 1: "stop"}
            assert (usage.prompt_tokens, usage.completion_tokens) == (3, 6)

    anyio.run(main)


def test_n_choices_count_every_choice_in_metrics_and_the_access_log(client, caplog):
    caplog.set_level(logging.INFO, logger="furnace.access")

    def tokens() -> tuple[int, int]:
        demo = client.get("/metrics/json").json()["models"]["furnace-demo"]
        return demo["prompt_tokens"], demo["completion_tokens"]

    before = tokens()
    for stream in (False, True):
        body = {"prompt": "a b c d", "n": 3, "max_tokens": 3, "stream": stream}
        assert client.post("/v1/completions", json=body).status_code == 200
    wait_until(lambda: tokens() == (before[0] + 8, before[1] + 18), "the tokens of both requests")
    wait_until(lambda: len(access_lines(caplog)) >= 2, "both access-log lines")
    for line in access_lines(caplog)[-2:]:
        assert (line["prompt_tokens"], line["completion_tokens"]) == (4, 9)
        assert line["outcome"] == "completed"


def test_a_client_leaving_an_n_choice_stream_cancels_every_choice(client, workers):
    words = " ".join(f"w{i}" for i in range(200))
    body = {"model": "furnace-slow", "prompt": words, "n": 3, "stream": True}
    aborted = workers.slow_engine.aborted
    with client.stream("POST", "/v1/completions", json=body) as response:
        lines = opened(response)
        next(lines)
    wait_until(lambda: workers.slow_engine.running == 0, "the slow worker's generations to stop")
    assert workers.slow_engine.aborted == aborted + 3  # stopped, not run to their end


# logprobs


def check_chat_token(item: dict, top: int) -> None:
    assert item["logprob"] == -1.0
    assert item["bytes"] == list(item["token"].encode())
    assert [t["token"] for t in item["top_logprobs"]] == [item["token"]] + [
        f"<alt{i}>" for i in range(1, top)
    ]
    assert [t["logprob"] for t in item["top_logprobs"]] == [-1.0 - i for i in range(top)]
    assert all(t["bytes"] == list(t["token"].encode()) for t in item["top_logprobs"])


def test_chat_logprobs_whole(client, sdk):
    body = client.post(
        "/v1/chat/completions",
        json={"messages": user("héllo big world"), "logprobs": True, "top_logprobs": 2},
    ).json()
    logprobs = body["choices"][0]["logprobs"]
    assert set(logprobs) == {"content"}
    assert [t["token"] for t in logprobs["content"]] == ["héllo", " big", " world"]
    for item in logprobs["content"]:
        assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
        check_chat_token(item, 2)
    assert logprobs["content"][0]["bytes"] == [104, 195, 169, 108, 108, 111]

    reply = sdk.chat.completions.create(
        model="furnace-demo", messages=user("a b"), logprobs=True, top_logprobs=0
    )
    content = reply.choices[0].logprobs.content
    assert [(t.token, t.logprob, t.top_logprobs) for t in content] == [
        ("a", -1.0, []),
        (" b", -1.0, []),
    ]


def test_chat_logprobs_stream_each_chunk_carries_its_tokens(client, sdk):
    chunks = chunks_of(
        client,
        "/v1/chat/completions",
        {"model": "furnace-slow", "messages": user("a b c"), "logprobs": True, "top_logprobs": 2},
    )
    texts = [c for c in chunks if c["choices"][0]["delta"].get("content")]
    assert len(texts) >= 2
    for chunk in texts:
        choice = chunk["choices"][0]
        items = choice["logprobs"]["content"]
        assert "".join(t["token"] for t in items) == choice["delta"]["content"]
        for item in items:
            check_chat_token(item, 2)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}

    stream = sdk.chat.completions.create(
        model="furnace-demo", messages=user("a b c"), logprobs=True, top_logprobs=3, stream=True
    )
    tokens = [
        t.token
        for c in stream
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert tokens == ["a", " b", " c"]


def test_no_logprobs_asked_is_null(client):
    body = client.post("/v1/chat/completions", json={"messages": user("a")}).json()
    assert body["choices"][0]["logprobs"] is None
    chunks = chunks_of(client, "/v1/completions", {"prompt": "a b", "echo": True})
    assert all(c["choices"][0]["logprobs"] is None for c in chunks)


def test_completion_logprobs_whole_and_streamed(client, sdk):
    completion = sdk.completions.create(model="furnace-demo", prompt="one two three", logprobs=3)
    logprobs = completion.choices[0].logprobs
    assert logprobs.tokens == ["one", " two", " three"]
    assert logprobs.token_logprobs == [-1.0, -1.0, -1.0]
    assert logprobs.top_logprobs == [
        {token: -1.0, "<alt1>": -2.0, "<alt2>": -3.0} for token in logprobs.tokens
    ]
    assert logprobs.text_offset == [0, 3, 7]

    chunks = chunks_of(
        client,
        "/v1/completions",
        {"model": "furnace-slow", "prompt": "one two three", "logprobs": 1},
    )
    tokens, offsets = [], []
    for chunk in chunks:
        choice = chunk["choices"][0]
        if choice["text"]:
            logprobs = choice["logprobs"]
            assert "".join(logprobs["tokens"]) == choice["text"]
            assert logprobs["top_logprobs"] == [{t: -1.0} for t in logprobs["tokens"]]
            tokens += logprobs["tokens"]
            offsets += logprobs["text_offset"]
    assert tokens == ["one", " two", " three"]
    assert offsets == [0, 3, 7]  # offsets run over the whole choice, not the chunk
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_logprobs_with_n_choices(sdk):
    reply = sdk.chat.completions.create(
        model="furnace-demo", messages=user("x y"), n=2, logprobs=True, top_logprobs=1
    )
    for choice in reply.choices:
        assert [t.token for t in choice.logprobs.content] == ["x", " y"]


# tool calls


def test_tool_choice_required_calls_the_first_tool(sdk):
    reply = sdk.chat.completions.create(
        model="furnace-demo",
        messages=user("what is up"),
        tools=[WEATHER, TIME],
        tool_choice="required",
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function"
    assert call.id.startswith("call_") and len(call.id) == 5 + 24
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == WEATHER_ARGS
    assert reply.usage.completion_tokens > 0


def test_tool_choice_named_whole_raw_shape(client):
    body = client.post(
        "/v1/chat/completions",
        json={
            "messages": user("hi"),
            "tools": [WEATHER, TIME],
            "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        },
    ).json()
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "stop"  # a named call stops, as OpenAI and vLLM say
    message = choice["message"]
    assert message["role"] == "assistant" and message["content"] is None
    (call,) = message["tool_calls"]
    assert set(call) == {"id", "type", "function"}
    assert call["function"]["name"] == "get_time"
    assert json.loads(call["function"]["arguments"]) == TIME_ARGS


def test_tool_calls_streamed_accumulate_to_the_same_call(client, sdk):
    body = {"messages": user("hi"), "tools": [WEATHER], "tool_choice": "required"}
    chunks = chunks_of(client, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    pieces = [c["choices"][0]["delta"]["tool_calls"] for c in chunks[1:-1]]
    assert all(len(p) == 1 and p[0]["index"] == 0 for p in pieces)
    first, *rest = (p[0] for p in pieces)
    assert first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"] == {"name": "get_weather", "arguments": ""}
    assert len(rest) >= 2  # the arguments in pieces
    assert all(
        set(p) == {"index", "function"} and set(p["function"]) == {"arguments"} for p in rest
    )
    assert all(len(p["function"]["arguments"]) <= 8 for p in rest)
    arguments = "".join(p["function"]["arguments"] for p in rest)
    assert json.loads(arguments) == WEATHER_ARGS
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert chunks[-1]["choices"][0]["delta"] == {}

    # the SDK's view: one call whose pieces add up
    calls: dict[int, dict] = {}
    reasons = []
    for chunk in sdk.chat.completions.create(
        model="furnace-demo", stream=True, **{k: v for k, v in body.items()}
    ):
        delta = chunk.choices[0].delta
        for piece in delta.tool_calls or []:
            call = calls.setdefault(piece.index, {"id": None, "name": None, "arguments": ""})
            if piece.id:
                assert call["id"] is None  # once, in the first piece
                call["id"], call["name"] = piece.id, piece.function.name
            call["arguments"] += piece.function.arguments or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert list(calls) == [0]
    assert calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == WEATHER_ARGS
    assert reasons[-1] == "tool_calls"


def test_parallel_tool_calls_by_index(gateway):
    async def main() -> None:
        async with async_sdk(gateway) as sdk:
            reply = await sdk.chat.completions.create(
                model="furnace-demo",
                messages=user("get_weather and get_time please"),
                tools=[WEATHER, TIME],
            )
            calls = reply.choices[0].message.tool_calls
            assert [c.function.name for c in calls] == ["get_weather", "get_time"]
            assert [json.loads(c.function.arguments) for c in calls] == [WEATHER_ARGS, TIME_ARGS]
            assert len({c.id for c in calls}) == 2

            stream = await sdk.chat.completions.create(
                model="furnace-demo",
                messages=user("get_weather and get_time please"),
                tools=[WEATHER, TIME],
                stream=True,
            )
            arguments: dict[int, str] = {}
            names: dict[int, str] = {}
            async for chunk in stream:
                for piece in chunk.choices[0].delta.tool_calls or []:
                    if piece.function.name:
                        names[piece.index] = piece.function.name
                    arguments[piece.index] = arguments.get(piece.index, "") + (
                        piece.function.arguments or ""
                    )
            assert names == {0: "get_weather", 1: "get_time"}
            assert json.loads(arguments[1]) == TIME_ARGS

            single = await sdk.chat.completions.create(
                model="furnace-demo",
                messages=user("get_weather and get_time please"),
                tools=[WEATHER, TIME],
                parallel_tool_calls=False,
            )
            assert [c.function.name for c in single.choices[0].message.tool_calls] == [
                "get_weather"
            ]

    anyio.run(main)


def test_tool_choice_auto_without_a_call_answers_text(sdk):
    reply = sdk.chat.completions.create(
        model="furnace-demo", messages=user("nothing to call"), tools=[WEATHER]
    )
    choice = reply.choices[0]
    assert choice.message.content == "nothing to call"
    assert choice.message.tool_calls is None
    assert choice.finish_reason == "stop"


def test_tool_calls_with_n_choices(client):
    body = client.post(
        "/v1/chat/completions",
        json={"messages": user("hi"), "tools": [TIME], "tool_choice": "required", "n": 2},
    ).json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for choice in body["choices"]:
        (call,) = choice["message"]["tool_calls"]
        assert json.loads(call["function"]["arguments"]) == TIME_ARGS
        assert choice["finish_reason"] == "tool_calls"


# JSON answers


def test_response_format_json_schema_answer_parses(sdk):
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "tags": {"type": "array"},
            "ok": {"type": "boolean"},
        },
        "required": ["name", "tags", "ok"],
    }
    reply = sdk.chat.completions.create(
        model="furnace-demo",
        messages=user("describe it"),
        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema}},
    )
    assert json.loads(reply.choices[0].message.content) == {"name": "", "tags": [], "ok": False}
    stream = sdk.chat.completions.create(
        model="furnace-demo",
        messages=user("describe it"),
        response_format={"type": "json_object"},
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream)
    assert json.loads(text) == {}


# echo


def test_completion_echo_whole_and_streamed(client, sdk):
    completion = sdk.completions.create(model="furnace-demo", prompt="a b c", echo=True)
    assert completion.choices[0].text == "a b ca b c"
    assert completion.usage.completion_tokens == 3  # the echo is not generated

    chunks = chunks_of(
        client, "/v1/completions", {"model": "furnace-slow", "prompt": "x y", "echo": True}
    )
    texts = [chunk["choices"][0]["text"] for chunk in chunks]
    assert texts[0] == "x y"  # the prompt is the first delta
    assert "".join(texts) == "x yx y"


def test_completion_echo_with_n_choices(client, sdk):
    completion = sdk.completions.create(model="furnace-demo", prompt="a b c", echo=True, n=2)
    assert [c.text for c in completion.choices] == ["a b ca b c"] * 2

    chunks = chunks_of(
        client, "/v1/completions", {"model": "furnace-slow", "prompt": "x y", "echo": True, "n": 2}
    )
    by_index: dict[int, list[str]] = {0: [], 1: []}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        by_index[choice["index"]].append(choice["text"])
    for texts in by_index.values():
        assert texts[0] == "x y"  # the first delta of each choice is the prompt
        assert "".join(texts) == "x yx y"


def test_plain_answers_keep_their_shape(client):
    # one choice, no extras: the fast path's bytes, as before
    response = client.post(
        "/v1/chat/completions", json={"messages": user("a b"), "stream": True, "n": 1}
    )
    assert b'"delta":{"role":"assistant","content":""}' in response.content
    assert sse_events(response.text)[-2]["choices"][0]["finish_reason"] == "stop"


# the encoders themselves


def normalized(encoder, data: bytes) -> bytes:
    """`data` with the encoder's id and time replaced, to compare two encoders' bytes."""
    data = data.replace(encoder.id.encode(), b"ID")
    return data.replace(b'"created":%d' % encoder.created, b'"created":0')


@pytest.mark.parametrize("encoder_type", [ChatEncoder, CompletionEncoder])
def test_the_general_path_writes_what_the_fast_path_writes(encoder_type):
    fast = encoder_type("m", True)
    general = encoder_type("m", True, logprobs=False)
    general.plain = False
    assert fast.plain
    batches = [
        [Started(2), Text("a", 1)],
        [Text(" b", 1), Text(' "c"\n', 1)],
        [Text("", 0)],
        [Finished(FinishReason.STOP, 3)],
    ]
    expected = (
        fast.opening()
        + fast.delta("a")
        + fast.delta(' b "c"\n')
        + fast.closing(FinishReason.STOP, 2, 3)
    )
    got = b"".join(general.events(batch) for batch in batches) + general.end(2, 3)
    assert normalized(general, got) == normalized(fast, expected)


def test_chunks_per_run_of_a_choice_with_its_logprobs():
    encoder = CompletionEncoder("m", choices=2, logprobs=True)
    lp = TokenLogprob
    batch = [
        Text("a", 1, 0, (lp("a", -0.5, (("a", -0.5), ("b", -1.5))),)),
        Text("b", 1, 0, (lp("b", float("-inf")),)),
        Text("c", 1, 1, (lp("c", -0.25),)),
        Finished(FinishReason.LENGTH, 2, None, 0),
    ]
    chunks = [c for c in sse_events(encoder.events(batch).decode())]
    assert [(c["choices"][0]["index"], c["choices"][0]["text"]) for c in chunks] == [
        (0, "ab"),
        (1, "c"),
        (0, ""),
    ]
    assert chunks[0]["choices"][0]["logprobs"] == {
        "tokens": ["a", "b"],
        "token_logprobs": [-0.5, -9999.0],
        "top_logprobs": [{"a": -0.5, "b": -1.5}, {"b": -9999.0}],
        "text_offset": [0, 1],
    }
    assert chunks[2]["choices"][0]["finish_reason"] == "length"


def test_a_record_finishes_with_its_last_choice():
    record = RequestRecord("r")
    record.expect(2)
    call = ToolCallDelta(1, 0, "call_x", "f", "", 0)
    assert (
        record.take([Started(4), Text("a", 1, 0), call, ToolCallDelta(1, 0, "", "", "{}", 1)])
        == "a"
    )
    assert record.tokens_sent == 2  # a tool call's pieces count as sent tokens
    record.take([Finished(FinishReason.STOP, 1, None, 0)])
    assert record.finished is None  # choice 1 is still running
    record.take([Finished(FinishReason.TOOL_CALLS, 1, None, 1)])
    assert record.finished is not None
    assert (record.prompt_tokens, record.completion_tokens) == (4, 2)
