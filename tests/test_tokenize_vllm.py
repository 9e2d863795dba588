"""Specs: `/tokenize` and `/detokenize` through the gateway equal vLLM's own, for the tiny
model served two ways: by vLLM's OpenAI server (`upstream: openai`: its routes asked) and
by vLLM's gRPC server (`upstream: vllm-grpc`: the gateway's own tokenizer and chat
template answer, the engine is not asked). vLLM's HTTP server, asked directly, is the
reference for both."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.config import ModelConfig
from tests.support.servers import Gateway
from tests.support.vllm import VllmProcess
from tests.support.waiting import HANG_GUARD

#: The session's vLLM servers start in the first test's setup (see test_vllm_grpc.py).
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(420)]

HTTP_MODEL, GRPC_MODEL = "tiny-vllm", "tiny-vllm-grpc"
CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the weather in Paris, déjà vu? 中文"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather of a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
BODIES: list[dict[str, Any]] = [
    {"prompt": "Hello there, déjà vu 中文 😀"},
    {"prompt": "Hello there", "return_token_strs": True},
    {"prompt": ""},
    {"messages": CHAT},
    {"messages": CHAT, "return_token_strs": True, "tools": TOOLS},
    {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": False}},
    # a prefill, and a chat without its generation prompt (vLLM's chat parameters)
    {
        "messages": [*CHAT, {"role": "assistant", "content": "It is sunny in"}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    },
    {"messages": CHAT, "add_generation_prompt": False},
]


@pytest.fixture
def front(
    gateway_with, vllm_http: VllmProcess, vllm_grpc: VllmProcess, vllm_model: Path
) -> Gateway:
    models = (
        ModelConfig(HTTP_MODEL, upstream="openai", workers=(f"{vllm_http_url(vllm_http)}/v1",)),
        ModelConfig(
            GRPC_MODEL,
            upstream="vllm-grpc",
            tokenizer=str(vllm_model),
            workers=(f"127.0.0.1:{vllm_grpc.port}",),
        ),
    )
    return gateway_with(models=models)


def vllm_http_url(server: VllmProcess) -> str:
    return f"http://127.0.0.1:{server.port}"


@pytest.fixture
def vllm(vllm_http: VllmProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=vllm_http_url(vllm_http), timeout=HANG_GUARD) as client:
        yield client


@pytest.fixture
def http(front: Gateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=front.url, timeout=HANG_GUARD) as client:
        yield client


def answer(client: httpx.Client, path: str, model: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = client.post(path, json={"model": model, **body})
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.parametrize("body", BODIES, ids=lambda b: "-".join(sorted(b)))
def test_the_gateways_tokens_are_vllms(http, vllm, body):
    expected = answer(vllm, "/tokenize", HTTP_MODEL, body)
    assert expected["count"] > 0 or body.get("prompt") == ""
    for model in (HTTP_MODEL, GRPC_MODEL):
        assert answer(http, "/tokenize", model, body) == expected, model
        assert answer(http, "/v1/tokenize", model, body) == expected, model


def test_the_tokens_of_a_chat_are_those_its_completion_counts(http):
    """The chat form's count is the prompt a chat completion of the same messages sends
    (its `usage.prompt_tokens`), on both paths."""
    for model in (HTTP_MODEL, GRPC_MODEL):
        count = answer(http, "/tokenize", model, {"messages": CHAT})["count"]
        body = {"messages": CHAT, "max_tokens": 1, "temperature": 0}
        usage = answer(http, "/v1/chat/completions", model, body)["usage"]
        assert usage["prompt_tokens"] == count, model


def test_the_gateways_text_of_ids_is_vllms(http, vllm):
    ids = answer(vllm, "/tokenize", HTTP_MODEL, {"messages": CHAT})["tokens"]
    for tokens in (ids, ids[:7], ids[3:5], []):  # special tokens kept; pieces of characters
        expected = answer(vllm, "/detokenize", HTTP_MODEL, {"tokens": tokens})
        for model in (HTTP_MODEL, GRPC_MODEL):
            assert answer(http, "/detokenize", model, {"tokens": tokens}) == expected, model


def test_an_id_outside_the_vocabulary(http, vllm):
    """The gateway's tokenizer refuses it naming `tokens`; vLLM's server answers for
    itself through `upstream: openai`, whatever it says, as its own client would see it."""
    outside = {"tokens": [1, 10**6]}
    reply = http.post("/detokenize", json={"model": GRPC_MODEL, **outside})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tokens"
    direct = vllm.post("/detokenize", json={"model": HTTP_MODEL, **outside})
    through = http.post("/detokenize", json={"model": HTTP_MODEL, **outside})
    assert through.status_code == direct.status_code
    if direct.status_code == 200:
        assert through.json() == direct.json()


def test_a_long_prompt_is_counted_whole_on_both_paths(http, vllm):
    """Anthropic's count_tokens of a prompt of some 20,000 tokens (past what an error
    body's bound would read of vLLM's `/tokenize` answer, which lists every id) is
    vLLM's own count, through its server and through the gateway's tokenizer."""
    text = " ".join(f"word{i}" for i in range(4000))
    expected = answer(
        vllm, "/tokenize", HTTP_MODEL, {"messages": [{"role": "user", "content": text}]}
    )
    assert expected["count"] > 15_000
    for model in (HTTP_MODEL, GRPC_MODEL):
        body = {"messages": [{"role": "user", "content": text}]}
        counted = answer(http, "/v1/messages/count_tokens", model, body)
        assert counted == {"input_tokens": expected["count"]}, model
