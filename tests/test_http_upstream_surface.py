"""The OpenAI surface through an `upstream: openai` model, read with the official
openai SDK: against vLLM's own OpenAI server (its CPU build, the tiny model, tools
and structured outputs on: tests/support/vllm.py), each answer is checked for what
it must hold and compared with what vLLM answers the same request directly, streamed
and not (greedy or seeded, so both answers are the same tokens): tool calls whose
arguments validate their schema, json_schema answers, logprobs, n choices, vLLM's
extra sampling fields, and vLLM's own 400 for a parameter it refuses, relayed naming
it. Embeddings against our small OpenAI-compatible server (tests/support/openai_server.py).

Streams are compared by what they say in order (a role, content, a call's start and
arguments, a finish, the usage), not by chunk boundaries: the gateway merges pieces
that reach it together. After each test nothing is left in the gateway or in vLLM.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import jsonschema
import openai
import pytest

from gateway.config import ModelConfig
from gateway.protocol.types import (
    Finished,
    GenerateRequest,
    Message,
    SamplingParams,
    Started,
    Text,
)
from gateway.upstreams.openai_http import OpenAIHttpUpstream
from tests.support.certs import CertificateAuthority
from tests.support.conformance import vllm_metric
from tests.support.fronts import gateway_over, openai_at
from tests.support.openai_server import CACHED, OpenAIServer, embedding
from tests.support.requests import user
from tests.support.servers import Gateway, assert_nothing_left
from tests.support.vllm import VllmProcess
from tests.support.waiting import HANG_GUARD, wait_until

MODEL = "tiny-vllm"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome"]},
        "celsius": {"type": "boolean"},
    },
    "required": ["city", "celsius"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
ANSWER = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]},
        "sure": {"type": "boolean"},
    },
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


def sdk(base_url: str) -> openai.OpenAI:
    return openai_at(base_url, max_retries=0)


@pytest.fixture(scope="module")
def front(server_loop, vllm_http: VllmProcess) -> Iterator[Gateway]:
    """A gateway with vLLM's server as the model's only worker."""
    url = f"http://127.0.0.1:{vllm_http.port}/v1"
    model = ModelConfig(MODEL, workers=(url,), upstream="openai")
    with gateway_over(server_loop, (model,)) as gw:
        yield gw


@pytest.fixture
def through(front: Gateway, vllm_http: VllmProcess) -> Iterator[openai.OpenAI]:
    """The SDK through the gateway; after the test, nothing left in it or in vLLM."""
    with sdk(front.url + "/v1") as client:
        yield client
    assert_nothing_left(front, None)
    running = lambda: vllm_metric(vllm_http.port, "vllm:num_requests_running")  # noqa: E731
    wait_until(lambda: running() == 0, "vLLM to be idle")


@pytest.fixture
def direct(vllm_http: VllmProcess) -> Iterator[openai.OpenAI]:
    """The SDK straight to vLLM, for the same requests."""
    with sdk(f"http://127.0.0.1:{vllm_http.port}/v1") as client:
        yield client


def both(through: openai.OpenAI, direct: openai.OpenAI, **request: Any) -> tuple[Any, Any]:
    """The gateway's answer and vLLM's own to one request, whole."""
    return (
        through.chat.completions.create(model=MODEL, **request),
        direct.chat.completions.create(model=MODEL, **request),
    )


def streams(through: openai.OpenAI, direct: openai.OpenAI, **request: Any) -> tuple[list, list]:
    """Both streams' chunks for one request, with usage."""
    fields = {"model": MODEL, "stream": True, "stream_options": {"include_usage": True}}
    return (
        list(through.chat.completions.create(**fields, **request)),
        list(direct.chat.completions.create(**fields, **request)),
    )


def said(chunks: list[Any]) -> list[str]:
    """What a stream says, in order, one entry per kind of thing in a row."""
    out: list[str] = []
    for chunk in chunks:
        for choice in chunk.choices:
            delta, i = choice.delta, choice.index
            if delta.role:
                out.append(f"{i} role {delta.role}")
            # text and its logprobs are one kind: the gateway may carry in one chunk
            # what vLLM sent in several (pieces that arrive together are merged)
            if delta.content or (choice.logprobs and choice.logprobs.content):
                out.append(f"{i} text")
            for call in delta.tool_calls or ():
                if call.id:
                    out.append(f"{i} call {call.index} {call.type} {call.function.name}")
                if call.function and call.function.arguments:
                    out.append(f"{i} arguments {call.index}")
            if choice.finish_reason:
                out.append(f"{i} finish {choice.finish_reason}")
        if chunk.usage is not None:
            out.append("usage")
    return [item for n, item in enumerate(out) if n == 0 or out[n - 1] != item]


def streamed_calls(chunks: list[Any]) -> dict[tuple[int, int], dict[str, str]]:
    """Each (choice, call)'s id, name and whole arguments, from a stream."""
    calls: dict[tuple[int, int], dict[str, str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or ():
                entry = calls.setdefault((choice.index, call.index), {"arguments": ""})
                if call.id:
                    entry.update(id=call.id, name=call.function.name)
                entry["arguments"] += call.function.arguments or ""
    return calls


def usage_of(chunks: list[Any]) -> tuple[int, int]:
    usage = chunks[-1].usage
    return usage.prompt_tokens, usage.completion_tokens


# -- tool calls -------------------------------------------------------------------

NAMED = {
    "messages": user("weather"),
    "tools": TOOLS,
    "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    "max_tokens": 60,
    "temperature": 0,
}
#: The random model closes `required`'s array of calls only when sampling finds it:
#: this seed does, with these tools and this prompt (greedy never does).
REQUIRED = {**NAMED, "tool_choice": "required", "temperature": 1, "seed": 4, "max_tokens": 80}


@pytest.mark.vllm
@pytest.mark.parametrize("request_fields", [NAMED, REQUIRED], ids=["named", "required"])
def test_a_forced_tool_choice_answers_with_a_call_that_validates(through, direct, request_fields):
    ours, theirs = both(through, direct, **request_fields)
    calls = ours.choices[0].message.tool_calls
    assert calls and len(calls) == len(theirs.choices[0].message.tool_calls)
    for call, their_call in zip(calls, theirs.choices[0].message.tool_calls, strict=True):
        assert call.type == "function"
        assert call.id and call.id != their_call.id  # ours, not vLLM's
        assert call.function.name == their_call.function.name
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        # the same JSON (vLLM re-serializes a whole answer's `required` calls with spaces;
        # the gateway reads vLLM's stream, which has the model's own text)
        assert json.loads(call.function.arguments) == json.loads(their_call.function.arguments)
    if request_fields is NAMED:
        assert calls[0].function.name == "get_weather"
    assert ours.choices[0].finish_reason == theirs.choices[0].finish_reason
    assert ours.usage.completion_tokens == theirs.usage.completion_tokens


@pytest.mark.vllm
@pytest.mark.parametrize("request_fields", [NAMED, REQUIRED], ids=["named", "required"])
def test_a_streamed_tool_call_reads_as_vllms_own(through, direct, request_fields):
    ours, theirs = streams(through, direct, **request_fields)
    assert said(ours) == said(theirs)
    our_calls, their_calls = streamed_calls(ours), streamed_calls(theirs)
    assert our_calls.keys() == their_calls.keys() and our_calls
    for key, call in our_calls.items():
        assert call["name"] == their_calls[key]["name"]
        assert call["arguments"] == their_calls[key]["arguments"]
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    assert usage_of(ours) == usage_of(theirs)


# -- structured outputs -----------------------------------------------------------

SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "answer", "schema": ANSWER, "strict": True},
}


@pytest.mark.vllm
def test_json_schema_answers_validate_whole_and_streamed(through, direct):
    request = {"messages": user("yes or no?"), "response_format": SCHEMA_FORMAT}
    request.update(max_tokens=40, temperature=0)
    ours, theirs = both(through, direct, **request)
    jsonschema.validate(json.loads(ours.choices[0].message.content), ANSWER)
    assert ours.choices[0].message.content == theirs.choices[0].message.content
    our_chunks, their_chunks = streams(through, direct, **request)
    assert said(our_chunks) == said(their_chunks)
    text = "".join(c.choices[0].delta.content or "" for c in our_chunks if c.choices)
    assert text == ours.choices[0].message.content


@pytest.mark.vllm
def test_json_object_answers_parse(through):
    reply = through.chat.completions.create(
        model=MODEL,
        messages=user("json please"),
        response_format={"type": "json_object"},
        max_tokens=40,
        temperature=0,
    )
    if reply.choices[0].finish_reason == "stop":  # the random model may run to max_tokens
        assert isinstance(json.loads(reply.choices[0].message.content), dict)


# -- logprobs ---------------------------------------------------------------------


@pytest.mark.vllm
def test_chat_logprobs_one_per_token_with_their_alternatives(through, direct):
    request = {"messages": user("hi"), "logprobs": True, "top_logprobs": 2}
    request.update(max_tokens=4, temperature=0)
    ours, theirs = both(through, direct, **request)
    content = ours.choices[0].logprobs.content
    assert len(content) == ours.usage.completion_tokens == 4
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    their_content = theirs.choices[0].logprobs.content
    assert [e.token for e in content] == [e.token for e in their_content]
    for entry, their_entry in zip(content, their_content, strict=True):
        assert entry.logprob == pytest.approx(their_entry.logprob, abs=1e-3)
        assert [t.token for t in entry.top_logprobs] == [t.token for t in their_entry.top_logprobs]
    our_chunks, their_chunks = streams(through, direct, **request)
    assert said(our_chunks) == said(their_chunks)
    streamed = [
        e.token
        for c in our_chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert streamed == [e.token for e in content]


@pytest.mark.vllm
def test_completion_logprobs_one_per_token(through, direct):
    request = {"model": MODEL, "prompt": "one two", "logprobs": 2, "max_tokens": 4}
    request["temperature"] = 0
    ours = through.completions.create(**request).choices[0].logprobs
    theirs = direct.completions.create(**request).choices[0].logprobs
    assert len(ours.tokens) == len(ours.token_logprobs) == len(ours.top_logprobs) == 4
    assert ours.tokens == theirs.tokens
    assert [list(t) for t in ours.top_logprobs] == [list(t) for t in theirs.top_logprobs]


# -- n choices --------------------------------------------------------------------


@pytest.mark.vllm
def test_n_choices_whole_and_interleaved_with_usage_summed(through, direct):
    request = {"messages": user("hi"), "n": 2, "max_tokens": 5, "temperature": 1, "seed": 3}
    ours, theirs = both(through, direct, **request)
    assert [c.index for c in ours.choices] == [0, 1]
    assert [c.message.content for c in ours.choices] == [c.message.content for c in theirs.choices]
    assert ours.usage.completion_tokens == theirs.usage.completion_tokens == 10
    our_chunks, their_chunks = streams(through, direct, **request)
    finishes = [c.choices[0].index for c in our_chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1]
    for index, choice in enumerate(ours.choices):
        text = "".join(
            c.choices[0].delta.content or ""
            for c in our_chunks
            if c.choices and c.choices[0].index == index
        )
        assert text == choice.message.content
    assert usage_of(our_chunks) == usage_of(their_chunks)


@pytest.mark.vllm
def test_the_upstream_reads_n_choices_as_one_finished_each(vllm_http, direct):
    """The upstream's own events, without the edge: each choice's text and its
    Finished, the tokens adding up to vLLM's usage."""
    request = GenerateRequest(
        MODEL,
        messages=(Message("user", "hi"),),
        sampling=SamplingParams(temperature=1, seed=3, max_tokens=5),
        n=2,
    )

    async def read() -> list[Any]:
        async with httpx.AsyncClient() as http:
            upstream = OpenAIHttpUpstream(f"http://127.0.0.1:{vllm_http.port}/v1", http)
            events = [event async for event in upstream.call(request, HANG_GUARD)]
            await upstream.close()
            return events

    events = anyio.run(read)
    assert events[0] == Started(0)
    finished = [e for e in events if type(e) is Finished]
    assert sorted(e.index for e in finished) == [0, 1]
    assert sum(e.completion_tokens for e in finished) == 10
    assert all(e.prompt_tokens and e.prompt_tokens > 0 for e in finished)
    theirs = direct.chat.completions.create(
        model=MODEL, messages=user("hi"), n=2, max_tokens=5, temperature=1, seed=3
    )
    for choice in theirs.choices:
        text = "".join(e.text for e in events if type(e) is Text and e.index == choice.index)
        assert text == choice.message.content


# -- token ids ---------------------------------------------------------------------


def _ids(client: openai.OpenAI, chat: bool, stream: bool) -> tuple[list[int], list[list[int]]]:
    """The prompt's ids and each of 2 choices' (a stream's joined) that `client` answers
    a seeded request of vLLM's `return_token_ids` with, chat or completion."""
    fields: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 8,
        "temperature": 1,  # seeded: vLLM samples n choices only above greedy
        "seed": 3,
        "n": 2,
        "stream": stream,
        "extra_body": {"return_token_ids": True},
    }
    if chat:
        made = client.chat.completions.create(messages=user("hello from the fleet"), **fields)
    else:
        made = client.completions.create(prompt="the quick brown fox", **fields)
    chunks = [c.model_dump() for c in made] if stream else [made.model_dump()]
    prompt: list[int] = []
    ids: list[list[int]] = [[], []]
    for chunk in chunks:
        prompt = prompt or chunk.get("prompt_token_ids") or []
        for choice in chunk["choices"]:
            prompt = prompt or choice.get("prompt_token_ids") or []
            ids[choice["index"]] += choice.get("token_ids") or []
    return prompt, ids


@pytest.mark.vllm
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
def test_return_token_ids_are_vllms_own(through, direct, chat, stream):
    """vLLM's `return_token_ids`: sent on, and the prompt's and each choice's ids read
    back from its chunks, as vLLM answers the request directly."""
    ours, theirs = _ids(through, chat, stream), _ids(direct, chat, stream)
    assert ours == theirs
    assert ours[0] and all(ours[1])


# -- sampling fields and refusals ------------------------------------------------------


@pytest.mark.vllm
def test_vllms_extra_sampling_fields_reach_it(through):
    extra = {"min_tokens": 6, "ignore_eos": True, "repetition_penalty": 1.2, "min_p": 0.05}
    reply = through.chat.completions.create(
        model=MODEL,
        messages=user("hi"),
        max_tokens=6,
        seed=11,
        user="team-a",
        logit_bias={"5": -100},
        stop=["never-said"],
        extra_body={**extra, "stop_token_ids": [7]},
    )
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 6


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"99999": 1}}, "logit_bias"),
        ({"extra_body": {"stop_token_ids": [99999]}}, "stop_token_ids"),
        (
            {"tools": TOOLS[:1], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
    ],
    ids=["logit_bias", "stop_token_ids", "tool_choice"],
)
def test_a_parameter_vllm_refuses_is_a_400_naming_it(through, direct, fields, param):
    for client in (through, direct):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=2, **fields)
        assert refused.value.status_code == 400
        assert refused.value.body["param"] == param


@pytest.mark.vllm
def test_an_image_for_a_text_model_is_vllms_400(through):
    content = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "text", "text": "what is this?"},
    ]
    with pytest.raises(openai.BadRequestError) as refused:
        through.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=2
        )
    assert "multimodal" in refused.value.body["message"]


# -- embeddings -------------------------------------------------------------------

EMBEDDER = "tiny-embedder"
KEY_ENV = "FURNACE_TEST_EMBEDDER_KEY"


@pytest.fixture
def embedder(gateway_with, server_loop, tmp_path, monkeypatch) -> Iterator[tuple]:
    """Our OpenAI-compatible server (TLS, a key) as an embedding model's worker."""
    ca = CertificateAuthority(tmp_path, "upstream-ca")
    server = OpenAIServer(EMBEDDER, "sk-" + secrets.token_hex(8), ca.issue("u", ips=("127.0.0.1",)))
    server_loop.call(server.start())
    monkeypatch.setenv(KEY_ENV, server.key)
    model = ModelConfig(
        EMBEDDER, workers=(server.url,), upstream="openai", api_key_env=KEY_ENV, ca_file=ca.ca_file
    )
    gw = gateway_with(models=(model,))
    with sdk(gw.url + "/v1") as client:
        yield client, server
    server_loop.call(server.stop())


def test_embeddings_of_texts_and_token_ids_come_from_the_upstream(embedder):
    client, server = embedder
    reply = client.embeddings.create(
        model=EMBEDDER, input=["one two", "three"], dimensions=4, user="team-a"
    )
    assert [d.index for d in reply.data] == [0, 1]
    for item, text in zip(reply.data, ["one two", "three"], strict=True):
        assert item.embedding == pytest.approx(embedding(text, 4), abs=1e-6)
    assert reply.usage.prompt_tokens == 3
    assert server.last_body == {
        "model": EMBEDDER,
        "input": ["one two", "three"],
        "encoding_format": "float",
        "dimensions": 4,
        "user": "team-a",
    }
    ids = client.embeddings.create(model=EMBEDDER, input=[[5, 6, 7]], encoding_format="float")
    assert ids.data[0].embedding == pytest.approx(embedding([5, 6, 7]), abs=1e-6)
    assert server.last_body["input"] == [[5, 6, 7]]


def test_an_embedding_parameter_the_upstream_refuses_is_a_400_naming_it(embedder):
    client, _ = embedder
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=EMBEDDER, input="x", dimensions=17)
    assert refused.value.body["param"] == "dimensions"


PICTURE = "data:image/png;base64,iVBORw0KGgo="


@pytest.mark.parametrize("stream", [False, True])
def test_content_parts_reach_the_upstream_in_order_with_their_detail(embedder, stream):
    client, server = embedder
    content = [
        {"type": "text", "text": "compare "},
        {"type": "image_url", "image_url": {"url": PICTURE, "detail": "low"}},
        {"type": "text", "text": "with "},
        {"type": "image_url", "image_url": {"url": "https://example.com/b.png"}},
    ]
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": content},
    ]
    reply = client.chat.completions.create(
        model=EMBEDDER, messages=messages, max_tokens=4, stream=stream
    )
    if stream:
        reply = list(reply)
    assert server.last_body["messages"] == messages


def test_a_bad_image_detail_is_a_400_naming_it(embedder):
    client, _ = embedder
    content = [{"type": "image_url", "image_url": {"url": PICTURE, "detail": "huge"}}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=EMBEDDER, messages=[{"role": "user", "content": content}], max_tokens=4
        )
    assert refused.value.body["param"] == "messages[0].content[0].image_url.detail"


def test_per_chunk_usage_is_a_400_naming_it_where_the_upstream_counts_at_the_end(embedder):
    # an OpenAI-compatible upstream says the prompt's tokens in its last chunk only
    client, _ = embedder
    options = {"include_usage": True, "continuous_usage_stats": True}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=EMBEDDER, messages=user("hi"), max_tokens=4, stream=True, stream_options=options
        )
    assert refused.value.body["param"] == "stream_options.continuous_usage_stats"


@pytest.mark.parametrize("stream", [True, False])
def test_a_named_tool_choice_the_upstream_ends_with_tool_calls_is_relayed(embedder, stream):
    """The rule that a forced call ends with "stop" is the gateway's where it builds the
    answer; an upstream that said "tool_calls" is relayed as it said."""
    client, server = embedder
    tool = {"type": "function", "function": {"name": "get_time", "parameters": TIME}}
    named = {"type": "function", "function": {"name": "get_time"}}
    request = {"model": EMBEDDER, "messages": user("time?"), "tools": [tool], "max_tokens": 8}
    if not stream:
        reply = client.chat.completions.create(**request, tool_choice=named)
        (choice,) = reply.choices
        assert choice.finish_reason == "tool_calls"
        assert choice.message.tool_calls[0].function.name == "get_time"
    else:
        chunks = list(client.chat.completions.create(**request, tool_choice=named, stream=True))
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert [r for r in reasons if r] == ["tool_calls"]
    assert server.last_body["tool_choice"] == named


def test_the_upstreams_cached_prompt_tokens_reach_every_apis_usage(embedder):
    """Our server's usage says 2 of the prompt's 3 tokens were cached (as vLLM's does with
    `--enable-prompt-tokens-details`): the chat's usage, whole and streamed, the
    Responses API's and Anthropic's (its input then the 1 not cached) relay it."""
    client, _ = embedder
    ask: dict[str, Any] = {"model": EMBEDDER, "messages": [{"role": "user", "content": "hi"}]}
    whole = client.chat.completions.create(**ask)
    assert whole.usage is not None and whole.usage.prompt_tokens_details is not None
    assert whole.usage.prompt_tokens_details.cached_tokens == CACHED
    chunks = list(
        client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True})
    )
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == CACHED
    response = client.responses.create(model=EMBEDDER, input="hi")
    assert response.usage is not None
    assert response.usage.input_tokens_details.cached_tokens == CACHED
    base = str(client.base_url).removesuffix("/v1/")
    message = httpx.post(
        base + "/v1/messages", json={**ask, "max_tokens": 8}, timeout=HANG_GUARD
    ).json()
    assert message["usage"]["input_tokens"] == 3 - CACHED
    assert message["usage"]["cache_read_input_tokens"] == CACHED
