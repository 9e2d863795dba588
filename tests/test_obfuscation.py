"""Specs: OpenAI's `stream_options.include_obfuscation` through the real gateway, its demo
workers and an OpenAI-compatible upstream that reasons. Asked for (`true`), every chunk of
a chat's or a completion's stream carries an `obfuscation` string of random alphanumeric
characters, as OpenAI's chunks do, and on the Responses API every delta event
(`response.*.delta`) does; nothing else changes, the text least of all. Not asked for, or
`false`, no chunk carries one: vLLM's server sends none, and the gateway's default is
vLLM's (OpenAI's is on). A value that is not a boolean is a 400 naming it.

The padding takes a chunk's bytes to the next multiple of 16 and adds a random tail of
0 to 15 characters, so its length varies with the chunk's and with chance."""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from gateway.config import ModelConfig
from gateway.edge.openai.encoding import PAD_BUCKET
from tests.support.openai_server import OpenAIServer
from tests.support.requests import assert_openai_error, user
from tests.support.servers import DEMO_MODEL, Gateway
from tests.support.streams import noted_writes
from tests.support.waiting import HANG_GUARD

WORDS = "one two three four five six seven eight"
PADDED = {"include_obfuscation": True}
#: The key a padded chunk ends with, and its padding.
_PADDING = re.compile(rb',"obfuscation":"([A-Za-z0-9]*)"}\n\n\Z')
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def events(http: httpx.Client, path: str, body: dict[str, Any]) -> list[bytes]:
    """A stream's SSE events, each whole as it was sent (with its `\\n\\n`)."""
    with http.stream("POST", path, json=body) as response:
        assert response.status_code == 200, response.read()
        raw = response.read()
    return [event + b"\n\n" for event in raw.split(b"\n\n") if event]


def padding(event: bytes) -> bytes | None:
    """An event's padding (None: it has none), checked to be its JSON's last key."""
    found = _PADDING.search(event)
    assert found is not None or b'"obfuscation"' not in event, event
    return None if found is None else found.group(1)


def assert_padded(event: bytes) -> None:
    """The padding takes the event's bytes without it to a multiple of the bucket, and
    adds less than a bucket more."""
    pad = padding(event)
    assert pad is not None and event.count(b'"obfuscation"') == 1, event
    bare = len(event) - len(b',"obfuscation":""') - len(pad)
    assert 0 <= len(pad) - (-bare % PAD_BUCKET) < PAD_BUCKET, (len(pad), bare)


def padded_deltas(raw: list[bytes]) -> list[bytes]:
    """The kinds of a Responses stream's events, after checking that its delta events,
    and only those, are padded."""
    kinds = [event.split(b"\n", 1)[0].removeprefix(b"event: ") for event in raw]
    for kind, event in zip(kinds, raw, strict=True):
        if kind.endswith(b".delta"):
            assert_padded(event)
        else:
            assert padding(event) is None
    return kinds


def chunks(raw: list[bytes]) -> list[dict[str, Any]]:
    return [orjson.loads(event[6:]) for event in raw if event.startswith(b"data: {")]


def content(raw: list[bytes], index: int = 0) -> str:
    return "".join(
        choice["text"] if "text" in choice else choice["delta"].get("content") or ""
        for chunk in chunks(raw)
        for choice in chunk["choices"]
        if choice["index"] == index
    )


# -- chat and completions: every chunk -------------------------------------------------------


def test_the_sdk_reads_a_padded_chat_stream_and_its_text_is_unchanged(api):
    options = {**PADDED, "include_usage": True}
    padded, again = (
        list(
            api.chat.completions.create(
                model=DEMO_MODEL, messages=user(WORDS), stream=True, stream_options=options
            )
        )
        for _ in range(2)
    )
    plain = list(
        api.chat.completions.create(
            model=DEMO_MODEL,
            messages=user(WORDS),
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    # every chunk: the role's opening, the texts, the finish, the usage
    assert all(isinstance(chunk.obfuscation, str) for chunk in padded)
    assert all(chunk.obfuscation is None for chunk in plain)

    def text(stream: list[Any]) -> str:
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    assert text(padded) == text(plain) == WORDS
    assert padded[-1].usage is not None and padded[-1].usage.completion_tokens == 8
    assert text(again) == WORDS
    # not one fixed length
    assert len({len(chunk.obfuscation or "") for chunk in padded + again}) > 1


@pytest.mark.parametrize("options", [None, {}, {"include_obfuscation": False}])
def test_a_stream_that_does_not_ask_is_not_padded(client, options):
    body: dict[str, Any] = {"model": DEMO_MODEL, "messages": user(WORDS), "stream": True}
    if options is not None:
        body["stream_options"] = options
    raw = events(client, "/v1/chat/completions", body)
    assert content(raw) == WORDS
    assert not any(b"obfuscation" in event for event in raw)


def test_every_chunk_is_padded_to_a_bucket_and_a_random_tail(client):
    body = {
        "model": DEMO_MODEL,
        "messages": user(WORDS + ' "quoted" and caf\u00e9'),  # escaped, multi-byte
        "stream": True,
        "stream_options": {**PADDED, "include_usage": True},
    }
    lengths = set()
    for _ in range(3):
        raw = events(client, "/v1/chat/completions", body)
        assert raw[-1] == b"data: [DONE]\n\n"
        for event in raw[:-1]:
            assert_padded(event)
            lengths.add(len(padding(event) or b""))
        assert content(raw) == WORDS + ' "quoted" and caf\u00e9'
    assert len(lengths) > 3


def said(raw: list[bytes]) -> dict[int, Any]:
    """What each choice of a chat stream says, whatever its chunk boundaries: its text,
    its tool calls' names and arguments, its logprobs' tokens."""
    out: dict[int, Any] = {}
    for chunk in chunks(raw):
        for choice in chunk["choices"]:
            text, calls, tokens = out.setdefault(choice["index"], ([], {}, []))
            text.append(choice["delta"].get("content") or "")
            for call in choice["delta"].get("tool_calls", ()):
                function = call["function"]
                calls.setdefault(call["index"], []).append(
                    function.get("name", "") + function["arguments"]
                )
            if choice["logprobs"]:
                tokens += [
                    (t["token"], len(t["top_logprobs"])) for t in choice["logprobs"]["content"]
                ]
    return {
        index: ("".join(text), {k: "".join(v) for k, v in calls.items()}, tokens)
        for index, (text, calls, tokens) in out.items()
    }


@pytest.mark.parametrize(
    "extra",
    [
        {"n": 3},
        {"n": 2, "logprobs": True, "top_logprobs": 2},
        {"tools": [WEATHER], "tool_choice": "required"},
        {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    ],
    ids=["n", "logprobs", "tools", "continuous-usage"],
)
def test_every_shape_of_chat_stream_is_padded(client, extra):
    """The events path (choices apart, logprobs, tool calls' pieces, usage in every chunk):
    every chunk padded, what it says unchanged."""
    base = {"model": DEMO_MODEL, "messages": user("get_weather " + WORDS), "stream": True}
    plain = events(client, "/v1/chat/completions", {**base, **extra})
    options = {**extra.get("stream_options", {}), **PADDED}
    padded = events(client, "/v1/chat/completions", {**base, **extra, "stream_options": options})
    assert not any(b"obfuscation" in event for event in plain)
    assert padded[-1] == b"data: [DONE]\n\n"
    for event in padded[:-1]:
        assert_padded(event)
    assert said(padded) == said(plain)
    assert len(said(padded)) == extra.get("n", 1)


def test_a_completion_stream_is_padded_too(client):
    """OpenAI's completions take the chat's `stream_options`, `include_obfuscation` with it."""
    body = {"model": DEMO_MODEL, "prompt": WORDS, "stream": True}
    for extra in ({}, {"echo": True, "n": 2}):
        padded = events(client, "/v1/completions", {**body, **extra, "stream_options": PADDED})
        plain = events(client, "/v1/completions", {**body, **extra})
        for event in padded[:-1]:
            assert_padded(event)
        assert not any(b"obfuscation" in event for event in plain)
        assert content(padded) == content(plain) == (WORDS + WORDS if extra else WORDS)


def test_a_paced_streams_tokens_written_in_their_callbacks_are_padded(
    gateway, monkeypatch: pytest.MonkeyPatch
):
    written = noted_writes(monkeypatch)
    body = {
        "model": "furnace-slow",  # a token every 50 ms: each comes while the edge waits
        "messages": user("one two three four"),
        "stream": True,
        "stream_options": PADDED,
    }
    with httpx.Client(base_url=gateway.url, timeout=HANG_GUARD) as http:
        raw = events(http, "/v1/chat/completions", body)
    assert content(raw) == "one two three four"
    assert len(written) >= 3
    for write in written:
        for event in write.split(b"\n\n")[:-1]:
            assert_padded(event + b"\n\n")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("value", ["yes", 1, {}])
def test_a_value_that_is_not_a_boolean_is_refused_by_name(client, path, value):
    body: dict[str, Any] = {"model": DEMO_MODEL, "stream": True}
    body.update({"messages": user("hi")} if "chat" in path else {"prompt": "hi"})
    answer = client.post(path, json={**body, "stream_options": {"include_obfuscation": value}})
    assert answer.status_code == 400, answer.text
    assert assert_openai_error(answer)["param"] == "stream_options.include_obfuscation"


def test_without_stream_it_asks_nothing(client):
    answer = client.post(
        "/v1/chat/completions",
        json={"model": DEMO_MODEL, "messages": user("one two"), "stream_options": PADDED},
    )
    assert answer.status_code == 200 and b"obfuscation" not in answer.content
    assert answer.json()["choices"][0]["message"]["content"] == "one two"


# -- the Responses API: its delta events ----------------------------------------------------


def test_the_sdk_reads_padded_delta_events_of_a_response(api):
    padded = list(
        api.responses.create(model=DEMO_MODEL, input=WORDS, stream=True, stream_options=PADDED)
    )
    deltas = [e for e in padded if e.type.endswith(".delta")]
    assert deltas and all(isinstance(getattr(e, "obfuscation", None), str) for e in deltas)
    assert not any(hasattr(e, "obfuscation") for e in padded if not e.type.endswith(".delta"))
    assert "".join(e.delta for e in deltas) == WORDS
    assert [e.sequence_number for e in padded] == list(range(len(padded)))
    plain = list(api.responses.create(model=DEMO_MODEL, input=WORDS, stream=True))
    assert not any(hasattr(e, "obfuscation") for e in plain)
    assert [e.type for e in plain] == [e.type for e in padded]
    # the SDK's stream helper, which builds its own events, reads it too
    with api.responses.stream(model=DEMO_MODEL, input=WORDS, stream_options=PADDED) as stream:
        assert "".join(e.delta for e in stream if e.type == "response.output_text.delta") == WORDS
        assert stream.get_final_response().output_text == WORDS


def test_a_responses_function_call_s_argument_deltas_are_padded(client):
    body = {
        "model": DEMO_MODEL,
        "input": "get_weather please",
        "tools": [{"type": "function", **WEATHER["function"]}],
        "tool_choice": "required",
        "stream": True,
        "stream_options": PADDED,
    }
    raw = events(client, "/v1/responses", body)
    kinds = padded_deltas(raw)
    assert b"response.function_call_arguments.delta" in kinds
    arguments = b"".join(
        orjson.loads(event.split(b"data: ", 1)[1])["delta"].encode()
        for kind, event in zip(kinds, raw, strict=True)
        if kind == b"response.function_call_arguments.delta"
    )
    done = next(e for k, e in zip(kinds, raw, strict=True) if k.endswith(b"arguments.done"))
    assert orjson.loads(done.split(b"data: ", 1)[1])["arguments"] == arguments.decode()


@pytest.mark.parametrize("value", ["yes", 1])
def test_a_response_s_value_that_is_not_a_boolean_is_refused_by_name(client, value):
    body = {"model": DEMO_MODEL, "input": "hi", "stream": True}
    answer = client.post(
        "/v1/responses", json={**body, "stream_options": {"include_obfuscation": value}}
    )
    assert answer.status_code == 400, answer.text
    assert assert_openai_error(answer)["param"] == "stream_options.include_obfuscation"


def test_retrieving_a_response_takes_include_obfuscation(api, client):
    """It shapes a stream alone; a stored response is not streamed (`stream` is refused)."""
    created = api.responses.create(model=DEMO_MODEL, input="kept")
    for value in (True, False):
        kept = api.responses.retrieve(created.id, include_obfuscation=value)
        assert kept.output_text == "kept"
    answer = client.get(f"/v1/responses/{created.id}", params={"include_obfuscation": "yes"})
    assert answer.status_code == 400
    assert assert_openai_error(answer)["param"] == "include_obfuscation"


# -- reasoning, from an OpenAI-compatible upstream -------------------------------------------

THINKER = "thinker"


@pytest.fixture
def thinker(server_loop, gateway_with) -> Iterator[Gateway]:
    """A gateway in front of an upstream that thinks before its reply."""
    key = "sk-" + secrets.token_hex(8)
    server = OpenAIServer(THINKER, key, None)
    server.reasoning = ["The user ", "says hi; ", "I greet back."]
    server_loop.call(server.start())
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("THINKER_KEY", key)
        model = ModelConfig(
            THINKER, workers=(server.url,), upstream="openai", api_key_env="THINKER_KEY"
        )
        yield gateway_with(models=(model,))
    server_loop.call(server.stop())


def test_reasoning_deltas_are_padded(thinker):
    with httpx.Client(base_url=thinker.url, timeout=HANG_GUARD) as http:
        chat = events(
            http,
            "/v1/chat/completions",
            {"model": THINKER, "messages": user("hi"), "stream": True, "stream_options": PADDED},
        )
        response = events(
            http,
            "/v1/responses",
            {"model": THINKER, "input": "hi", "stream": True, "stream_options": PADDED},
        )
    for event in chat[:-1]:
        assert_padded(event)
    thought = [c["choices"][0]["delta"].get("reasoning") for c in chunks(chat) if c["choices"]]
    assert "".join(filter(None, thought)) == "The user says hi; I greet back."
    assert b"response.reasoning_text.delta" in padded_deltas(response)
