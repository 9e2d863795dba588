"""Anthropic's Messages API on every kind of worker behind the gateway
(tests/support/conformance.py lists them), through the official `anthropic` SDK:
whole and streamed answers, and count_tokens, which every kind counts (the fake
OpenAI-compatible server, a gateway in front of the demo, through its `/tokenize`);
a model that cannot count: tests/test_count_tokens.py and tests/test_anthropic_api.py."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import pytest

from tests.support.conformance import Engine
from tests.support.requests import whole_input
from tests.support.waiting import HANG_GUARD


@pytest.fixture
def claude(served) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(
        base_url=served[1].url, api_key="unused", max_retries=0, timeout=HANG_GUARD
    ) as client:
        yield client


def ask(engine: Engine, text: str, max_tokens: int = 8) -> dict:
    return {
        "model": engine.model,
        "max_tokens": max_tokens,
        "messages": [{"role": "user", "content": text}],
        # the SDK's create() no longer takes temperature: it goes in the body as extra
        **({"extra_body": {"temperature": 0}} if "temperature" in engine.defaults else {}),
    }


def test_a_message_whole_and_streamed(claude, engine: Engine):
    whole = claude.messages.create(**ask(engine, "one two three"))
    with claude.messages.stream(**ask(engine, "one two three")) as stream:
        streamed_text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    for message in (whole, streamed):
        assert message.stop_reason in ("end_turn", "max_tokens")
        assert message.usage.input_tokens > 0 and 0 < message.usage.output_tokens <= 8
    assert streamed.content[0].text == streamed_text
    if engine.echoes:
        assert whole.content[0].text == streamed_text == "one two three"
    else:  # a real model at temperature 0 answers the same twice
        assert whole.content[0].text == streamed_text


def test_count_tokens_matches_the_answers_usage(claude, engine: Engine):
    body = ask(engine, "count these words please")
    counting = {k: body[k] for k in ("model", "messages")}
    counted = claude.messages.count_tokens(**counting)
    answered = claude.messages.create(**body)
    assert counted.input_tokens == whole_input(answered.usage) > 0


def test_clearing_tool_uses_counts_where_the_model_can(claude, engine: Engine):
    """`clear_tool_uses_20250919` counts the prompt as count_tokens does (a model that
    cannot count refuses it: tests/test_anthropic_api.py)."""
    edit = {"edits": [{"type": "clear_tool_uses_20250919"}]}
    body = {**ask(engine, "count these words please"), "context_management": edit}
    answer = claude.beta.messages.create(**body)
    assert answer.context_management.applied_edits == []  # far below 100,000 tokens
