"""Specs: vLLM's `stream_interval`: after its first text, a stream's chunks hold at least
that many tokens of each choice, fewer only at the answer's end; the gateway holds them
whatever its workers send (here a token a message: the scripted worker's texts 20 ms
apart, the slow demo engine's a token every 50 ms for each of n choices). A keep-alive
tick lets held tokens out rather than a comment; a non-streamed answer is the same with
it or without (vLLM ignores it there); a value that is not an integer of at least 1 is a
400 naming it."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.scripted_worker import SCRIPTED_MODEL, script
from tests.support.waiting import HANG_GUARD

SLOW_MODEL = "furnace-slow"
PACED = script(texts=9, delay=0.02)


def _chat_chunks(api: Any, interval: int | None, **fields: Any) -> list[Any]:
    extra = fields.pop("extra_body", {})
    if interval is not None:
        extra = {**extra, "stream_interval": interval}
    return list(
        api.chat.completions.create(
            model=fields.pop("model", SCRIPTED_MODEL),
            messages=[{"role": "user", "content": fields.pop("content", PACED)}],
            stream=True,
            extra_body=extra,
            **fields,
        )
    )


def _texts(chunks: list[Any], index: int = 0) -> list[str]:
    return [
        choice.delta.content
        for chunk in chunks
        for choice in chunk.choices
        if choice.index == index and choice.delta.content
    ]


def test_chunks_after_the_first_hold_the_interval(api):
    assert _texts(_chat_chunks(api, None)) == [f"t{i} " for i in range(9)]
    chunks = _chat_chunks(api, 4)
    assert _texts(chunks) == ["t0 ", "t1 t2 t3 t4 ", "t5 t6 t7 t8 "]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_the_rest_comes_with_the_end(api):
    chunks = _chat_chunks(api, 4, content=script(texts=7, delay=0.02))
    assert _texts(chunks) == ["t0 ", "t1 t2 t3 t4 ", "t5 t6 "]


def test_completions_take_it_too(api):
    stream = api.completions.create(
        model=SCRIPTED_MODEL, prompt=PACED, stream=True, extra_body={"stream_interval": 3}
    )
    texts = [chunk.choices[0].text for chunk in stream if chunk.choices and chunk.choices[0].text]
    assert texts == ["t0 ", "t1 t2 t3 ", "t4 t5 t6 ", "t7 t8 "]


def test_each_of_n_choices_gets_the_interval(api):
    chunks = _chat_chunks(
        api,
        3,
        model=SLOW_MODEL,
        content="one two three four five six seven eight",
        n=2,
        max_tokens=8,
        stream_options={"include_usage": True},
    )
    for index in (0, 1):
        texts = _texts(chunks, index)
        words = [len(text.split()) for text in texts]
        assert sum(words) == 8, texts
        assert words[0] == 1, texts
        assert all(count >= 3 for count in words[1:-1]), texts
    assert chunks[-1].usage.completion_tokens == 16


def test_token_ids_ride_with_the_tokens_held(api):
    """With vLLM's `return_token_ids`, a chunk of several tokens carries all their ids."""
    fields = {"model": SLOW_MODEL, "content": "one two three four five six seven", "max_tokens": 7}
    chunks = _chat_chunks(api, 3, **fields, extra_body={"return_token_ids": True})
    ids = [getattr(c.choices[0], "token_ids", None) for c in chunks if c.choices]
    ids = [piece for piece in ids if piece]
    assert [len(i) for i in ids[:3]] == [1, 3, 3], ids
    whole = api.chat.completions.create(
        model=SLOW_MODEL,
        messages=[{"role": "user", "content": fields["content"]}],
        max_tokens=7,
        extra_body={"return_token_ids": True},
    )
    assert [i for piece in ids for i in piece] == whole.choices[0].token_ids


def test_a_keepalive_tick_lets_held_tokens_out(gateway_with):
    """Tokens held for an interval they would reach only after the keep-alive interval go
    out at the tick, not after it: a comment would tell the client nothing."""
    gateway = gateway_with(keepalive_interval=0.1)
    body = {
        "model": SCRIPTED_MODEL,
        "messages": [{"role": "user", "content": script(texts=3, delay=0.06)}],
        "stream": True,
        "stream_interval": 100,
    }
    with httpx.Client(base_url=gateway.url, timeout=HANG_GUARD) as client:
        answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert ": keep-alive" not in answer.text
    assert answer.text.count('"content":"t') in (2, 3)  # t1 at the tick, unless it came late


@pytest.mark.parametrize("multiplex", [True, False])  # the call pushes, or a task reads it
def test_a_full_buffer_lets_held_tokens_out(gateway_with, multiplex):
    """An interval larger than the stream buffer holds: the tokens go once it is full
    (the buffer's bound comes first), not when the answer ends."""
    gateway = gateway_with(
        stream_buffer_bytes=1024, multiplex_workers=multiplex, keepalive_interval=60
    )
    body = {
        "model": SCRIPTED_MODEL,
        "messages": [{"role": "user", "content": script(texts=400, delay=0.001)}],
        "stream": True,
        "stream_interval": 10_000,
    }
    with httpx.Client(base_url=gateway.url, timeout=HANG_GUARD) as client:
        answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    chunks = answer.text.count('"content":"t')
    assert 2 < chunks < 400, chunks  # the first, then a buffer's worth at a time


def test_a_whole_answer_is_the_same_with_it(api):
    plain = api.chat.completions.create(
        model=SCRIPTED_MODEL, messages=[{"role": "user", "content": PACED}]
    )
    held = api.chat.completions.create(
        model=SCRIPTED_MODEL,
        messages=[{"role": "user", "content": PACED}],
        extra_body={"stream_interval": 4},
    )
    assert held.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("value", [0, -1, 1.5, "4", True, [4], 2**31])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_it_is_an_integer_of_at_least_one(client, path, value):
    body: dict[str, Any] = {"model": SCRIPTED_MODEL, "stream": True, "stream_interval": value}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "x"}]
    else:
        body["prompt"] = "x"
    answer = client.post(path, json=body)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == "stream_interval"
