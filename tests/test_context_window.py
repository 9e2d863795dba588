"""The context check, as vLLM 0.32's server makes it (`check_context`), against the
real gateway and the demo worker (a context of 64 tokens, one token a word): a
`max_tokens` past what the prompt leaves is served, its answer cut at the context;
a `max_tokens` above the context is a 400 naming it; a prompt that leaves no token
of the context is a 400 `context_length_exceeded`."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from gateway.protocol import errors
from gateway.protocol.types import GenerateRequest, SamplingParams
from gateway.worker.engine import check_context
from tests.support.requests import sse_events, user

CONTEXT = 64  # the shared demo worker's


def _error(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 400, response.text
    error: dict[str, Any] = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    return error


@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_past_what_the_prompt_leaves_is_cut_at_the_context(
    client: httpx.Client, stream: bool
) -> None:
    """The agents' case: a large `max_tokens` on a long prompt is served (the older
    rule, prompt plus `max_tokens` within the context, refused it)."""
    body = {"prompt": "a b", "max_tokens": CONTEXT, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    if stream:
        events = [e for e in sse_events(response.text) if e != "[DONE]"]
        finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        usage = events[-1]["usage"]
    else:
        finish = [response.json()["choices"][0]["finish_reason"]]
        usage = response.json()["usage"]
    assert finish == ["length"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (2, CONTEXT - 2)


def test_a_long_chat_with_a_large_max_completion_tokens_is_served(client: httpx.Client) -> None:
    words = " ".join(f"w{i}" for i in range(40))
    body = {"messages": user(words), "max_completion_tokens": CONTEXT - 4}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["choices"][0]["message"]["content"].split() == words.split()[: CONTEXT - 40]
    assert answer["usage"]["total_tokens"] == CONTEXT


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "a b", "max_tokens": CONTEXT + 1}, "max_tokens"),
        ("/v1/chat/completions", {"messages": user("a"), "max_tokens": CONTEXT + 1}, "max_tokens"),
        (
            "/v1/chat/completions",
            {"messages": user("a"), "max_completion_tokens": CONTEXT + 1},
            "max_completion_tokens",
        ),
        ("/v1/responses", {"input": "a", "max_output_tokens": CONTEXT + 1}, "max_output_tokens"),
        ("/v1/messages", {"messages": user("a"), "max_tokens": CONTEXT + 1}, "max_tokens"),
    ],
)
def test_max_tokens_above_the_context_is_a_400_naming_the_clients_parameter(
    client: httpx.Client, path: str, body: dict[str, Any], param: str
) -> None:
    """vLLM's refusal, made at the edge where the model's context is known (the workers
    report it), so that it names the parameter as the client wrote it."""
    response = client.post(path, json={"model": "furnace-demo", **body})
    assert response.status_code == 400, response.text
    payload = response.json()
    error = payload["error"]
    assert f"'{param}': {CONTEXT + 1} cannot be greater than" in error["message"]
    assert f"max_model_len={CONTEXT}" in error["message"]
    if path != "/v1/messages":  # Anthropic's shape names no parameter
        assert (error["code"], error["param"]) == (None, param)


def test_the_worker_refuses_max_tokens_above_its_context_in_vllms_words() -> None:
    """Where the gateway does not know the context, the worker's check (vLLM's own)."""
    request = GenerateRequest("m", prompt="a b", sampling=SamplingParams(max_tokens=CONTEXT + 1))
    with pytest.raises(errors.Invalid) as refused:
        check_context(request, 2, CONTEXT)
    assert refused.value.param == "max_tokens"
    assert str(refused.value) == (
        f"max_tokens={CONTEXT + 1} cannot be greater than max_model_len={CONTEXT}. "
        "Please request fewer output tokens."
    )


def test_max_tokens_of_the_whole_context_is_served(client: httpx.Client) -> None:
    """Equal to the context is not above it: clamped like any other."""
    response = client.post("/v1/completions", json={"prompt": "a b", "max_tokens": CONTEXT})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["finish_reason"] == "stop"  # the echo is shorter


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_longer_than_the_context_is_a_400(client: httpx.Client, stream: bool) -> None:
    body = {"messages": user("w " * (CONTEXT + 1)), "max_tokens": 4, "stream": stream}
    error = _error(client.post("/v1/chat/completions", json=body))
    assert (error["code"], error["param"]) == ("context_length_exceeded", "messages")
    assert error["message"] == (
        f"This model's maximum context length is {CONTEXT} tokens. However, your prompt "
        f"contains {CONTEXT + 1} input tokens, which exceeds this limit even without any "
        "output tokens. Please reduce the length of the input prompt."
    )


def test_a_prompt_that_fills_the_context_is_a_400(client: httpx.Client) -> None:
    """vLLM refuses it too: its budget would be 0 tokens ("max_tokens must be at least
    1, got 0"); here it is the context's refusal, which a client can act on."""
    error = _error(client.post("/v1/completions", json={"prompt": "w " * CONTEXT}))
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
    assert f"your prompt contains {CONTEXT} input tokens" in error["message"]
    assert "no room for any output tokens" in error["message"]
