"""What agent frameworks on the Responses API (Codex, the Agents SDK with reasoning
models) ask of a reasoning model, through the official `openai` SDK against the real
gateway: `reasoning.summary` (the whole reasoning as the item's one summary part,
streamed as OpenAI streams summaries), `include: ["reasoning.encrypted_content"]` (an
opaque string of ours that a stateless agent sends back, read as the reasoning it holds;
anyone else's refused by name), and logprobs (`include:
["message.output_text.logprobs"]`, `top_logprobs`), from the demo's workers.

The reasoning comes from a small OpenAI-compatible server that thinks before its reply
(tests/support/openai_server.py), which records the last body it was sent."""

from __future__ import annotations

import base64
import secrets
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.config import ModelConfig
from gateway.edge.responses.params import MAX_OPAQUE_BYTES, OPAQUE_PREFIX, opaque
from tests.support.openai_server import OpenAIServer
from tests.support.requests import assert_openai_error
from tests.support.scripted_worker import SCRIPTED_MODEL
from tests.support.servers import DEMO_MODEL, Gateway
from tests.support.waiting import HANG_GUARD
from tests.test_obfuscation import PADDED, events, padded_deltas

MODEL = "thinker"
THOUGHTS = ["The user ", "says hi; ", "I greet back."]
THOUGHT = "".join(THOUGHTS)
ENCRYPTED = "reasoning.encrypted_content"
LOGPROBS = "message.output_text.logprobs"
#: A summary's events on a reasoning item, in OpenAI's order (deltas between).
SUMMARY_EVENTS = [
    "response.output_item.added",
    "response.reasoning_summary_part.added",
    "response.reasoning_summary_text.delta",
    "response.reasoning_summary_text.done",
    "response.reasoning_summary_part.done",
    "response.output_item.done",
]


@pytest.fixture
def thinker(server_loop, gateway_with, workers) -> Iterator[tuple[OpenAIServer, Gateway]]:
    """The upstream, thinking before its reply, and a gateway in front of it (and of the
    demo's workers)."""
    key = "sk-" + secrets.token_hex(8)
    server = OpenAIServer(MODEL, key, None)
    server.reasoning = list(THOUGHTS)
    server_loop.call(server.start())
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("THINKER_KEY", key)
        model = ModelConfig(
            MODEL, workers=(server.url,), upstream="openai", api_key_env="THINKER_KEY"
        )
        demo = ModelConfig(DEMO_MODEL, workers=(workers.demo.address,))
        yield server, gateway_with(models=(model, demo))
    server_loop.call(server.stop())


def sdk(gw: Gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=HANG_GUARD)


@pytest.fixture
def api(gateway) -> Iterator[openai.OpenAI]:
    with sdk(gateway) as client:
        yield client


def _whole_and_streamed(client: openai.OpenAI, **body: Any) -> tuple[Any, list[Any], Any]:
    whole = client.responses.create(**body)
    with client.responses.stream(**body) as stream:
        seen = list(stream)
        streamed = stream.get_final_response()
    return whole, seen, streamed


# -- reasoning.summary ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "reasoning",
    [
        {"summary": "auto"},
        {"summary": "concise", "effort": "low"},
        {"summary": "detailed"},
        {"generate_summary": "auto"},  # the deprecated name
    ],
)
def test_a_summary_holds_the_whole_reasoning_whole_and_streamed(thinker, reasoning):
    _, gw = thinker
    asked = reasoning.get("summary") or reasoning["generate_summary"]
    with sdk(gw) as client:
        whole, seen, streamed = _whole_and_streamed(
            client, model=MODEL, input="hi", reasoning=reasoning
        )
        kept = client.responses.retrieve(whole.id)
    for response in (whole, streamed, kept):
        assert [item.type for item in response.output] == ["reasoning", "message"]
        item = response.output[0]
        assert [(s.type, s.text) for s in item.summary] == [("summary_text", THOUGHT)]
        assert item.content is None  # the text is not sent twice
        assert item.encrypted_content is None and item.status == "completed"
        assert response.output_text == "hello"
        assert response.reasoning is not None and response.reasoning.summary == asked
        assert response.usage is not None
        assert response.usage.output_tokens_details.reasoning_tokens == len(THOUGHTS)
    assert kept.output == whole.output
    kinds = [e.type for e in seen]
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    assert not [k for k in kinds if "reasoning_text" in k]
    item_id = streamed.output[0].id
    on_item = [e for e in seen if getattr(e, "item_id", None) == item_id or _item_is(e, item_id)]
    # the item's events, each kind once (the deltas are a run)
    runs = [e.type for i, e in enumerate(on_item) if not i or e.type != on_item[i - 1].type]
    assert runs == SUMMARY_EVENTS
    assert kinds.index("response.output_item.done") < kinds.index("response.output_text.delta")
    deltas = [e for e in seen if e.type == "response.reasoning_summary_text.delta"]
    assert "".join(e.delta for e in deltas) == THOUGHT
    for event in on_item[1:-1]:
        assert event.summary_index == 0 and event.output_index == 0
    added = next(e for e in seen if e.type == "response.reasoning_summary_part.added")
    done = next(e for e in seen if e.type == "response.reasoning_summary_part.done")
    assert (added.part.text, done.part.text) == ("", THOUGHT)
    assert done.status is None  # it completed
    text_done = next(e for e in seen if e.type == "response.reasoning_summary_text.done")
    assert text_done.text == THOUGHT


def _item_is(event: Any, item_id: str) -> bool:
    item = getattr(event, "item", None)
    return item is not None and item.id == item_id


def test_without_a_summary_nothing_changes(thinker):
    _, gw = thinker
    with sdk(gw) as client:
        whole, seen, _ = _whole_and_streamed(client, model=MODEL, input="hi")
    item = whole.output[0]
    assert item.summary == [] and item.content is not None and item.content[0].text == THOUGHT
    assert whole.reasoning is not None and whole.reasoning.summary is None
    kinds = {e.type for e in seen}
    assert "response.reasoning_text.delta" in kinds
    assert not any("summary" in kind for kind in kinds)


def test_a_stored_summary_gives_the_reasoning_back_to_the_model(thinker):
    server, gw = thinker
    with sdk(gw) as client:
        first = client.responses.create(model=MODEL, input="hi", reasoning={"summary": "auto"})
        client.responses.create(model=MODEL, input="and?", previous_response_id=first.id)
    messages = server.last_body["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant", "user"]
    assert messages[1]["reasoning"] == THOUGHT and messages[1]["content"] == "hello"


def test_a_summary_on_the_events_path(thinker):
    """With tools, the answer takes the events path: the same item and events."""
    _, gw = thinker
    tool = {"type": "function", "name": "noop", "parameters": {"type": "object"}}
    with sdk(gw) as client:
        whole, seen, streamed = _whole_and_streamed(
            client, model=MODEL, input="hi", tools=[tool], reasoning={"summary": "auto"}
        )
    for response in (whole, streamed):
        assert response.output[0].summary[0].text == THOUGHT
        assert response.output[0].content is None and response.output_text == "hello"
    kinds = [e.type for e in seen]
    assert kinds.count("response.reasoning_summary_part.done") == 1
    assert "response.reasoning_text.delta" not in kinds


def test_a_summary_s_deltas_are_padded(thinker):
    _, gw = thinker
    body = {
        "model": MODEL,
        "input": "hi",
        "stream": True,
        "stream_options": PADDED,
        "reasoning": {"summary": "auto"},
    }
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        raw = events(http, "/v1/responses", body)
    assert b"response.reasoning_summary_text.delta" in padded_deltas(raw)


def test_a_summary_that_is_not_openai_s_is_refused_by_name(thinker):
    _, gw = thinker
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        for reasoning, param in (
            ({"summary": "brief"}, "reasoning.summary"),
            ({"generate_summary": 1}, "reasoning.generate_summary"),
        ):
            body = {"model": MODEL, "input": "hi", "reasoning": reasoning}
            answer = http.post("/v1/responses", json=body)
            assert answer.status_code == 400, answer.text
            assert assert_openai_error(answer)["param"] == param


# -- reasoning.encrypted_content ---------------------------------------------------------


@pytest.mark.parametrize("summary", [None, "auto"])
def test_a_stateless_conversation_sends_its_reasoning_back(thinker, summary):
    """Codex's way: `store: false`, the reasoning asked as `encrypted_content`, and the
    answer's items sent back on the next turn; the model's template gets the reasoning on
    the assistant's turn, from the opaque string alone."""
    server, gw = thinker
    extra: dict[str, Any] = {"store": False, "include": [ENCRYPTED]}
    if summary is not None:
        extra["reasoning"] = {"summary": summary}
    with sdk(gw) as client:
        whole, seen, streamed = _whole_and_streamed(client, model=MODEL, input="hi", **extra)
        for response in (whole, streamed):
            item = response.output[0]
            assert item.encrypted_content is not None
            assert item.encrypted_content.startswith(OPAQUE_PREFIX)
        added = next(e for e in seen if e.type == "response.output_item.added")
        done = next(e for e in seen if e.type == "response.output_item.done")
        assert added.item.encrypted_content is None  # whole once the item is
        assert done.item.encrypted_content == streamed.output[0].encrypted_content
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(whole.id)
        # the SDK's own items sent back as they came (OpenAI's advice), and the items with
        # their readable text left out: the opaque string alone carries the reasoning
        stripped = [item.model_dump(exclude_none=True) for item in streamed.output]
        stripped[0] = {k: v for k, v in stripped[0].items() if k != "content"} | {"summary": []}
        for items in (whole.output, stripped):
            turns = [{"role": "user", "content": "hi"}, *items, {"role": "user", "content": "and?"}]
            again = client.responses.create(model=MODEL, input=turns, **extra)  # type: ignore[arg-type]
            assert again.output_text == "hello"
            messages = server.last_body["messages"]
            assert [m["role"] for m in messages] == ["user", "assistant", "user"]
            assert messages[1]["reasoning"] == THOUGHT and messages[1]["content"] == "hello"


def test_a_stored_input_item_keeps_its_encrypted_content(thinker):
    server, gw = thinker
    item = {"type": "reasoning", "summary": [], "encrypted_content": opaque("kept thought")}
    turns = [
        {"role": "user", "content": "hi"},
        item,
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "and?"},
    ]
    with sdk(gw) as client:
        first = client.responses.create(model=MODEL, input=turns)  # type: ignore[arg-type]
        listed = client.responses.input_items.list(first.id, order="asc")
        assert listed.data[1].encrypted_content == item["encrypted_content"]  # type: ignore[union-attr]
        client.responses.create(model=MODEL, input="more?", previous_response_id=first.id)
    messages = server.last_body["messages"]
    assert messages[1]["reasoning"] == "kept thought"


def _sealed(raw: bytes) -> str:
    return OPAQUE_PREFIX + base64.urlsafe_b64encode(zlib.compress(raw)).decode().rstrip("=")


def test_encrypted_content_not_ours_damaged_or_too_big_is_refused_by_name(thinker):
    _, gw = thinker
    ours = opaque(THOUGHT)
    big = "a" * (MAX_OPAQUE_BYTES // 2 + 1)
    cases = [
        ("gAAAAABoOpenAIsEncryptedReasoning", 0, "not made by this gateway"),  # OpenAI's
        (ours[:-6] + "AAAAAA", 0, "damaged"),  # tampered
        (ours[: len(OPAQUE_PREFIX) + 8], 0, "damaged"),  # cut
        (OPAQUE_PREFIX + "!!!not base64!!!", 0, "damaged"),
        (_sealed(b"\xff\xfe not UTF-8"), 0, "damaged"),
        (_sealed(b"a" * (MAX_OPAQUE_BYTES + 1)), 0, "bytes"),  # a small bomb
    ]
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
        for sealed, at, said in cases:
            item = {"type": "reasoning", "summary": [], "encrypted_content": sealed}
            body = {"model": MODEL, "input": [item, {"role": "user", "content": "hi"}]}
            answer = http.post("/v1/responses", json=body)
            assert answer.status_code == 400, answer.text
            error = assert_openai_error(answer)
            assert error["param"] == f"input[{at}].encrypted_content", error
            assert said in error["message"]
        # the bound is on all of a request's items together
        half = {"type": "reasoning", "summary": [], "encrypted_content": opaque(big)}
        body = {"model": MODEL, "input": [half, half | {"id": "rs_2"}, "hi"]}
        body["input"][2] = {"role": "user", "content": "hi"}
        answer = http.post("/v1/responses", json=body)
        assert answer.status_code == 400, answer.text
        assert assert_openai_error(answer)["param"] == "input[1].encrypted_content"
        one = {"model": MODEL, "input": [half, {"role": "user", "content": "hi"}]}
        first = http.post("/v1/responses", json=one)
        assert first.status_code == 200, first.text
        # and on all of a stored conversation's, read again for its next turn
        one["previous_response_id"] = first.json()["id"]
        answer = http.post("/v1/responses", json=one)
        assert answer.status_code == 400, answer.text
        assert assert_openai_error(answer)["param"] == "input"


# -- logprobs --------------------------------------------------------------------------------


def _tokens(logprobs: Any) -> list[tuple[str, float, list[tuple[str, float]]]]:
    return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in logprobs]


@pytest.mark.parametrize("top", [None, 0, 3])
def test_logprobs_whole_and_streamed(api, top):
    body: dict[str, Any] = {"model": DEMO_MODEL, "input": "one two three", "include": [LOGPROBS]}
    if top is not None:
        body["top_logprobs"] = top
    whole, seen, streamed = _whole_and_streamed(api, **body)
    alternatives = [(f"<alt{i}>", -1.0 - i) for i in range(1, top or 0)]
    expected = [
        (word, -1.0, [(word, -1.0), *alternatives] if top else [])
        for word in ("one", " two", " three")
    ]
    for response in (whole, streamed):
        part = response.output[0].content[0]
        assert part.text == "one two three" and _tokens(part.logprobs) == expected
        assert [t.bytes for t in part.logprobs] == [list(w.encode()) for w, _, _ in expected]
        assert response.top_logprobs == (top or 0)
    deltas = [e for e in seen if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == "one two three"
    assert [t for e in deltas for t in _tokens(e.logprobs)] == expected
    done = next(e for e in seen if e.type == "response.output_text.done")
    assert _tokens(done.logprobs) == expected
    assert [e.sequence_number for e in seen] == list(range(len(seen)))


def test_logprobs_deltas_are_padded(client):
    body = {
        "model": DEMO_MODEL,
        "input": "one two three",
        "include": [LOGPROBS],
        "top_logprobs": 2,
        "stream": True,
        "stream_options": PADDED,
    }
    raw = events(client, "/v1/responses", body)
    kinds = padded_deltas(raw)
    deltas = [e for k, e in zip(kinds, raw, strict=True) if k == b"response.output_text.delta"]
    assert deltas
    data = [orjson.loads(e.split(b"data: ", 1)[1]) for e in deltas]
    tokens = [t["token"] for d in data for t in d["logprobs"]]
    assert tokens == ["one", " two", " three"]


def test_top_logprobs_alone_shows_none(api):
    """As OpenAI's API and vLLM's server: without the include, the text's logprobs are
    not shown (`[]`), and the worker is asked for none."""
    whole, seen, _ = _whole_and_streamed(api, model=DEMO_MODEL, input="one two", top_logprobs=2)
    assert whole.output[0].content[0].logprobs == [] and whole.top_logprobs == 2
    assert all(e.logprobs == [] for e in seen if e.type == "response.output_text.delta")


def test_logprobs_with_tools_and_the_stored_answer(api):
    weather = {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    answer = api.responses.create(
        model=DEMO_MODEL, input="say hello", tools=[weather], include=[LOGPROBS]
    )
    assert answer.output_text == "say hello"
    assert [t.token for t in answer.output[0].content[0].logprobs] == ["say", " hello"]
    kept = api.responses.retrieve(answer.id)
    assert kept.output == answer.output


def test_logprobs_from_workers_without_them_are_refused_naming_include(client):
    body = {"model": SCRIPTED_MODEL, "input": "hi", "include": [LOGPROBS]}
    answer = client.post("/v1/responses", json=body)
    assert answer.status_code == 400, answer.text
    error = assert_openai_error(answer)
    assert error["param"] == "include" and LOGPROBS in error["message"]
