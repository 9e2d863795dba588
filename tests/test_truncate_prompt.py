"""Specs: vLLM's `truncate_prompt_tokens` on chat and completions: the prompt keeps only its
last N tokens (cut from its start, after the chat template, as vLLM's generation cuts it;
-1: as many as the context leaves beside `max_tokens`), so a prompt longer than the
context is answered instead of refused. Through the real gateway to the demo worker
(tokens are words: gateway/worker/demo.py's rules), an OpenAI-compatible server's body;
the transformers engine's ids: tests/test_tokenize_workers.py; through vLLM itself:
tests/test_vllm_grpc.py."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from gateway.protocol.types import GenerateRequest
from gateway.upstreams.openai_http.translate import request_body
from gateway.worker.engine import kept_tokens, truncated
from tests.support.servers import DEMO_MODEL

#: The shared demo worker's context, in words (tests/support/servers.py).
CONTEXT = 64
LONG = " ".join(f"w{i}" for i in range(100))


def test_the_last_tokens_are_kept():
    request = GenerateRequest("m", prompt="x", truncate_prompt_tokens=3)
    assert truncated([1, 2, 3, 4, 5], request, 100) == [3, 4, 5]
    assert truncated([1, 2], request, 100) == [1, 2]
    assert truncated([1, 2, 3], GenerateRequest("m", prompt="x"), 100) == [1, 2, 3]
    minus_one = GenerateRequest("m", prompt="x", truncate_prompt_tokens=-1)
    assert kept_tokens(minus_one, 100) == 99  # a token left to answer
    assert kept_tokens(minus_one, 1) == 1


def test_a_completion_answers_from_its_last_words(api):
    answer = api.completions.create(
        model=DEMO_MODEL,
        prompt="one two three four five",
        max_tokens=8,
        extra_body={"truncate_prompt_tokens": 2},
    )
    assert answer.usage.prompt_tokens == 2
    assert answer.choices[0].text == "four five"  # the demo echoes what is left


def test_a_chat_longer_than_the_context_is_answered_with_minus_one(api):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": LONG}]
    with pytest.raises(openai.BadRequestError) as refused:
        api.chat.completions.create(model=DEMO_MODEL, messages=messages, max_tokens=4)
    assert refused.value.code == "context_length_exceeded"
    answer = api.chat.completions.create(
        model=DEMO_MODEL, messages=messages, max_tokens=4, extra_body={"truncate_prompt_tokens": -1}
    )
    assert answer.usage.prompt_tokens == CONTEXT - 4
    assert answer.choices[0].message.content == " ".join(f"w{i}" for i in range(40, 44))


@pytest.mark.parametrize("value", [0, -2, 1.5, "3", True, 2**31])
def test_other_values_are_refused_by_name(api, value):
    with pytest.raises(openai.BadRequestError) as refused:
        api.completions.create(
            model=DEMO_MODEL, prompt="a", extra_body={"truncate_prompt_tokens": value}
        )
    assert refused.value.body["param"] == "truncate_prompt_tokens"


def test_an_openai_server_is_sent_it():
    body: dict[str, Any] = request_body(GenerateRequest("m", prompt="a", truncate_prompt_tokens=5))
    assert body["truncate_prompt_tokens"] == 5
    assert "truncate_prompt_tokens" not in request_body(GenerateRequest("m", prompt="a"))
