"""The HTTP upstream's protocol edges, against a mocked transport (respx): the
SSE it reads, the errors it maps, what it sends."""

import json

import anyio
import httpx
import pytest
import respx

from gateway.protocol import errors
from gateway.protocol.types import (
    Finished,
    FinishReason,
    GenerateRequest,
    Message,
    SamplingParams,
    Started,
)
from gateway.upstreams.base import CANCELLED
from gateway.upstreams.openai_http import OpenAIHttpUpstream

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
        stream = OpenAIHttpUpstream(BASE, http).generate(request, 5.0, on_close=outcomes.append)
        events, failure = [], None
        try:
            async for event in stream:
                events.append(event)
        except errors.EngineError as error:
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
    assert [e.text for e in events[1:-1]] == ["Hel", "lo"]
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
def test_an_error_event_mid_stream():
    error = {
        "error": {"message": "worker died", "type": "server_error", "code": "engine_unavailable"}
    }
    respx.post(f"{BASE}/chat/completions").respond(200, content=sse(chunk("a"), error, "[DONE]"))
    events, failure, _ = anyio.run(run, CHAT)
    assert isinstance(failure, errors.Unavailable)
    assert failure.message == "worker died"
    assert len(events) == 2


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
    respx.post(f"{BASE}/chat/completions").respond(200, content=sse(chunk("a"), "[DONE]"))

    async def cancel_after_start() -> list:
        outcomes = []
        async with httpx.AsyncClient() as http:
            stream = OpenAIHttpUpstream(BASE, http).generate(CHAT, 5.0, on_close=outcomes.append)
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

    async def probe() -> tuple:
        async with httpx.AsyncClient() as http:
            upstream = OpenAIHttpUpstream(BASE + "/", http)
            models = await upstream.describe(1.0)
            health = upstream.watch_health(0.01)
            serving = await anext(health)
            await health.aclose()
            return models, serving

    models, serving = anyio.run(probe)
    assert [(m.name, m.max_context) for m in models] == [("m", 4096), ("n", 0)]
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
