"""Specs: Anthropic's Message Batches API (`/v1/messages/batches`) through the official
`anthropic` SDK against the real gateway and its demo and scripted workers: a batch of
two models' requests run to `ended`, its results read with the SDK's `results()` (each
`succeeded` with its message, a request its route refuses `errored` in Anthropic's
shape); the checks made at creation, each naming its field; a cancel whose unsent
requests read `canceled` and whose lines in flight end; delete only once ended; the list
newest first; and a Message Batch invisible to the OpenAI Batch API's routes."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import pytest

from gateway.edge.batches import store as store_module
from tests.support.clients import openai_sdk
from tests.support.scripted_worker import SCRIPTED_MODEL, script
from tests.support.servers import DEMO_MODEL, assert_nothing_left
from tests.support.waiting import HANG_GUARD, wait_until


@pytest.fixture
def sdk(gateway) -> Iterator[anthropic.Anthropic]:
    with _claude(gateway.url) as client:
        yield client


def _claude(url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=HANG_GUARD)


def _hanging(n: int) -> list[dict]:
    """Requests the scripted worker answers once and then holds open."""
    return [
        _request(f"h{i}", script(texts=1, hang="after"), model=SCRIPTED_MODEL) for i in range(n)
    ]


def _request(custom_id: str, text: str, model: str = DEMO_MODEL, **params) -> dict:
    messages = [{"role": "user", "content": text}]
    body = {"model": model, "max_tokens": 4, "messages": messages, **params}
    return {"custom_id": custom_id, "params": body}


def _until_ended(sdk: anthropic.Anthropic, batch_id: str):
    found = []

    def ended() -> bool:
        found[:] = [sdk.messages.batches.retrieve(batch_id)]
        return found[0].processing_status == "ended"

    wait_until(ended, f"{batch_id} to end")
    return found[0]


def test_a_message_batch_runs_to_ended_and_its_results_read_with_the_sdk(sdk, gateway):
    requests = [
        _request("first", "hello there"),
        _request("second", "more words", model=SCRIPTED_MODEL),
        _request("refused", "x", max_tokens=0),
        {"custom_id": "no-model", "params": {"max_tokens": 4, "messages": []}},
    ]
    with openai_sdk(gateway.url) as api:
        files_before = {f.id for f in api.files.list()}
    batch = sdk.messages.batches.create(requests=requests)
    assert batch.type == "message_batch" and batch.id.startswith("msgbatch_")
    assert batch.processing_status == "in_progress" and batch.request_counts.processing == 4
    assert batch.results_url is None and batch.created_at < batch.expires_at
    ended = _until_ended(sdk, batch.id)
    counts = ended.request_counts
    assert (counts.succeeded, counts.errored, counts.canceled, counts.processing) == (2, 2, 0, 0)
    assert ended.ended_at and ended.results_url.endswith(f"/{batch.id}/results")
    results = {r.custom_id: r.result for r in sdk.messages.batches.results(batch.id)}
    assert results["first"].type == "succeeded"
    assert results["first"].message.type == "message" and results["first"].message.content
    assert results["second"].message.model == SCRIPTED_MODEL  # two models in one batch
    refused = results["refused"]
    assert refused.type == "errored" and refused.error.error.type == "invalid_request_error"
    assert "max_tokens" in refused.error.error.message
    # a request at fault past creation's checks is its own `errored`, not the batch's
    assert (
        results["no-model"].type == "errored" and "model" in results["no-model"].error.error.message
    )
    assert next(b.id for b in sdk.messages.batches.list()) == batch.id
    with openai_sdk(gateway.url) as api:  # its results are read through its own route only
        assert {f.id for f in api.files.list()} == files_before
    assert sdk.messages.batches.delete(batch.id).type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        sdk.messages.batches.retrieve(batch.id)


def test_the_checks_at_creation_name_their_field(sdk):
    for requests, field in (
        ([], "requests"),
        ([_request("bad id!", "x")], "requests.0.custom_id"),
        ([_request("a", "x"), _request("a", "y")], "requests.1.custom_id"),
        ([_request("a", "x", stream=True)], "requests.0.params.stream"),
        ([{"custom_id": "a", "params": "no"}], "requests.0.params"),
    ):
        with pytest.raises(anthropic.BadRequestError) as refused:
            sdk.messages.batches.create(requests=requests)
        assert refused.value.body["error"]["type"] == "invalid_request_error"
        assert field in refused.value.body["error"]["message"]


def test_a_cancel_leaves_the_unsent_requests_canceled(gateway_with, workers):
    gw = gateway_with(batch_concurrency=1)
    hanging = _hanging(3)
    with _claude(gw.url) as sdk:
        batch = sdk.messages.batches.create(requests=hanging)
        wait_until(lambda: workers.scripted.active == 1, "a request in flight")
        with pytest.raises(anthropic.BadRequestError):
            sdk.messages.batches.delete(batch.id)  # not ended yet
        assert sdk.messages.batches.cancel(batch.id).processing_status in ("canceling", "ended")
        ended = _until_ended(sdk, batch.id)
        assert ended.request_counts.canceled == 3 and ended.cancel_initiated_at
        results = {r.custom_id: r.result.type for r in sdk.messages.batches.results(batch.id)}
        assert results == {"h0": "canceled", "h1": "canceled", "h2": "canceled"}
        # the OpenAI Batch API's routes know no Message Batch
        with openai_sdk(gw.url) as api:
            assert [b.id for b in api.batches.list()] == []
    assert_nothing_left(gw, workers)


def test_on_redis_the_results_are_read_a_page_at_a_time(
    gateway_with, redis_server, workers, monkeypatch
):
    """Results streamed from Redis two pieces a read (PAGE): every request's result, once;
    a cancelled batch's unsent requests read from its requests kept in 50-byte pieces
    (a line across pieces)."""
    monkeypatch.setattr(store_module, "PAGE", 2)
    monkeypatch.setattr(store_module, "CHUNK_BYTES", 50)
    gw = gateway_with(redis_url=redis_server.url, redis_timeout=2.0)
    requests = [_request(f"r{i}", f"words {i}") for i in range(5)]
    requests.append(_request("refused", "x", max_tokens=0))
    with _claude(gw.url) as sdk:
        batch = sdk.messages.batches.create(requests=requests)
        assert _until_ended(sdk, batch.id).request_counts.succeeded == 5
        results = [(r.custom_id, r.result.type) for r in sdk.messages.batches.results(batch.id)]
    assert sorted(results) == sorted(
        [(f"r{i}", "succeeded") for i in range(5)] + [("refused", "errored")]
    )
    hanging = _hanging(3)
    with _claude(gw.url) as sdk:
        batch = sdk.messages.batches.create(requests=hanging)
        wait_until(lambda: workers.scripted.active == 3, "the requests in flight")
        sdk.messages.batches.cancel(batch.id)
        assert _until_ended(sdk, batch.id).request_counts.canceled == 3
        results = [(r.custom_id, r.result.type) for r in sdk.messages.batches.results(batch.id)]
    assert sorted(results) == [("h0", "canceled"), ("h1", "canceled"), ("h2", "canceled")]
    assert_nothing_left(gw, workers)


def test_answers_past_what_memory_keeps_are_errored_results(gateway_with, monkeypatch):
    """An answer past the team's bytes in the memory store is an `errored` result whose
    message says it was not kept; the others succeed."""
    gw = gateway_with()
    requests = [_request(f"r{i}", f"words {i}") for i in range(6)]
    # the requests themselves (a hidden file of about 1 KB) and an answer or two
    monkeypatch.setattr(store_module, "MEMORY_BYTES_PER_TEAM", 3000)
    with _claude(gw.url) as sdk:
        batch = sdk.messages.batches.create(requests=requests)
        counts = _until_ended(sdk, batch.id).request_counts
        results = {r.custom_id: r.result for r in sdk.messages.batches.results(batch.id)}
    assert counts.succeeded and counts.errored and counts.succeeded + counts.errored == 6
    errored = [r for r in results.values() if r.type == "errored"]
    assert len(errored) == counts.errored and len(results) == 6
    assert all(r.error.error.type == "api_error" for r in errored)
    assert all("not kept" in r.error.error.message for r in errored)


def test_the_list_pages_newest_first_around_a_cursor(sdk):
    made = [sdk.messages.batches.create(requests=[_request(f"r{i}", "x")]).id for i in range(5)]
    newest = made[::-1]
    page = sdk.messages.batches.list(limit=2)
    assert [b.id for b in page.data] == newest[:2] and page.has_more
    after = sdk.messages.batches.list(limit=2, after_id=newest[1])
    assert [b.id for b in after.data] == newest[2:4] and after.has_more
    before = sdk.messages.batches.list(limit=2, before_id=newest[4])
    assert [b.id for b in before.data] == newest[2:4] and before.has_more
    last = sdk.messages.batches.list(limit=2, before_id=newest[2])
    assert [b.id for b in last.data] == newest[:2] and not last.has_more
    for batch_id in made:
        _until_ended(sdk, batch_id)
