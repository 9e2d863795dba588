"""The HTTP upstream's protocol edges, against a mocked transport (respx): the
SSE it reads (text, tool calls, logprobs, n choices), the errors it maps, what
it sends, and embeddings; then plain http:// upstreams over its own connections,
against a scripted loopback server: keep-alive, refusals, cancel, the deadline,
and reading paused for a reader that falls behind, and its polls of health and load
(none leaves a socket behind when the upstream closes under it); through the gateway, a
stream's head that reaches the client while the engine is still silent.
tests/test_http_upstream_surface.py runs the same
surface against vLLM's own server through the gateway."""

import asyncio
import gc
import json
import re
from dataclasses import replace

import anyio
import httpx
import orjson
import pytest
import respx

from gateway.config import ModelConfig
from gateway.protocol import errors
from gateway.protocol.kv_blocks import EngineLoad
from gateway.protocol.types import (
    Classification,
    Classifications,
    Embeddings,
    EmbedRequest,
    Finished,
    FinishReason,
    GenerateRequest,
    Message,
    RerankRequest,
    ResponseFormat,
    SamplingParams,
    Scores,
    Started,
    Text,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolCallDelta,
)
from gateway.upstreams.base import CANCELLED
from gateway.upstreams.openai_http import OpenAIHttpUpstream, request_body
from gateway.upstreams.openai_http.connections import REST, _RawCall
from gateway.upstreams.openai_http.loads import LOAD_QUERY, MAX_METRICS_BYTES
from gateway.upstreams.openai_http.sse import _Stream
from tests.support.processes import free_port
from tests.support.requests import user
from tests.support.waiting import HANG_GUARD, until, wait_until

BASE = "http://upstream.test/v1"


def sse(*payloads) -> bytes:
    lines = []
    for payload in payloads:
        if isinstance(payload, str) and payload.startswith(":"):
            lines.append(f"{payload}\n\n")  # an SSE comment
            continue
        data = payload if isinstance(payload, str) else json.dumps(payload)
        lines.append(f"data: {data}\n\n")
    return "".join(lines).encode()


def chunk(content=None, finish=None, usage=None) -> dict:
    delta = {} if content is None else {"content": content}
    body = {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        body = {"choices": [], "usage": usage}
    return body


async def run(request: GenerateRequest) -> tuple[list, object, list]:
    """Every event of one call, the error that ended it, and the outcomes reported."""
    outcomes = []
    async with httpx.AsyncClient() as http:
        stream = OpenAIHttpUpstream(BASE, http, raw_http=False).call(
            request, 5.0, on_close=outcomes.append
        )
        events, failure = [], None
        try:
            async for event in stream:
                events.append(event)
        except errors.GatewayError as error:
            failure = error
    return events, failure, outcomes


CHAT = GenerateRequest(
    "m",
    messages=(Message("user", "hi"),),
    sampling=SamplingParams(temperature=0.5, max_tokens=8, top_k=3),
    stop=("END",),
)


@respx.mock
def test_a_stream_becomes_our_events_and_the_body_is_openais():
    route = respx.post(f"{BASE}/chat/completions").respond(
        200,
        content=sse(
            chunk(""),
            chunk("Hel"),
            ": keep-alive",
            chunk("lo"),
            chunk(finish="length"),
            chunk(usage={"prompt_tokens": 9, "completion_tokens": 2}),
            "[DONE]",
        ),
        headers={"content-type": "text/event-stream"},
    )
    events, failure, outcomes = anyio.run(run, CHAT)
    assert failure is None
    assert events[0] == Started(0)
    # the pieces that arrived in one read are one event, with their tokens
    assert events[1:-1] == [Text("Hello", 2)]
    assert events[-1] == Finished(FinishReason.LENGTH, 2, 9)
    assert outcomes == [None]
    sent = json.loads(route.calls.last.request.content)
    assert sent == {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.5,
        "top_k": 3,
        "max_tokens": 8,
        "stop": ["END"],
    }


@respx.mock
def test_completions_route_for_a_text_prompt():
    respx.post(f"{BASE}/completions").respond(
        200, content=sse({"choices": [{"text": "a b", "finish_reason": "stop"}]}, "[DONE]")
    )
    events, failure, _ = anyio.run(run, GenerateRequest("m", prompt="a b"))
    assert failure is None
    assert events[1].text == "a b"
    assert events[-1] == Finished(FinishReason.STOP, 1, None)  # no usage: counted chunks


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (sse(chunk("a")) + b"data: {not json\n\n", "not JSON"),
        (sse(chunk("a"), "[1, 2]"), "not an object"),
        (sse(chunk("a")), "without [DONE]"),
        (sse(chunk("a"), {"choices": "x"}), "unknown shape"),
        (sse(chunk("a"), {"choices": [{"logprobs": {"content": [{}]}}]}), "unknown shape"),
    ],
)
@respx.mock
def test_malformed_streams_are_engine_failures(content, message):
    respx.post(f"{BASE}/chat/completions").respond(200, content=content)
    events, failure, outcomes = anyio.run(run, CHAT)
    assert isinstance(failure, errors.Failed)
    assert message in failure.message
    assert events[1].text == "a"  # what came before is kept
    assert outcomes == [failure]


@respx.mock
def test_a_choice_the_engine_aborted_is_unavailable_not_an_answer():
    aborted = {"choices": [{"index": 0, "delta": {}, "finish_reason": "abort"}]}
    respx.post(f"{BASE}/chat/completions").respond(200, content=sse(chunk("a"), aborted, "[DONE]"))
    events, failure, _ = anyio.run(run, CHAT)
    assert type(failure) is errors.Unavailable and "abort" in failure.message
    assert events[1].text == "a"


@respx.mock
def test_an_error_event_mid_stream():
    error = {
        "error": {"message": "worker died", "type": "server_error", "code": "engine_unavailable"}
    }
    respx.post(f"{BASE}/chat/completions").respond(200, content=sse(chunk("a"), error, "[DONE]"))
    events, failure, _ = anyio.run(run, CHAT)
    assert isinstance(failure, errors.Unavailable)
    assert failure.message == "worker died"
    assert len(events) == 2


@respx.mock
def test_an_error_as_their_first_event_is_a_refusal_naming_its_param():
    # vLLM checks some parameters only once it streams (e.g. logit_bias ids)
    error = {"error": {"message": "out of vocab", "param": "logit_bias", "code": 400}}
    respx.post(f"{BASE}/chat/completions").respond(200, content=sse(error, "[DONE]"))
    events, failure, outcomes = anyio.run(run, CHAT)
    assert events == []  # before Started: the edge answers it as a 400
    assert type(failure) is errors.Invalid and failure.param == "logit_bias"
    assert outcomes == [failure]


@pytest.mark.parametrize(
    ("status", "body", "expected", "param"),
    [
        (429, {"error": {"message": "slow down"}}, errors.Busy, None),
        (
            400,
            {"error": {"message": "too long", "code": "context_length_exceeded"}},
            errors.TooLong,
            None,
        ),
        (400, {"error": {"message": "bad", "param": "top_p"}}, errors.Invalid, "top_p"),
        (400, {"object": "error", "message": "old vLLM shape"}, errors.Invalid, None),
        (404, {"error": {"message": "no such model"}}, errors.ModelNotFound, None),
        (401, {}, errors.AuthFailed, None),
        (500, {"error": {"message": "boom"}}, errors.Failed, None),
        (503, b"<html>bad gateway</html>", errors.Unavailable, None),
        (504, {}, errors.Timeout, None),
    ],
)
@respx.mock
def test_error_responses_map_to_our_errors(status, body, expected, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"retry-after": "7"} if status == 429 else {}
    respx.post(f"{BASE}/chat/completions").respond(status, content=content, headers=headers)
    events, failure, outcomes = anyio.run(run, CHAT)
    assert events == []
    assert type(failure) is expected
    assert failure.param == param
    assert outcomes == [failure]


@respx.mock
def test_connect_failure_is_unavailable():
    respx.post(f"{BASE}/chat/completions").mock(side_effect=httpx.ConnectError("refused"))
    _, failure, _ = anyio.run(run, CHAT)
    assert isinstance(failure, errors.Unavailable)


@respx.mock
def test_cancel_reports_our_cancellation():
    async def endless():
        yield sse(chunk("a"))
        await anyio.sleep(HANG_GUARD)

    respx.post(f"{BASE}/chat/completions").respond(200, stream=endless())

    async def cancel_after_start() -> list:
        outcomes = []
        async with httpx.AsyncClient() as http:
            stream = OpenAIHttpUpstream(BASE, http, raw_http=False).call(
                CHAT, 5.0, on_close=outcomes.append
            )
            assert await anext(stream) == Started(0)
            stream.cancel()
            stream.cancel()
        return outcomes

    assert anyio.run(cancel_after_start) == [CANCELLED]


@respx.mock
def test_describe_and_health():
    respx.get(f"{BASE}/models").respond(
        200, json={"data": [{"id": "m", "max_model_len": 4096}, {"id": "n"}]}
    )
    respx.get("http://upstream.test/health").respond(200)
    engines = b'vllm:num_requests_running{engine="0"} 0\nvllm:num_requests_running{engine="1"} 1\n'
    respx.get(url__startswith="http://upstream.test/metrics").respond(200, content=engines)

    async def probe() -> tuple:
        async with httpx.AsyncClient() as http:
            upstream = OpenAIHttpUpstream(BASE + "/", http, raw_http=False)
            models = await upstream.describe(1.0)
            health = upstream.watch_health(0.01, 1.0)
            serving = await anext(health)
            await health.aclose()
            return models, serving

    models, serving = anyio.run(probe)
    assert [(m.name, m.max_context) for m in models] == [("m", 4096), ("n", 0)]
    assert {m.engine_ranks for m in models} == {(0, 1)}  # its /metrics' engines
    assert serving is True


@respx.mock
def test_an_event_line_past_the_bound_fails_the_stream_without_reading_on():
    from gateway.upstreams.openai_http import MAX_EVENT_BYTES

    huge = b"data: " + b"x" * (MAX_EVENT_BYTES * 4)
    respx.post(f"{BASE}/chat/completions").respond(
        200,
        content=sse(chunk("ok")) + huge,
        headers={"content-type": "text/event-stream"},
    )
    events, failure, outcomes = anyio.run(run, CHAT)
    assert events[0] == Started(0)
    assert isinstance(failure, errors.Failed) and "larger" in failure.message
    assert outcomes == [failure]


@respx.mock
def test_an_error_body_is_read_only_up_to_its_bound():
    from gateway.upstreams.openai_http import MAX_ERROR_BYTES

    body = json.dumps({"error": {"message": "m" * (MAX_ERROR_BYTES * 4)}}).encode()
    respx.post(f"{BASE}/chat/completions").respond(500, content=body)
    _, failure, _ = anyio.run(run, CHAT)
    # cut at the bound, the body is no longer JSON: the status alone speaks
    assert isinstance(failure, errors.Failed)
    assert len(failure.message) <= MAX_ERROR_BYTES


FULL_CHAT = GenerateRequest(
    "m",
    messages=(
        Message("user", "look", images=("data:image/png;base64,AAAA",)),
        Message("assistant", "", tool_calls=(ToolCall("call_1", "f", '{"a":1}'),)),
        Message("tool", "42", tool_call_id="call_1", name="f"),
    ),
    sampling=SamplingParams(
        seed=7,
        max_tokens=9,
        min_tokens=2,
        ignore_eos=True,
        repetition_penalty=1.1,
        min_p=0.05,
        logit_bias=((5, -100.0), (17, 2.5)),
        stop_token_ids=(3, 4),
    ),
    n=2,
    logprobs=3,
    tools=(Tool("f", "adds", '{"type":"object","properties":{"a":{"type":"integer"}}}'),),
    tool_choice="f",
    parallel_tool_calls=False,
    response_format=ResponseFormat("json_schema", '{"type":"object"}', "answer", strict=True),
    user="team-a",
)


@respx.mock
def test_every_field_reaches_the_body_as_openai_and_vllm_name_it():
    route = respx.post(f"{BASE}/chat/completions").respond(200, content=sse("[DONE]"))
    anyio.run(run, FULL_CHAT)
    sent = json.loads(route.calls.last.request.content)
    assert sent == {
        "model": "m",
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    {"type": "text", "text": "look"},
                ],
            },
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"a":1}'},
                    }
                ],
            },
            {"role": "tool", "content": "42", "tool_call_id": "call_1", "name": "f"},
        ],
        "seed": 7,
        "max_tokens": 9,
        "min_tokens": 2,
        "ignore_eos": True,
        "repetition_penalty": 1.1,
        "min_p": 0.05,
        "logit_bias": {"5": -100.0, "17": 2.5},
        "stop_token_ids": [3, 4],
        "n": 2,
        "logprobs": True,
        "top_logprobs": 3,
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "description": "adds",
                    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}},
                },
            }
        ],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "parallel_tool_calls": False,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": {"type": "object"}, "strict": True},
        },
        "user": "team-a",
    }


@respx.mock
def test_completion_logprobs_and_choice_names_go_as_openai_takes_them():
    route = respx.post(f"{BASE}/completions").respond(200, content=sse("[DONE]"))
    request = GenerateRequest(
        "m", prompt="p", logprobs=0, response_format=ResponseFormat("json_object")
    )
    anyio.run(run, request)
    sent = json.loads(route.calls.last.request.content)
    assert (sent["logprobs"], sent["response_format"]) == (0, {"type": "json_object"})
    assert "top_logprobs" not in sent
    for choice in ("none", "auto", "required"):
        anyio.run(run, GenerateRequest("m", prompt="p", tool_choice=choice))
        assert json.loads(route.calls.last.request.content)["tool_choice"] == choice


def tool_piece(index=0, call=0, call_id=None, name=None, arguments="", finish=None) -> dict:
    function = {"arguments": arguments} if name is None else {"name": name, "arguments": arguments}
    piece = {"index": call, "function": function}
    if call_id is not None:
        piece.update(id=call_id, type="function")
    delta = {"tool_calls": [piece]}
    return {"choices": [{"index": index, "delta": delta, "finish_reason": finish}]}


@respx.mock
def test_tool_calls_stream_as_deltas_their_arguments_merged_per_read():
    respx.post(f"{BASE}/chat/completions").respond(
        200,
        content=sse(
            {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
            tool_piece(call_id="call_a", name="f", arguments="{"),
            tool_piece(arguments='"a"'),
            tool_piece(name=None, arguments=":1}"),
            tool_piece(call=1, call_id="call_b", name="g"),
            tool_piece(call=1, arguments="{}", finish="tool_calls"),
            chunk(usage={"prompt_tokens": 4, "completion_tokens": 12}),
            "[DONE]",
        ),
    )
    events, failure, _ = anyio.run(run, CHAT)
    assert failure is None
    assert events[1:] == [
        ToolCallDelta(0, 0, "call_a", "f", '{"a":1}', 3),
        ToolCallDelta(0, 1, "call_b", "g", "{}", 2),
        Finished(FinishReason.TOOL_CALLS, 12, 4),
    ]


CHAT_LOGPROBS = {
    "content": [
        {
            "token": "Hi",
            "logprob": -0.5,
            "bytes": [72, 105],
            "top_logprobs": [{"token": "Hi", "logprob": -0.5}, {"token": "Yo", "logprob": -1.5}],
        }
    ]
}


@respx.mock
def test_chat_logprobs_become_token_logprobs_even_on_a_token_without_text():
    empty = {"content": [{"token": "", "logprob": -2.0, "top_logprobs": []}]}
    respx.post(f"{BASE}/chat/completions").respond(
        200,
        content=sse(
            {"choices": [{"index": 0, "delta": {"content": "Hi"}, "logprobs": CHAT_LOGPROBS}]},
            {"choices": [{"index": 0, "delta": {}, "logprobs": empty, "finish_reason": "length"}]},
            "[DONE]",
        ),
    )
    events, _, _ = anyio.run(run, CHAT)
    assert events[1] == Text(
        "Hi",
        2,
        0,
        (TokenLogprob("Hi", -0.5, (("Hi", -0.5), ("Yo", -1.5))), TokenLogprob("", -2.0, ())),
    )
    assert events[2] == Finished(FinishReason.LENGTH, 2, None)


@respx.mock
def test_completion_logprobs_become_token_logprobs():
    logprobs = {
        "text_offset": [0, 1],
        "tokens": ["a", "b"],
        "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [{"a": -0.1, "c": -3.0}, {"b": -0.2}],
    }
    respx.post(f"{BASE}/completions").respond(
        200,
        content=sse({"choices": [{"index": 0, "text": "ab", "logprobs": logprobs}]}, "[DONE]"),
    )
    events, _, _ = anyio.run(run, GenerateRequest("m", prompt="p", logprobs=1))
    assert events[1] == Text(
        "ab",
        2,
        0,
        (
            TokenLogprob("a", -0.1, (("a", -0.1), ("c", -3.0))),
            TokenLogprob("b", -0.2, (("b", -0.2),)),
        ),
    )


def choice(index, content=None, finish=None, usage=None) -> dict:
    delta = {} if content is None else {"content": content}
    body = {"choices": [{"index": index, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    return body


TWO = GenerateRequest("m", messages=(Message("user", "hi"),), n=2)


@pytest.mark.parametrize(
    ("tail", "expected"),
    [
        # only a total: it goes on the last choice to finish, 0 on the other
        ([chunk(usage={"prompt_tokens": 3, "completion_tokens": 5})], [(1, 0, 3), (0, 5, 3)]),
        # no usage at all: the pieces counted
        ([], [(1, 1, None), (0, 2, None)]),
    ],
)
@respx.mock
def test_n_choices_interleave_and_end_with_one_finished_each(tail, expected):
    respx.post(f"{BASE}/chat/completions").respond(
        200,
        content=sse(
            choice(0, "a"),
            choice(1, "x"),
            choice(1, finish="length"),
            choice(0, "b"),
            choice(0, finish="stop"),
            *tail,
            "[DONE]",
        ),
    )
    events, failure, _ = anyio.run(run, TWO)
    assert failure is None
    assert events[1:4] == [Text("a", 1, 0), Text("x", 1, 1), Text("b", 1, 0)]
    finished = [(e.index, e.completion_tokens, e.prompt_tokens) for e in events[4:]]
    assert finished == expected
    assert [e.reason for e in events[4:]] == [FinishReason.LENGTH, FinishReason.STOP]


@respx.mock
def test_per_chunk_usage_gives_each_choice_its_own_count():
    respx.post(f"{BASE}/chat/completions").respond(
        200,
        content=sse(
            choice(0, "a", usage={"prompt_tokens": 3, "completion_tokens": 1}),
            choice(1, "x", usage={"prompt_tokens": 3, "completion_tokens": 1}),
            choice(0, "", "stop", usage={"prompt_tokens": 3, "completion_tokens": 2}),
            choice(1, "", "stop", usage={"prompt_tokens": 3, "completion_tokens": 4}),
            chunk(usage={"prompt_tokens": 3, "completion_tokens": 6}),
            "[DONE]",
        ),
    )
    events, _, _ = anyio.run(run, TWO)
    assert [(e.index, e.completion_tokens) for e in events if type(e) is Finished] == [
        (0, 2),
        (1, 4),
    ]


@respx.mock
def test_a_choice_index_beyond_n_fails_the_stream():
    respx.post(f"{BASE}/chat/completions").respond(200, content=sse(choice(1, "a"), "[DONE]"))
    _, failure, _ = anyio.run(run, CHAT)
    assert isinstance(failure, errors.Failed) and "choice 1" in failure.message


@respx.mock
def test_events_split_across_reads_are_read_whole():
    whole = sse(chunk("Hel"), chunk("lo", finish="stop"), "[DONE]")

    async def body():
        for i in range(0, len(whole), 7):  # 7-byte pieces: lines cut anywhere
            yield whole[i : i + 7]

    respx.post(f"{BASE}/chat/completions").respond(200, stream=body())
    events, failure, _ = anyio.run(run, CHAT)
    assert failure is None
    assert "".join(e.text for e in events if type(e) is Text) == "Hello"
    assert events[-1] == Finished(FinishReason.STOP, 2, None)


EMBED = EmbedRequest("e", ("one two", (1, 2, 3)), dimensions=2, user="team-a")


async def pooled(method: str, request: object) -> object:
    """The upstream's `method` (embed, rerank, classify) for `request`: its answer, or
    the error it raised."""
    async with httpx.AsyncClient() as http:
        upstream = OpenAIHttpUpstream(BASE, http, raw_http=False)
        try:
            return await getattr(upstream, method)(request, 5.0)
        except errors.GatewayError as error:
            return error


async def embed(request: EmbedRequest = EMBED) -> object:
    return await pooled("embed", request)


@respx.mock
def test_embed_sends_texts_and_token_ids_and_places_vectors_by_index():
    route = respx.post(f"{BASE}/embeddings").respond(
        200,
        json={
            "data": [
                {"index": 1, "embedding": [0.0, 1.0]},
                {"index": 0, "embedding": [0.6, 0.8]},
            ],
            "usage": {"prompt_tokens": 5, "total_tokens": 5},
        },
    )
    assert anyio.run(embed) == Embeddings(((0.6, 0.8), (0.0, 1.0)), 5)
    assert json.loads(route.calls.last.request.content) == {
        "model": "e",
        "input": ["one two", [1, 2, 3]],
        "encoding_format": "float",
        "dimensions": 2,
        "user": "team-a",
    }


@pytest.mark.parametrize(
    ("status", "body", "expected", "param"),
    [
        (200, {"data": [{"index": 0, "embedding": [0.1, 0.2]}]}, errors.Failed, None),
        (200, {"data": [{"embedding": [0.1]}, {"embedding": [0.2]}]}, errors.Failed, None),
        (200, {"data": [{"embedding": ["x", 1]}, {"embedding": [0.2, 0.1]}]}, errors.Failed, None),
        (200, b"not json", errors.Failed, None),
        (
            400,
            {"error": {"message": "bad dims", "param": "dimensions"}},
            errors.Invalid,
            "dimensions",
        ),
        (404, {"detail": "Not Found"}, errors.Invalid, "model"),  # no such route
        (
            404,
            {"error": {"message": "no model e", "code": "model_not_found"}},
            errors.ModelNotFound,
            None,
        ),
        (503, {}, errors.Unavailable, None),
    ],
)
@respx.mock
def test_embed_refusals_and_bad_answers(status, body, expected, param):
    answered_with(f"{BASE}/embeddings", status, body, embed, expected, param)


def answered_with(url, status, body, call, expected, param):
    """`call` fails as `expected` (naming `param`) when `url` answers `status`, `body`."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    respx.post(url).respond(status, content=content)
    failure = anyio.run(call)
    assert type(failure) is expected, failure
    assert failure.param == param


@respx.mock
def test_embed_answers_are_read_only_up_to_their_bound():
    from gateway.upstreams.openai_http import MAX_EMBEDDING_BYTES, MAX_ERROR_BYTES

    vector = [0.5] * ((MAX_ERROR_BYTES + 2 * MAX_EMBEDDING_BYTES) // 3)
    body = {"data": [{"index": 0, "embedding": vector}, {"index": 1, "embedding": vector}]}
    respx.post(f"{BASE}/embeddings").respond(200, json=body)
    failure = anyio.run(embed, EmbedRequest("e", ("a", "b")))
    assert isinstance(failure, errors.Failed) and "larger" in failure.message


@respx.mock
def test_embed_connect_failure_is_unavailable():
    respx.post(f"{BASE}/embeddings").mock(side_effect=httpx.ConnectError("refused"))
    assert isinstance(anyio.run(embed), errors.Unavailable)


RERANK = RerankRequest("r", "a query", ("doc a", "doc b"), user="team-a")


async def rerank(request: RerankRequest = RERANK) -> object:
    return await pooled("rerank", request)


@respx.mock
def test_rerank_sends_the_query_and_documents_and_places_scores_by_index():
    route = respx.post(f"{BASE}/rerank").respond(
        200,
        json={
            "results": [
                {"index": 1, "relevance_score": 0.9, "document": {"text": "doc b"}},
                {"index": 0, "relevance_score": 0.25, "document": {"text": "doc a"}},
            ],
            "usage": {"prompt_tokens": 7, "total_tokens": 7},
        },
    )
    assert anyio.run(rerank) == Scores((0.25, 0.9), 7)
    assert json.loads(route.calls.last.request.content) == {
        "model": "r",
        "query": "a query",
        "documents": ["doc a", "doc b"],
        "user": "team-a",
    }


@respx.mock
def test_rerank_reads_sglangs_answer_too():
    """SGLang's /v1/rerank answers a list of `index`, `score` and `meta_info` (its
    tokens), highest first."""
    respx.post(f"{BASE}/rerank").respond(
        200,
        json=[
            {"score": 0.9, "document": "doc b", "index": 1, "meta_info": {"prompt_tokens": 4}},
            {"score": 0.25, "document": "doc a", "index": 0, "meta_info": {"prompt_tokens": 3}},
        ],
    )
    assert anyio.run(rerank) == Scores((0.25, 0.9), 7)


@pytest.mark.parametrize(
    ("status", "body", "expected", "param"),
    [
        (200, {"results": [{"index": 0, "relevance_score": 0.1}]}, errors.Failed, None),
        (
            200,
            {"results": [{"index": 0, "relevance_score": 0.1}, {"index": 0, "relevance_score": 1}]},
            errors.Failed,
            None,
        ),
        (
            200,
            {"results": [{"index": 0, "relevance_score": "x"}, {"index": 1, "relevance_score": 1}]},
            errors.Failed,
            None,
        ),
        (
            200,
            {"results": [{"index": 2, "relevance_score": 0}, {"index": 1, "relevance_score": 1}]},
            errors.Failed,
            None,
        ),
        (200, [{"index": 0, "score": 1.0}], errors.Failed, None),
        (200, b"not json", errors.Failed, None),
        (
            400,
            {"error": {"message": "too long", "param": "documents"}},
            errors.Invalid,
            "documents",
        ),
        (404, {"detail": "Not Found"}, errors.Invalid, "model"),  # no such route
        (503, {}, errors.Unavailable, None),
    ],
)
@respx.mock
def test_rerank_refusals_and_bad_answers(status, body, expected, param):
    answered_with(f"{BASE}/rerank", status, body, rerank, expected, param)


ROOT = BASE.removesuffix("/v1")


async def classify(request: EmbedRequest = EMBED) -> object:
    return await pooled("classify", request)


@respx.mock
def test_classify_sends_the_inputs_beside_v1_and_places_classes_by_index():
    route = respx.post(f"{ROOT}/classify").respond(
        200,
        json={
            "data": [
                {"index": 1, "label": None, "probs": [0.5, 0.5], "num_classes": 2},
                {"index": 0, "label": "spam", "probs": [0.9, 0.1], "num_classes": 2},
            ],
            "usage": {"prompt_tokens": 6, "total_tokens": 6},
        },
    )
    assert anyio.run(classify) == Classifications(
        (Classification("spam", (0.9, 0.1)), Classification(None, (0.5, 0.5))), 6
    )
    assert json.loads(route.calls.last.request.content) == {
        "model": "e",
        "input": ["one two", [1, 2, 3]],
        "user": "team-a",
    }


@pytest.mark.parametrize(
    ("status", "body", "expected", "param"),
    [
        (200, {"data": [{"index": 0, "label": "a", "probs": [1.0]}]}, errors.Failed, None),
        (
            200,
            {"data": [{"index": 0, "probs": []}, {"index": 1, "label": "a", "probs": [1]}]},
            errors.Failed,
            None,
        ),
        (
            200,
            {"data": [{"index": 0, "label": 3, "probs": [1]}, {"index": 1, "probs": [1]}]},
            errors.Failed,
            None,
        ),
        (200, b"[]", errors.Failed, None),
        (404, {"detail": "Not Found"}, errors.Invalid, "model"),  # no such route
        (400, {"error": {"message": "too long", "param": "input"}}, errors.Invalid, "input"),
    ],
)
@respx.mock
def test_classify_refusals_and_bad_answers(status, body, expected, param):
    answered_with(f"{ROOT}/classify", status, body, classify, expected, param)


@respx.mock
def test_rerank_answers_are_read_only_up_to_their_bound():
    from gateway.upstreams.openai_http.translate import rerank_limit

    padding = "x" * rerank_limit(RERANK)
    body = {"results": [{"index": 0, "relevance_score": 0.5, "document": {"text": padding}}]}
    respx.post(f"{BASE}/rerank").respond(200, json=body)
    failure = anyio.run(rerank)
    assert isinstance(failure, errors.Failed) and "larger" in failure.message


# -- plain http:// upstreams: our own connections (no respx: a loopback server) ------


class ScriptedHttp:
    """A loopback HTTP/1.1 server answering each request with the next scripted
    response: (status, body pieces, then hang?). A 200's pieces go chunked, one
    send each (`gap` seconds apart, 0: a turn of the loop; None: back to back), as
    an engine streams; it keeps the requests and counts connections."""

    def __init__(
        self,
        *responses: tuple[int, list[bytes], bool],
        keep_alive: bool = True,
        gap: float | None = None,
    ) -> None:
        self.responses = list(responses)
        self.keep_alive = keep_alive
        self.gap = gap
        self.requests: list[tuple[bytes, bytes]] = []
        self.connections = 0
        self.closed_by_client = asyncio.Event()
        self.sent_all = False

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/v1"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.responses:
                head = await reader.readuntil(b"\r\n\r\n")
                if head.startswith(b"GET "):  # a gateway's health and load polls
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                    continue
                length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
                self.requests.append((head, await reader.readexactly(length)))
                status, pieces, hang = self.responses.pop(0)
                if status != 200:
                    body = b"".join(pieces)
                    writer.write(
                        b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n" % (status, len(body))
                    )
                    writer.write(body)
                    continue
                writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
                for piece in pieces:
                    writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                    await writer.drain()
                    if self.gap is not None:
                        await asyncio.sleep(self.gap)
                self.sent_all = True
                if hang:
                    await reader.read()  # until the client leaves
                    self.closed_by_client.set()
                    return
                writer.write(b"0\r\n\r\n")
                if not self.keep_alive:
                    await writer.drain()
                    return  # closes the connection, as a server's keep-alive timeout does
            await reader.read()
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_client.set()
        finally:
            writer.close()

    def close(self) -> None:
        self._server.close()


def events_of(*payloads) -> list[bytes]:
    """SSE events, one body piece each."""
    return [sse(p) for p in payloads]


def stream_of(word: str, count: int) -> tuple[int, list[bytes], bool]:
    """A scripted 200 that streams `word` `count` times, one event a send, then stops."""
    return (
        200,
        events_of(*(chunk(word) for _ in range(count)), chunk(finish="stop"), "[DONE]"),
        False,
    )


async def text_and_rests(call: _RawCall) -> tuple[str, list[bool]]:
    """A call's text, and whether it rested its socket at each of its events."""
    texts, rests = [], []
    async for event in call:
        rests.append(call._resting)
        if type(event) is Text:
            texts.append(event.text)
    return "".join(texts), rests


async def raw_call(server: ScriptedHttp, request: GenerateRequest, **options) -> tuple:
    """Every event of one call over a plain http:// URL, the error, the outcomes."""
    url = await server.start()
    outcomes, events, failure = [], [], None
    try:
        async with httpx.AsyncClient() as http:
            upstream = OpenAIHttpUpstream(url, http, api_key=options.get("key"))
            call = upstream.call(
                request, options.get("timeout", 5.0), options.get("metadata", ()), outcomes.append
            )
            try:
                async for event in call:
                    events.append(event)
            except errors.GatewayError as error:
                failure = error
            await upstream.close()
    finally:
        server.close()
    return events, failure, outcomes


def test_plain_http_streams_over_our_connection_with_the_same_body_and_headers():
    pieces = events_of(chunk("Hel"), chunk("lo"), chunk(finish="stop"))
    pieces += events_of(chunk(usage={"prompt_tokens": 9, "completion_tokens": 2}), "[DONE]")
    server = ScriptedHttp((200, pieces, False))
    metadata = (("x-request-id", "r1"), ("traceparent", "bad\r\nx-injected: 1"))
    events, failure, outcomes = anyio.run(
        lambda: raw_call(server, CHAT, key="sk-1", metadata=metadata)
    )
    assert failure is None and outcomes == [None]
    assert events[0] == Started(0)
    assert "".join(e.text for e in events if type(e) is Text) == "Hello"
    assert events[-1] == Finished(FinishReason.STOP, 2, 9)
    head, body = server.requests[0]
    assert head.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"\r\nAuthorization: Bearer sk-1\r\n" in head
    assert b"\r\nx-request-id: r1\r\n" in head
    assert b"injected" not in head  # a value that would break the head is not sent
    assert json.loads(body) == json.loads(orjson.dumps(request_body(CHAT)))


def test_plain_http_a_connection_the_upstream_closed_is_not_reused():
    done = events_of(chunk("a", finish="stop"), "[DONE]")
    server = ScriptedHttp((200, done, False), (200, done, False), keep_alive=False)

    async def two() -> list:
        url = await server.start()
        async with httpx.AsyncClient() as http:
            upstream = OpenAIHttpUpstream(url, http)
            first = [e async for e in upstream.call(CHAT, 5.0)]
            await until(lambda: not upstream._pool.open, "the server's close to reach the pool")
            second = [e async for e in upstream.call(CHAT, 5.0)]
            await upstream.close()
        server.close()
        return [first[-1], second[-1]]

    assert anyio.run(two) == [Finished(FinishReason.STOP, 1, None)] * 2
    assert server.connections == 2


def test_plain_http_reuses_its_connection_and_refusals_keep_it():
    done = events_of(chunk("a", finish="stop"), "[DONE]")
    refusal = json.dumps({"error": {"message": "bad", "param": "top_p"}}).encode()
    server = ScriptedHttp((200, done, False), (400, [refusal], False), (200, done, False))

    async def three() -> list:
        url = await server.start()
        results = []
        async with httpx.AsyncClient() as http:
            upstream = OpenAIHttpUpstream(url, http)
            for _ in range(3):
                try:
                    results.append([e async for e in upstream.call(CHAT, 5.0)])
                except errors.GatewayError as error:
                    results.append(error)
            await upstream.close()
        server.close()
        return results

    first, refused, third = anyio.run(three)
    assert first[-1] == third[-1] == Finished(FinishReason.STOP, 1, None)
    assert type(refused) is errors.Invalid and refused.param == "top_p"
    assert server.connections == 1


@pytest.mark.parametrize(
    ("response", "expected", "message"),
    [
        ((200, events_of(chunk("a")), False), errors.Failed, "without [DONE]"),
        ((200, [b"data: {not json\n\n"], False), errors.Failed, "not JSON"),
        ((429, [b"{}"], False), errors.Busy, ""),
    ],
)
def test_plain_http_failures_map_as_over_httpx(response, expected, message):
    _, failure, outcomes = anyio.run(lambda: raw_call(ScriptedHttp(response), CHAT))
    assert type(failure) is expected and message in failure.message
    assert outcomes == [failure]


def test_plain_http_refusal_streamed_as_the_first_event_is_a_refusal():
    error = {"error": {"message": "out of vocab", "param": "logit_bias", "code": 400}}
    server = ScriptedHttp((200, events_of(error, "[DONE]"), False))
    events, failure, _ = anyio.run(lambda: raw_call(server, CHAT))
    assert events == [] and type(failure) is errors.Invalid and failure.param == "logit_bias"


@pytest.mark.parametrize("raw_http", [None, False], ids=["our connections", "httpx"])
def test_started_comes_after_their_200_head_while_the_engine_prefills(raw_http):
    # their head at once, then nothing (an engine's prefill): `Started` still comes, so
    # the edge's head reaches the client before the first token, as vLLM's own does;
    # cancelling the call then closes the connection, a pending httpx read too
    server = ScriptedHttp((200, [], True))

    async def first_event() -> tuple:
        url = await server.start()
        outcomes: list = []
        async with httpx.AsyncClient() as http:
            upstream = OpenAIHttpUpstream(url, http, raw_http=raw_http)
            call = upstream.call(CHAT, 5.0, on_close=outcomes.append)
            with anyio.fail_after(HANG_GUARD):
                first = await anext(call)
            call.cancel()
            with anyio.fail_after(HANG_GUARD):
                await server.closed_by_client.wait()
            await upstream.close()
        server.close()
        return first, outcomes

    assert anyio.run(first_event) == (Started(0), [CANCELLED])


def test_a_streams_head_reaches_the_client_while_the_engine_is_silent(gateway_with, server_loop):
    # through the gateway: the engine's 200 head at once, then nothing (a prefill that
    # does not end); the client has the gateway's head all the same, and leaving then
    # closes the upstream's call and leaves nothing behind (gateway_with checks)
    server = ScriptedHttp((200, [], True))
    url = server_loop.call(server.start())
    gw = gateway_with(models=(ModelConfig("scripted", workers=(url,), upstream="openai"),))
    body = {"model": "scripted", "messages": user("hi"), "stream": True}
    with (
        httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http,
        http.stream("POST", "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
    wait_until(server.closed_by_client.is_set, "the upstream to see the client leave")

    async def close() -> None:
        server.close()

    server_loop.call(close())


def test_plain_http_cancel_closes_the_connection_the_upstream_sees_it():
    server = ScriptedHttp((200, events_of(chunk("a")), True))

    async def cancel_after_start() -> list:
        outcomes = []
        url = await server.start()
        async with httpx.AsyncClient() as http:
            call = OpenAIHttpUpstream(url, http).call(CHAT, 5.0, on_close=outcomes.append)
            assert await anext(call) == Started(0)
            call.cancel()
            with anyio.fail_after(HANG_GUARD):
                await server.closed_by_client.wait()
        server.close()
        return outcomes

    assert anyio.run(cancel_after_start) == [CANCELLED]


def test_plain_http_deadline_and_unreachable():
    server = ScriptedHttp((200, events_of(chunk("a")), True))  # then nothing, ever
    events, failure, _ = anyio.run(lambda: raw_call(server, CHAT, timeout=0.3))
    assert [type(e) for e in events] == [Started, Text]
    assert type(failure) is errors.Timeout

    async def unreachable() -> object:
        async with httpx.AsyncClient() as http:
            call = OpenAIHttpUpstream(f"http://127.0.0.1:{free_port()}/v1", http).call(CHAT, 5)
            try:
                await anext(call)
            except errors.GatewayError as error:
                return error

    assert type(anyio.run(unreachable)) is errors.Unavailable


def test_plain_http_pauses_reading_for_a_reader_that_falls_behind():
    # two choices in turn: nothing merges, so the events pile up
    # (more than loopback's socket buffers hold)
    pieces = [sse(choice(i % 2, "w " * 40)) for i in range(100_000)]
    pieces += events_of(choice(0, finish="stop"), choice(1, finish="stop"), "[DONE]")
    server = ScriptedHttp((200, pieces, False))

    async def slow_reader() -> tuple:
        url = await server.start()
        async with httpx.AsyncClient() as http:
            upstream = OpenAIHttpUpstream(url, http)
            call = upstream.call(TWO, HANG_GUARD)
            assert await anext(call) == Started(0)
            # the reader is busy: the server's sends back up until reading pauses
            await until(lambda: call._paused, "the call to pause reading")
            waiting = len(call._ready)
            sent_all = server.sent_all
            texts = [e async for e in call if type(e) is Text]
            await upstream.close()
        server.close()
        return waiting, sent_all, texts

    waiting, sent_all, texts = anyio.run(slow_reader)
    assert waiting < 10_000 and not sent_all
    assert sum(len(t.text) for t in texts) == 100_000 * 80


def test_plain_http_a_call_past_its_deadline_is_not_sent_again():
    # the deadline passes while its events wait to be read: once read, the failure
    server = ScriptedHttp((200, events_of(chunk("a"), chunk("b")), True))

    async def late_reader() -> tuple:
        url = await server.start()
        async with httpx.AsyncClient() as http:
            upstream = OpenAIHttpUpstream(url, http)
            call = upstream.call(CHAT, 0.3)
            events = [await anext(call)]
            await asyncio.sleep(0.5)
            try:
                async for event in call:
                    events.append(event)
            except errors.GatewayError as error:
                failure = error
            await upstream.close()
        server.close()
        return events, failure

    events, failure = anyio.run(late_reader)
    assert [type(e) for e in events] == [Started, Text] and type(failure) is errors.Timeout
    assert server.connections == 1 and len(server.requests) == 1


def test_plain_http_a_call_among_others_rests_its_socket_after_its_first_text():
    # an engine's token per send, read per token, is a system call each: among other
    # calls a call whose sends come faster than REST reads what came in REST; alone it
    # reads every send at once
    server = ScriptedHttp(stream_of("a", 100), stream_of("b", 100), stream_of("c", 100), gap=0)

    async def two_then_one() -> tuple:
        url = await server.start()
        async with httpx.AsyncClient() as http:
            upstream = OpenAIHttpUpstream(url, http)
            calls = [upstream.call(CHAT, HANG_GUARD) for _ in range(2)]
            together = await asyncio.gather(*(text_and_rests(c) for c in calls))
            reading = _RawCall.reading
            # their connections see their responses' ends
            await until(lambda: len(upstream._pool.idle) == 2, "both connections idle")
            alone = await text_and_rests(upstream.call(CHAT, HANG_GUARD))
            await upstream.close()
        server.close()
        return together, alone, reading

    together, alone, reading = anyio.run(two_then_one)
    assert sorted(text for text, _ in together) == ["a" * 100, "b" * 100]
    assert alone[0] == "c" * 100
    assert [any(rests) for _, rests in together] == [True, True] and not any(alone[1])
    assert reading == 0
    assert server.connections == 2  # a rested connection went back reading: reused


def test_plain_http_a_call_whose_sends_come_further_apart_than_a_rest_never_rests():
    # an engine's steps longer than REST: a rest would merge nothing, only cost. A read
    # the loaded loop serves late may see the next come soon after it, and rest once
    server = ScriptedHttp(stream_of("a", 10), stream_of("b", 10), gap=10 * REST)

    async def two() -> list[tuple[str, list[bool]]]:
        url = await server.start()
        async with httpx.AsyncClient() as http:
            upstream = OpenAIHttpUpstream(url, http)
            calls = [upstream.call(CHAT, HANG_GUARD) for _ in range(2)]
            together = await asyncio.gather(*(text_and_rests(c) for c in calls))
            await upstream.close()
        server.close()
        return together

    together = anyio.run(two)
    assert sorted(text for text, _ in together) == ["a" * 10, "b" * 10]
    assert sum(sum(rests) for _, rests in together) <= 2  # of 24 events


def test_plain_http_a_call_of_several_choices_rests_only_once_each_has_had_its_first_text():
    # choice 1's first text comes after 40 of choice 0's: no rest may hold it back
    def of(index: int, content: str | None = None, finish: str | None = None) -> dict:
        delta = {} if content is None else {"content": content}
        return {"choices": [{"index": index, "delta": delta, "finish_reason": finish}]}

    late_second = (
        200,
        events_of(
            *(of(0, "a") for _ in range(40)),
            *(of(i, "b") for _ in range(40) for i in (0, 1)),
            of(0, finish="stop"),
            of(1, finish="stop"),
            "[DONE]",
        ),
        False,
    )
    server = ScriptedHttp(late_second, late_second, gap=0)

    async def two() -> tuple:
        url = await server.start()
        rested: list[list[tuple[bool, bool]]] = [[], []]  # (choice 1 texted yet, resting)

        async def read(call: _RawCall, seen: list[tuple[bool, bool]]) -> str:
            texts, second = [], False
            async for event in call:
                if type(event) is Text:
                    texts.append(event.text)
                    second = second or event.index == 1
                seen.append((second, call._resting))
            return "".join(texts)

        async with httpx.AsyncClient() as http:
            upstream = OpenAIHttpUpstream(url, http)
            calls = [upstream.call(replace(CHAT, n=2), HANG_GUARD) for _ in range(2)]
            texts = await asyncio.gather(*(read(c, r) for c, r in zip(calls, rested, strict=True)))
            await upstream.close()
        server.close()
        return texts, rested

    texts, rested = anyio.run(two)
    assert all(sorted(t) == sorted("a" * 40 + "b" * 80) for t in texts)
    for seen in rested:
        before = [resting for second, resting in seen if not second]
        after = [resting for second, resting in seen if second]
        assert len(before) > 20 and not any(before[:20])  # among others, yet not resting
        assert any(after)  # both choices under way: it rests


def test_plain_http_pushes_each_read_to_a_listener():
    pieces = events_of(chunk("Hel"), chunk("lo"), chunk(finish="stop"), "[DONE]")
    server = ScriptedHttp((200, pieces, False))

    async def pushed() -> tuple:
        url = await server.start()
        told = asyncio.Event()
        async with httpx.AsyncClient() as http:
            upstream = OpenAIHttpUpstream(url, http)
            call = upstream.call(CHAT, 5.0)
            assert await anext(call) == Started(0)
            call.listen(told.set)
            events = []
            while not events or type(events[-1]) is not Finished:
                event = call.poll()
                if event is None:
                    with anyio.fail_after(HANG_GUARD):
                        await told.wait()  # a read came: the listener was told
                    told.clear()
                else:
                    events.append(event)
            with pytest.raises(StopAsyncIteration):
                call.poll()  # over
            call.listen(None)
            await upstream.close()
        server.close()
        return events

    events = anyio.run(pushed)
    assert "".join(e.text for e in events if type(e) is Text) == "Hello"
    assert events[-1] == Finished(FinishReason.STOP, 2, None)


def vllm_chunk(index: int, text: str | None, **extra: object) -> dict:
    """A chunk as vLLM spells it: the same id, model and nulls on every token."""
    delta = {} if text is None else {"content": text}
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
    choice.update(extra)
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
            "choices": [choice]}  # fmt: skip


class WholeStream(_Stream):
    """Parses every line whole: no template."""

    __slots__ = ()

    def _learn(self, line: bytes, payload: dict) -> bool:
        return False


def feed_in_pieces(stream: _Stream, data: bytes, size: int) -> list:
    for i in range(0, len(data), size):
        stream.feed(data[i : i + size])
    return list(stream.ready)


TEMPLATED = [
    vllm_chunk(0, "", role="assistant"),
    *(vllm_chunk(0, text) for text in ["Hel", "lo", " wörld", ' "quoted"', "\\n", "", "\u2028x"]),
    vllm_chunk(0, None, finish_reason=None),  # no text: no token
    vllm_chunk(0, "a", logprobs={"content": [{"token": "a", "logprob": -0.5, "top_logprobs": []}]}),
    vllm_chunk(0, "b"),
    {**vllm_chunk(0, "c"), "usage": {"prompt_tokens": 2, "completion_tokens": 9}},
    vllm_chunk(0, "d", tool_calls=None),
    vllm_chunk(1, "other choice"),
    vllm_chunk(0, "e"),
    vllm_chunk(0, None, finish_reason="stop"),
    vllm_chunk(1, None, finish_reason="length"),
    "[DONE]",
]


@pytest.mark.parametrize("size", [7, 64, 100_000])
@pytest.mark.parametrize("spelling", ["orjson", "python", "ascii"])
def test_a_template_chunk_reads_as_the_whole_parse_would(size, spelling):
    # the template (one JSON string parsed per token) against every line parsed whole
    def encode(payload: object) -> str:
        if isinstance(payload, str):
            return payload
        if spelling == "orjson":
            return orjson.dumps(payload).decode()
        return json.dumps(payload, ensure_ascii=spelling == "ascii")  # ", " and ": "

    data = "".join(f"data: {encode(p)}\n\n" for p in TEMPLATED).encode()
    templated, whole = _Stream(True, 2), WholeStream(True, 2)
    assert feed_in_pieces(templated, data, size) == feed_in_pieces(whole, data, size)
    if spelling != "ascii":  # its non-ASCII texts are spelled otherwise: parsed whole
        assert templated._head


@pytest.mark.parametrize("per_read", [1, 2, 3])
def test_events_read_a_few_at_a_time_read_as_the_whole_parse_would(per_read):
    # in front of an engine that sends a token a step, a read is one whole event
    events = [
        f"data: {p if isinstance(p, str) else orjson.dumps(p).decode()}\n\n".encode()
        for p in TEMPLATED
    ]
    templated, whole = _Stream(True, 2), WholeStream(True, 2)
    for stream in (templated, whole):
        for i in range(0, len(events), per_read):
            stream.feed(b"".join(events[i : i + per_read]))
    assert list(templated.ready) == list(whole.ready) and templated.done


def test_a_line_that_only_looks_like_the_template_is_parsed_whole():
    # the template's head and tail around more than one JSON string: a tool call too
    looks_alike = (
        '{"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m",'
        '"choices":[{"index":0,"delta":{"content":"b","tool_calls":[{"index":0,"id":"c1",'
        '"function":{"name":"f","arguments":"{}"}}]},"logprobs":null,"finish_reason":null}]}'
    )
    payloads = [vllm_chunk(0, "a"), json.loads(looks_alike)]
    payloads.append(vllm_chunk(0, None, finish_reason="stop"))
    lines = [orjson.dumps(p).decode() for p in payloads]
    assert lines[1] == looks_alike  # as orjson spells it
    stream = _Stream(True, 1)
    stream.feed("".join(f"data: {line}\n\n" for line in [*lines, "[DONE]"]).encode())
    assert list(stream.ready) == [
        Text("ab", 2),
        ToolCallDelta(0, 0, "c1", "f", "{}", 0),
        Finished(FinishReason.STOP, 2, None),
    ]


def test_models_and_health_answers_are_read_up_to_a_bound():
    # a loopback server whose /models and /health answers are 256 MiB, sent for as
    # long as the gateway reads: it reads ~1 MiB of /models (then fails the describe)
    # and not much of /health, instead of the whole (200 MiB had taken it to 1.36 GB)
    sent = {"/v1/models": 0, "/health": 0}

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                size = 256 * 1024 * 1024
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
                piece = b'{"data": [' + b" " * 65_526
                for _ in range(size // len(piece)):
                    writer.write(piece)
                    await writer.drain()
                    sent[path] += len(piece)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def probe() -> tuple[errors.GatewayError, bool]:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server, httpx.AsyncClient() as http:
            upstream = OpenAIHttpUpstream(f"http://127.0.0.1:{port}/v1", http, raw_http=False)
            with pytest.raises(errors.Failed) as failed:
                await upstream.describe(HANG_GUARD)
            health = upstream.watch_health(HANG_GUARD, HANG_GUARD)
            serving = await anext(health)
            await health.aclose()
            return failed.value, serving

    failure, serving = asyncio.run(asyncio.wait_for(probe(), HANG_GUARD))
    assert "larger" in failure.message
    assert serving is True
    # what the server got out before the gateway stopped reading: the bound, plus
    # what the sockets' buffers hold
    assert sent["/v1/models"] < 16 * 1024 * 1024
    assert sent["/health"] < 16 * 1024 * 1024


GAUGES = (
    b"vllm:num_requests_running 2.0\nvllm:num_requests_waiting 1.0\nvllm:kv_cache_usage_perc 0.5\n"
)


def test_plain_http_polls_health_and_load_over_our_connection_within_their_bounds():
    """A plain http:// upstream's health and load polls are GETs over its own kept-alive
    connections (`http1.fetch`), with its key: the gauges asked for by name; a page
    past the bound is read up to it and its connection dropped; a silent server is a
    timeout."""
    pages = [GAUGES, GAUGES + b"# " + b"x" * (2 * MAX_METRICS_BYTES) + b"\n", None]
    heads: list[bytes] = []
    connections = 0

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        try:
            while True:
                heads.append(await reader.readuntil(b"\r\n\r\n"))
                page = pages.pop(0) if heads[-1].startswith(b"GET /metrics/") else b""
                if page is None:
                    await reader.read()  # never answers
                    return
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(page), page))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def polls() -> list:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
        async with httpx.AsyncClient() as http:
            upstream = OpenAIHttpUpstream(url, http, api_key="sk-1")
            results: list = [await upstream.engine_load(5.0)]
            results.append(await anext(upstream.watch_health(0.01, 5.0)))
            results.append(await upstream.engine_load(5.0))  # cut at the bound
            try:
                await upstream.engine_load(0.3)
            except errors.GatewayError as error:
                results.append(error)
            await upstream.close()
        server.close()
        return results

    first, healthy, cut, silent = anyio.run(polls)
    assert first == cut == EngineLoad(running=2, waiting=1, kv_usage=0.5)
    assert healthy is True and type(silent) is errors.Timeout
    assert heads[0].startswith(f"GET /metrics/?{LOAD_QUERY} HTTP/1.1\r\n".encode())
    assert b"\r\nAuthorization: Bearer sk-1\r\n" in heads[0]
    assert heads[1].startswith(b"GET /health HTTP/1.1\r\n")
    assert connections == 2  # one kept alive for three polls; the cut one was dropped


def test_a_poll_whose_kept_alive_connection_the_server_closed_goes_again_on_a_new_one():
    """The server's idle close crossing the next poll's GET (uvicorn closes idle
    connections after 5 s, as long as a poll's interval): the GET breaks before any
    answer on the reused connection and goes again, once, on a new one."""
    page = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(GAUGES), GAUGES)
    connections = 0
    closing = True

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        served = 0
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                if served and closing:  # the second GET on this connection: closed under it
                    return
                served += 1
                writer.write(page)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def polls() -> list:
        nonlocal closing
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
        async with httpx.AsyncClient() as http:
            upstream = OpenAIHttpUpstream(url, http)
            results: list = [await upstream.engine_load(5.0), await upstream.engine_load(5.0)]
            seen = connections
            closing = False
            results.append(await upstream.engine_load(5.0))
            results.append(seen)
            await upstream.close()
        server.close()
        return results

    first, second, third, seen = anyio.run(polls)
    assert first == second == third == EngineLoad(running=2, waiting=1, kv_usage=0.5)
    assert seen == 2  # the second poll: its reused connection closed, then a new one


def test_polls_in_flight_when_the_upstream_closes_leave_no_socket():
    """A poll cancelled mid-answer (as `Fleet.close` cancels its tasks before it closes
    the upstreams) and one whose upstream is closed under it (a worker that left) each
    drop their connection there: the server reads its end, and a full collection after
    the loop finds no socket left to warn of (the suite's warnings are errors)."""
    heads: list[bytes] = []
    ends: list[bytes] = []

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            heads.append(await reader.readuntil(b"\r\n\r\n"))
            ends.append(await reader.read())  # never answers: b"" once the client closes
        except ConnectionError as error:
            ends.append(type(error).__name__.encode())
        finally:
            writer.close()

    async def close_in_flight() -> tuple[list, int]:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
        async with httpx.AsyncClient() as http:
            upstream = OpenAIHttpUpstream(url, http)
            assert upstream._pool is not None
            load = asyncio.create_task(upstream.engine_load(HANG_GUARD))
            await until(lambda: len(heads) == 1, "the load poll's GET")
            load.cancel()
            outcomes: list = await asyncio.gather(load, return_exceptions=True)
            health = asyncio.create_task(anext(upstream.watch_health(HANG_GUARD, HANG_GUARD)))
            await until(lambda: len(heads) == 2, "the health poll's GET")
            await upstream.close()
            outcomes += await asyncio.gather(health, return_exceptions=True)
            await until(lambda: len(ends) == 2, "the server to read both ends")
            left = len(upstream._pool.open) + len(upstream._pool.idle)
        server.close()
        return outcomes, left

    (cancelled, closed), left = anyio.run(close_in_flight)
    gc.collect()  # an unclosed socket would warn here, and fail the test
    assert type(cancelled) is asyncio.CancelledError
    assert type(closed) is errors.Unavailable
    assert heads[0].startswith(b"GET /metrics/?") and heads[1].startswith(b"GET /health ")
    assert ends == [b"", b""] and left == 0


@respx.mock
def test_the_usages_cached_prompt_tokens_ride_on_finished():
    """vLLM's usage with `--enable-prompt-tokens-details` says the prompt's cached tokens;
    without it (the test above) `Finished` says none (None)."""
    usage = {
        "prompt_tokens": 9,
        "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": 8},
    }
    respx.post(f"{BASE}/chat/completions").respond(
        200,
        content=sse(chunk("Hi"), chunk(finish="stop"), chunk(usage=usage), "[DONE]"),
        headers={"content-type": "text/event-stream"},
    )
    events, failure, _ = anyio.run(run, CHAT)
    assert failure is None
    assert events[-1] == Finished(FinishReason.STOP, 1, 9, cached_tokens=8)
