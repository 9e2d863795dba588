"""Specs: vLLM's `include_stop_str_in_output`: the stop string that ends a choice ends its
text too. Our workers' SDK matches the stop strings (the demo engine through the real
gateway: whole, streamed, with logprobs, each of n choices), the gateway matches them for
`vllm-grpc` workers (the same matcher; through vLLM itself: tests/test_vllm_grpc.py),
and an OpenAI-compatible server is sent the field in the body built for it. The
Responses API takes it with vLLM's `stop` (tests/test_responses_api.py)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.protocol.stop import StopMatcher
from gateway.protocol.types import GenerateRequest
from gateway.upstreams.openai_http.translate import request_body
from tests.support.servers import DEMO_MODEL
from tests.support.waiting import HANG_GUARD

PROMPT = "one two three four"
KEEP = {"include_stop_str_in_output": True}


def test_the_matcher_releases_the_stop_string_with_the_text_before_it():
    matcher = StopMatcher(("END", "STOP"), include=True)
    assert matcher.feed("a b ST") == ("a b ", False)
    assert matcher.feed("OP c") == ("STOP", True) and matcher.matched == "STOP"
    assert StopMatcher(("STOP",)).feed("a STOP") == ("a ", True)


def test_a_completion_keeps_the_stop_string_that_ended_it(api):
    cut = api.completions.create(model=DEMO_MODEL, prompt=PROMPT, stop=["three"])
    assert cut.choices[0].text == "one two "
    kept = api.completions.create(model=DEMO_MODEL, prompt=PROMPT, stop=[" thr"], extra_body=KEEP)
    assert kept.choices[0].text == "one two thr"
    assert kept.choices[0].finish_reason == "stop"
    stream = api.completions.create(
        model=DEMO_MODEL, prompt=PROMPT, stop=["three"], stream=True, extra_body=KEEP
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == "one two three"


def test_each_choice_and_its_logprobs_keep_it(api):
    answer = api.chat.completions.create(
        model=DEMO_MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        stop=["three"],
        n=2,
        logprobs=True,
        extra_body=KEEP,
    )
    for choice in answer.choices:
        assert choice.message.content == "one two three"
        # the stop string's token is released with it, so its logprob is too
        assert [t.token for t in choice.logprobs.content] == ["one", " two", " three"]


def test_without_a_stop_string_it_asks_nothing(api):
    answer = api.completions.create(model=DEMO_MODEL, prompt=PROMPT, extra_body=KEEP)
    assert answer.choices[0].text == PROMPT


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": PROMPT, "include_stop_str_in_output": "yes"}),
        ("/v1/responses", {"input": PROMPT, "include_stop_str_in_output": 1}),
    ],
)
def test_it_is_a_boolean(gateway, path, body):
    reply = httpx.post(gateway.url + path, json={"model": DEMO_MODEL, **body}, timeout=HANG_GUARD)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "include_stop_str_in_output"


def test_an_openai_server_is_sent_the_field():
    """With vLLM's other answer option the gateway serves through the worker's decoding,
    `skip_special_tokens` (tests/test_transformers_surface.py, tests/test_vllm_grpc.py)."""
    request = GenerateRequest(
        "m", prompt="a", stop=("b",), include_stop=True, skip_special_tokens=False
    )
    body: dict[str, Any] = request_body(request)
    assert body["include_stop_str_in_output"] is True and body["stop"] == ["b"]
    assert body["skip_special_tokens"] is False
    plain = request_body(GenerateRequest("m", prompt="a"))
    assert "include_stop_str_in_output" not in plain and "skip_special_tokens" not in plain
