"""The prompt's tokens an engine found in its prefix cache, in every API's usage, through
a real gateway and the demo worker, whose cache holds the blocks of a prompt it saw: sent
twice, a chat of one user message of 40 four-letter words (205 bytes as the cache reads
them: role NUL content NUL) finds its first 12 blocks (192 bytes) held the second time,
which hold 37 of its words whole (`gateway.worker.demo.cached_words`). Each test has
its own word, so its first answer finds nothing cached. Beyond the APIs: the metrics,
/metrics/json and the usage ledger count them (the trace's attribute: test_tracing)."""

from __future__ import annotations

import csv
import io
import logging
from typing import Any

import anthropic
import httpx
import openai
import pytest

from gateway.worker.demo import cached_words
from tests.support.clients import openai_sdk
from tests.support.metrics import access_lines, scrape, value
from tests.support.requests import sse_events, user
from tests.support.servers import DEMO_MODEL
from tests.support.waiting import HANG_GUARD, wait_until

WORDS = 40
CACHED = 37


def _prompt(word: str) -> str:
    assert len(word) == 4
    return " ".join([word] * WORDS)


def _chat(api: openai.OpenAI, word: str) -> list[openai.types.CompletionUsage]:
    """The usage of the same chat asked twice, as the SDK reads it."""
    usages = []
    for _ in range(2):
        reply = api.chat.completions.create(
            model=DEMO_MODEL, messages=user(_prompt(word)), max_tokens=2
        )
        assert reply.usage is not None
        usages.append(reply.usage)
    return usages


def test_a_chat_asked_again_reports_its_cached_prompt_tokens(api: openai.OpenAI):
    first, second = _chat(api, "chat")
    assert first.prompt_tokens == second.prompt_tokens == WORDS
    assert first.prompt_tokens_details is not None and second.prompt_tokens_details is not None
    assert first.prompt_tokens_details.cached_tokens == 0
    assert second.prompt_tokens_details.cached_tokens == CACHED


def test_a_streamed_chat_reports_them_in_its_usage_chunk_only(client: httpx.Client):
    body = {
        "model": DEMO_MODEL,
        "messages": user(_prompt("strm")),
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usages = []
    for _ in range(2):
        chunks = sse_events(client.post("/v1/chat/completions", json=body).text)
        assert chunks[-1] == "[DONE]"
        assert all(chunk["usage"] is None for chunk in chunks[:-2])
        usages.append(chunks[-2]["usage"])
    assert [u["prompt_tokens_details"] for u in usages] == [
        {"cached_tokens": 0},
        {"cached_tokens": CACHED},
    ]
    assert usages[1]["prompt_tokens"] == WORDS


def test_a_completion_reports_them_as_a_chat_does_and_so_does_the_access_log(
    client: httpx.Client, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.INFO, logger="furnace.access")
    # a text prompt is one content: 199 bytes, 12 blocks held, 38 words whole in them
    body = {"model": DEMO_MODEL, "prompt": _prompt("cmpl"), "max_tokens": 2}
    usages = [client.post("/v1/completions", json=body).json()["usage"] for _ in range(2)]
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, 38]
    wait_until(lambda: len(access_lines(caplog)) >= 2, "both access-log lines")
    lines = access_lines(caplog)[-2:]
    assert [(line["prompt_tokens"], line["cached_tokens"]) for line in lines] == [(40, 0), (40, 38)]


@pytest.mark.parametrize(
    ("head", "chat", "words"),
    [
        (b"user\x00one two\x00", True, 2),  # a message whole: its NUL ends its last word
        (b"user\x00one tw", True, 1),  # "tw" may go on: not cached
        (b"user\x00one two", True, 1),  # nor "two", its separator past the cached bytes
        (b"user\x00one ", True, 1),
        (b"system\x00be brief\x00us", True, 2),  # roles are not words
        (b"use", True, 0),
        (b"one two three", False, 2),
        (b"one two three ", False, 3),
        (b"", False, 0),
    ],
)
def test_the_demos_rule_counts_whole_words_of_the_cached_bytes(head, chat, words):
    assert cached_words(head, chat) == words


def test_a_response_reports_them_in_input_tokens_details(api: openai.OpenAI):
    ask: dict[str, Any] = {"model": DEMO_MODEL, "input": _prompt("resp"), "max_output_tokens": 16}
    whole = api.responses.create(**ask)
    with api.responses.create(**ask, stream=True) as stream:
        last = list(stream)[-1]  # response.incomplete: the echo is cut at 16 tokens
    assert last.type == "response.incomplete"
    usages = [whole.usage, last.response.usage]
    assert None not in usages
    assert [u.input_tokens for u in usages if u] == [WORDS, WORDS]
    assert [u.input_tokens_details.cached_tokens for u in usages if u] == [0, CACHED]


def _anthropic_usage(usage: Any) -> tuple[int, int | None, int | None]:
    return usage.input_tokens, usage.cache_read_input_tokens, usage.cache_creation_input_tokens


def test_a_message_reports_cache_reads_apart_from_its_input_tokens(gateway: Any):
    """Anthropic counts the input as `input_tokens` plus the cache's reads and writes: the
    cached share moves from the first to the second, in the whole message and in the
    stream's message_start and message_delta."""
    with anthropic.Anthropic(base_url=gateway.url, api_key="unused", max_retries=0) as sdk:
        ask: dict[str, Any] = {
            "model": DEMO_MODEL,
            "max_tokens": 2,
            "messages": user(_prompt("msgs")),
        }
        first = sdk.messages.create(**ask)
        second = sdk.messages.create(**ask)
        assert _anthropic_usage(first.usage) == (WORDS, 0, 0)
        assert _anthropic_usage(second.usage) == (WORDS - CACHED, CACHED, 0)
        with sdk.messages.stream(**ask) as stream:
            events = list(stream)
    start = next(e for e in events if e.type == "message_start")
    delta = next(e for e in events if e.type == "message_delta")
    assert _anthropic_usage(start.message.usage) == (WORDS - CACHED, CACHED, 0)
    assert _anthropic_usage(delta.usage) == (WORDS - CACHED, CACHED, 0)


def test_the_metrics_and_the_usage_ledger_count_them_beside_the_prompt(gateway_with: Any) -> None:
    """A gateway of its own (its counters start at 0): the chat asked twice, then the
    prompt's cached tokens in `cached_prompt_tokens_total`, /metrics/json, the ledger's
    counter and its row (JSON and CSV), each beside the prompt tokens."""
    gw = gateway_with(admin_port=0)
    admin = gw.admin_url
    assert admin is not None
    with openai_sdk(gw.url) as api:
        first, second = _chat(api, "mtrc")
    assert first.prompt_tokens_details is not None and second.prompt_tokens_details is not None
    assert (
        first.prompt_tokens_details.cached_tokens,
        second.prompt_tokens_details.cached_tokens,
    ) == (
        0,
        CACHED,
    )

    def ledger_rows() -> list[dict[str, Any]]:
        answer = httpx.get(admin + "/admin/usage", params={"model": DEMO_MODEL}, timeout=HANG_GUARD)
        assert answer.status_code == 200, answer.text
        rows: list[dict[str, Any]] = answer.json()["data"]
        return rows

    # each request reaches the ledger at admission's end, after its answer is sent
    wait_until(lambda: sum(r["requests"] for r in ledger_rows()) == 2, "both in the ledger")
    (row,) = ledger_rows()
    assert (row["team"], row["key_id"]) == ("-", "-")
    assert (row["prompt_tokens"], row["cached_tokens"]) == (2 * WORDS, CACHED)
    sheet = httpx.get(
        admin + "/admin/usage", params={"model": DEMO_MODEL, "format": "csv"}, timeout=HANG_GUARD
    ).text
    (line,) = csv.DictReader(io.StringIO(sheet))
    assert (line["prompt_tokens"], line["cached_tokens"]) == (str(2 * WORDS), str(CACHED))

    samples = scrape(admin)
    model = {"model": DEMO_MODEL}
    assert value(samples, "furnace_gateway_prompt_tokens_total", **model) == 2 * WORDS
    assert value(samples, "furnace_gateway_cached_prompt_tokens_total", **model) == CACHED
    ledger = {"team": "-", "model": DEMO_MODEL}
    assert value(samples, "furnace_gateway_usage_prompt_tokens_total", **ledger) == 2 * WORDS
    assert value(samples, "furnace_gateway_usage_cached_tokens_total", **ledger) == CACHED
    figures = httpx.get(admin + "/metrics/json", timeout=HANG_GUARD).json()["models"][DEMO_MODEL]
    assert (figures["prompt_tokens"], figures["cached_prompt_tokens"]) == (2 * WORDS, CACHED)
