"""One conformance suite for every kind of worker behind the gateway
(tests/support/conformance.py lists them): our demo on gRPC, an OpenAI-compatible
HTTP upstream (a second furnace-gateway, then vLLM's own server), and vLLM's kinds.

The behaviours hold for real engines, whose text is junk: usage adds up and streams
agree with whole answers, `max_tokens` cuts with `length`, a stop string taken from a
first greedy answer cuts the second, too long a prompt is a 400
`context_length_exceeded`, a bad parameter a 400 naming it, and a client leaving or
a timeout reaches the engine (its running requests fall back to 0 before the answer's end).
Only the demo's text is checked (it echoes its prompt)."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from tests.support import conformance
from tests.support.conformance import greedy
from tests.support.requests import sse_events, user
from tests.support.servers import assert_nothing_left
from tests.support.waiting import HANG_GUARD, wait_until


def assert_usage_adds_up(usage: Any) -> None:
    assert usage.prompt_tokens > 0
    assert usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_answer_and_usage(sdk, engine):
    messages = [{"role": "system", "content": "be brief"}, *user("one two three")]
    reply = sdk.chat.completions.create(**greedy(engine, messages=messages, max_tokens=16))
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.choices[0].message.role == "assistant"
    assert_usage_adds_up(reply.usage)
    if reply.choices[0].finish_reason == "length":
        assert reply.usage.completion_tokens == 16
    if engine.echoes:
        assert reply.choices[0].message.content == "one two three"
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (5, 3)


def test_stream_agrees_with_the_whole_answer(sdk, engine):
    request = greedy(engine, messages=user("a b c d"), max_tokens=12)
    whole = sdk.chat.completions.create(**request)
    chunks = list(
        sdk.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [c.choices[0].delta.content for c in chunks if c.choices]
    text = "".join(p or "" for p in pieces)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert_usage_adds_up(usage)
    # greedy: the stream is the same answer, counted the same
    assert text == whole.choices[0].message.content
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )
    assert sum(1 for p in pieces if p) <= usage.completion_tokens
    if engine.echoes:
        assert text == "a b c d"
        assert (usage.prompt_tokens, usage.completion_tokens) == (4, 4)


@pytest.mark.parametrize("stream", [False, True])
def test_length_at_max_tokens(served, stream):
    engine, front = served
    body = greedy(engine, prompt="a b c d e f", max_tokens=3, stream=stream)
    if stream:
        body["stream_options"] = {"include_usage": True}
    response = httpx.post(front.url + "/v1/completions", json=body, timeout=HANG_GUARD)
    assert response.status_code == 200, response.text
    if stream:
        events = sse_events(response.text)
        assert events[-1] == "[DONE]"
        choices = [e["choices"][0] for e in events[:-1] if e["choices"]]
        text = "".join(c["text"] for c in choices)
        reason = choices[-1]["finish_reason"]
        usage = events[-2]["usage"]
    else:
        answer = response.json()
        text, reason = answer["choices"][0]["text"], answer["choices"][0]["finish_reason"]
        usage = answer["usage"]
    assert reason == "length"
    assert usage["completion_tokens"] == 3
    if engine.echoes:
        assert text == "a b c"


def test_stop_string_from_a_first_answer(sdk, engine):
    prompt = "alpha beta gamma delta epsilon zeta eta theta"
    first = sdk.completions.create(**greedy(engine, prompt=prompt, max_tokens=16))
    text = first.choices[0].text
    stop = stop_string_in(text)
    second = sdk.completions.create(**greedy(engine, prompt=prompt, max_tokens=16, stop=[stop]))
    assert second.choices[0].finish_reason == "stop"
    assert second.choices[0].text == text[: text.index(stop)]
    assert second.usage.completion_tokens <= first.usage.completion_tokens


def stop_string_in(text: str) -> str:
    """Two plain characters from the second half of `text` whose first occurrence is not at
    its start (a real model's junk holds replacement characters and repeats)."""
    for start in range(len(text) // 2, len(text) - 1):
        stop = text[start : start + 2]
        if stop.isascii() and stop.isprintable() and " " not in stop and text.index(stop) > 0:
            return stop
    raise AssertionError(f"no stop string to take from {text!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_context_too_long_is_a_400(served, stream):
    engine, front = served
    body = greedy(engine, prompt="w " * (2 * engine.max_context), stream=stream)
    response = httpx.post(front.url + "/v1/completions", json=body, timeout=HANG_GUARD)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "context_length_exceeded")


def test_bad_parameter_is_a_400(sdk, engine):
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.completions.create(**greedy(engine, prompt="x", top_p=0))
    assert caught.value.body["param"] == "top_p"


def test_models_list_has_the_context(served):
    engine, front = served
    models = httpx.get(front.url + "/v1/models", timeout=HANG_GUARD).json()["data"]
    mine = next(m for m in models if m["id"] == engine.model)
    assert mine["max_model_len"] == engine.max_context


def test_client_leaving_stops_the_engine(served):
    engine, front = served
    if engine.unseen_stops:
        pytest.skip(engine.unseen_stops)
    before = engine.progress()
    body = {"model": engine.slow_model, **engine.defaults, **engine.long_request, "stream": True}
    with (
        httpx.Client(base_url=front.url, timeout=HANG_GUARD) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        while not next(lines).startswith('data: {"id"'):
            pass
        events = sse_events(next(lines) + "\n" + next(lines))
        assert events == [] or "choices" in events[0]
        wait_until(lambda: engine.running() == 1, "the engine to run the request")
    wait_until(lambda: engine.running() == 0, "the engine to stop")
    assert engine.stopped_early(before), "the engine finished the request"


def test_timeout_is_a_504_that_stops_the_engine(server_loop, served):
    engine, _ = served
    if engine.unseen_stops:
        pytest.skip(engine.unseen_stops)
    front = conformance.start_gateway_for(server_loop, engine, request_timeout=0.5)
    try:
        before = engine.progress()
        body = {"model": engine.slow_model, **engine.defaults, **engine.long_request}
        response = httpx.post(front.url + "/v1/completions", json=body, timeout=HANG_GUARD)
        assert response.status_code == 504, response.text
        assert response.json()["error"]["code"] == "timeout"
        wait_until(lambda: engine.running() == 0, "the engine to stop")
        assert engine.stopped_early(before), "the engine finished the request"
        assert_nothing_left(front, None)
    finally:
        front.stop()
