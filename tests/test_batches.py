"""Specs: OpenAI's Batch API (`/v1/files`, `/v1/batches`) through the official `openai`
SDK against the real gateway and its demo and scripted workers: a file uploaded, a batch
run to `completed` with every line's answer in the output file (and a line the endpoint
refuses in the error file), usage added up; the refusals of a file or a batch that
cannot run (each naming its parameter or line); a cancel that ends the lines in flight
and frees their slots; lines refused for "later" (no free slot) sent again until
answered; the team's own files and batches only; and on Redis, a batch that another
replica resumes when the one running it drains."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from gateway.edge.batches import routes as routes_module
from gateway.edge.batches import runner as runner_module
from gateway.edge.batches import store as store_module
from tests.support.clients import openai_sdk
from tests.support.keys import keyed, new_key
from tests.support.scripted_worker import SCRIPTED_MODEL, script
from tests.support.servers import DEMO_MODEL, assert_nothing_left
from tests.support.waiting import wait_until


def _jsonl(lines: list[dict]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def _chat(custom_id: str, content: str, model: str = DEMO_MODEL, **extra) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": content}], **extra}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def _until(api: openai.OpenAI, batch_id: str, *statuses: str):
    found = []

    def reached() -> bool:
        found[:] = [api.batches.retrieve(batch_id)]
        return found[0].status in statuses

    wait_until(reached, f"{batch_id} to be {' or '.join(statuses)}")
    return found[0]


def _lines(api: openai.OpenAI, file_id: str) -> dict[str, dict]:
    content = api.files.content(file_id).content
    return {line["custom_id"]: line for line in map(json.loads, content.splitlines())}


def test_a_batch_of_chats_runs_to_completed_with_each_answer_in_its_output_file(gateway):
    lines = [_chat(f"req-{i}", f"say {i}", max_tokens=4) for i in range(5)]
    lines.append(_chat("bad", "hi", max_tokens=-1))
    with openai_sdk(gateway.url) as api:
        uploaded = api.files.create(file=("input.jsonl", _jsonl(lines)), purpose="batch")
        assert uploaded.purpose == "batch" and uploaded.bytes == len(_jsonl(lines))
        assert uploaded.filename == "input.jsonl" and uploaded.id.startswith("file-")
        assert uploaded.expires_at == uploaded.created_at + 30 * 24 * 3600  # batch_ttl
        assert api.files.retrieve(uploaded.id).id == uploaded.id
        assert api.files.content(uploaded.id).content == _jsonl(lines)
        batch = api.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"job": "nightly"},
        )
        assert batch.status == "validating" and batch.metadata == {"job": "nightly"}
        done = _until(api, batch.id, "completed")
        assert done.request_counts.total == 6
        assert done.request_counts.completed == 5 and done.request_counts.failed == 1
        assert done.model == DEMO_MODEL and done.completed_at and done.in_progress_at
        output = _lines(api, done.output_file_id)
        assert sorted(output) == [f"req-{i}" for i in range(5)]
        answer = output["req-3"]["response"]
        assert answer["status_code"] == 200 and answer["request_id"].startswith("batch_req_")
        assert answer["body"]["object"] == "chat.completion"
        assert answer["body"]["choices"][0]["message"]["content"]
        errors = _lines(api, done.error_file_id)
        assert list(errors) == ["bad"]
        refused = errors["bad"]["response"]
        assert refused["status_code"] == 400 and refused["body"]["error"]["param"] == "max_tokens"
        used = sum(output[k]["response"]["body"]["usage"]["total_tokens"] for k in output)
        assert done.usage.total_tokens == used > 0
        assert next(b.id for b in api.batches.list()) == batch.id
        files = {f.id: f for f in api.files.list()}
        assert files[done.output_file_id].purpose == "batch_output"
        assert files[done.output_file_id].bytes == len(
            api.files.content(done.output_file_id).content
        )
        assert files[done.error_file_id].bytes == len(api.files.content(done.error_file_id).content)
        assert files[done.output_file_id].expires_at == done.created_at + 30 * 24 * 3600
        assert api.files.delete(uploaded.id).deleted is True
        with pytest.raises(openai.NotFoundError):
            api.files.retrieve(uploaded.id)


def test_a_file_that_cannot_run_fails_its_batch_naming_each_line(gateway):
    lines = [
        _chat("a", "x"),
        _chat("a", "y"),
        {**_chat("c", "z"), "url": "/v1/embeddings"},
        _chat("d", "w", model="other"),
        _chat("e", "v", stream=True),
    ]
    raw = _jsonl(lines) + b"not json\n"
    with openai_sdk(gateway.url) as api:
        uploaded = api.files.create(file=("in.jsonl", raw), purpose="batch")
        batch = api.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        failed = _until(api, batch.id, "failed")
        found = [(e.line, e.code, e.param) for e in failed.errors.data]
        assert found == [
            (2, "duplicate_custom_id", "custom_id"),
            (3, "invalid_url", "url"),
            (4, "mismatched_model", "body.model"),
            (5, "invalid_request", "body.stream"),
            (6, "invalid_json_line", None),
        ]
        assert failed.output_file_id is None and failed.failed_at


def test_refusals_name_their_parameter(gateway):
    with openai_sdk(gateway.url) as api:
        with pytest.raises(openai.BadRequestError) as refused:
            api.files.create(file=("in.jsonl", b"{}"), purpose="fine-tune")
        assert refused.value.body["param"] == "purpose"
        with pytest.raises(openai.BadRequestError) as refused:
            api.batches.create(
                input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
            )
        assert refused.value.body["param"] == "input_file_id"
        uploaded = api.files.create(file=("in.jsonl", _jsonl([_chat("a", "b")])), purpose="batch")
        for kwargs, param in (
            ({"endpoint": "/v1/moderations"}, "endpoint"),
            ({"completion_window": "1h"}, "completion_window"),
            ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ):
            args = {"endpoint": "/v1/chat/completions", "completion_window": "24h", **kwargs}
            with pytest.raises(openai.BadRequestError) as refused:
                api.batches.create(input_file_id=uploaded.id, **args)
            assert refused.value.body["param"] == param
        with pytest.raises(openai.NotFoundError):
            api.batches.retrieve("batch_nope")
    two = httpx.post(
        gateway.url + "/v1/files",
        files=[("file", ("a.jsonl", b"{}")), ("file", ("b.jsonl", b"{}"))],
        data={"purpose": "batch"},
        headers={"authorization": "Bearer none"},
    )
    assert two.status_code == 400 and two.json()["error"]["param"] == "file"
    # a form is taken only from a request that carries a key (a page cannot send one)
    response = httpx.post(
        gateway.url + "/v1/files", files={"file": b"x"}, data={"purpose": "batch"}
    )
    assert response.status_code == 415


def _run(api: openai.OpenAI, lines: list[dict], endpoint: str = "/v1/chat/completions"):
    uploaded = api.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
    return api.batches.create(input_file_id=uploaded.id, endpoint=endpoint, completion_window="24h")


def test_a_cancel_ends_the_lines_in_flight_and_sends_no_more(gateway_with, workers):
    gw = gateway_with(batch_concurrency=2)
    lines = [_chat(f"r{i}", script(texts=1, hang="after"), model=SCRIPTED_MODEL) for i in range(6)]
    with openai_sdk(gw.url) as api:
        uploaded = api.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
        batch = api.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        _until(api, batch.id, "in_progress")
        wait_until(lambda: workers.scripted.active == 2, "two lines in flight")
        cancelling = api.batches.cancel(batch.id)
        assert cancelling.status in ("cancelling", "cancelled")
        done = _until(api, batch.id, "cancelled")
        assert done.request_counts.completed == 0 and done.cancelled_at
        assert done.finalizing_at is None  # cancelling, then cancelled, as OpenAI's
        assert done.output_file_id is None
    wait_until(lambda: len(workers.scripted.cancelled) >= 2, "both calls in flight to end")
    assert_nothing_left(gw, workers)


def test_lines_refused_for_later_are_sent_again_until_answered(gateway_with, workers, monkeypatch):
    """One slot, held by an interactive request: the batch's line gets 503 (no slot, no
    queue), waits, and is answered once the slot is free; it is counted `retried`."""
    monkeypatch.setattr(runner_module, "MAX_BACKOFF", 0.2)
    gw = gateway_with(max_concurrent_requests=1)
    with openai_sdk(gw.url) as api:
        holder = api.responses.create(
            model=SCRIPTED_MODEL, input=script(texts=1, hang="after"), background=True
        )
        wait_until(lambda: workers.scripted.active == 1, "the slot to be held")
        batch = _run(api, [_chat("only", "after the wait", max_tokens=3)])
        retried = gw.state.telemetry.metrics.batch_lines.labels("", "retried")
        wait_until(lambda: retried._value.get() >= 2, "the line to be refused twice")
        assert api.batches.retrieve(batch.id).status == "in_progress"
        api.responses.cancel(holder.id)
        done = _until(api, batch.id, "completed")
        assert done.request_counts.completed == 1
        answer = _lines(api, done.output_file_id)["only"]["response"]
        assert answer["status_code"] == 200
    assert_nothing_left(gw, workers)


def test_an_expired_batch_writes_its_lines_not_done_as_batch_expired(
    gateway_with, workers, monkeypatch
):
    gw = gateway_with(batch_concurrency=1)
    lines = [_chat("fast", "quick", max_tokens=2)]
    lines += [_chat(f"h{i}", script(texts=1, hang="after"), model=SCRIPTED_MODEL) for i in range(2)]
    with openai_sdk(gw.url) as api:
        # one model a file: the scripted lines go in their own batch
        fast = _run(api, lines[:1])
        assert _until(api, fast.id, "completed").request_counts.completed == 1
        monkeypatch.setattr(routes_module, "WINDOW_SECONDS", 1)  # the next batch's window
        batch = _run(api, lines[1:])
        done = _until(api, batch.id, "expired")
        assert done.expired_at and done.request_counts.failed == 2
        errors = _lines(api, done.error_file_id)
        assert sorted(errors) == ["h0", "h1"]
        assert errors["h0"]["error"]["code"] == "batch_expired"
        assert errors["h0"]["response"] is None
    assert_nothing_left(gw, workers)


def test_a_team_sees_only_its_own_files_and_batches(gateway_with):
    ours, theirs = new_key("ours"), new_key("theirs")
    gw = gateway_with(**keyed({"ours": {}, "theirs": {}}, {ours: "ours", theirs: "theirs"}))
    with openai_sdk(gw.url, ours) as api, openai_sdk(gw.url, theirs) as other:
        batch = _run(api, [_chat("a", "mine", max_tokens=2)])
        done = _until(api, batch.id, "completed")
        assert done.request_counts.completed == 1
        for call in (
            lambda: other.batches.retrieve(batch.id),
            lambda: other.files.retrieve(done.output_file_id),
            lambda: other.files.content(done.input_file_id),
            lambda: other.batches.cancel(batch.id),
        ):
            with pytest.raises(openai.NotFoundError):
                call()
        assert [b.id for b in other.batches.list()] == []
        assert [f.id for f in other.files.list()] == []
        assert {f.id for f in api.files.list()} == {done.input_file_id, done.output_file_id}
        ledger = gw.state.telemetry.metrics.batch_lines.labels("ours", "completed")
        assert ledger._value.get() == 1


def test_on_redis_another_replica_resumes_a_batch_whose_replica_drained(
    gateway_with, redis_server, workers, monkeypatch
):
    """Replica one runs a batch a line at a time and drains after some lines: what it
    answered is kept, and replica two resumes the rest within its poll, never sending a
    recorded line again."""
    monkeypatch.setattr(runner_module, "ORPHAN_POLL", 0.2)
    monkeypatch.setattr(runner_module, "POLL", 0.1)
    monkeypatch.setattr(store_module, "PAGE", 3)  # files read (and downloaded) 3 pieces a call
    shared = {"redis_url": redis_server.url, "redis_timeout": 2.0, "batch_concurrency": 1}
    one, two = gateway_with(**shared), gateway_with(**shared)
    lines = [_chat(f"r{i}", script(texts=2, delay=0.1), model=SCRIPTED_MODEL) for i in range(8)]
    with openai_sdk(one.url) as first, openai_sdk(two.url) as second:
        batch = _run(first, lines)
        wait_until(
            lambda: second.batches.retrieve(batch.id).request_counts.completed >= 2,
            "two lines answered at replica one",
        )
        one.stop()
        done = _until(second, batch.id, "completed")
        assert done.request_counts.completed == 8 and done.request_counts.failed == 0
        output = _lines(second, done.output_file_id)
        assert sorted(output) == [f"r{i}" for i in range(8)]
        # the sums both replicas added to in Redis: each line's usage once, the file's bytes
        used = sum(line["response"]["body"]["usage"]["total_tokens"] for line in output.values())
        assert done.usage.total_tokens == used > 0
        raw = second.files.content(done.output_file_id).content
        assert second.files.retrieve(done.output_file_id).bytes == len(raw)
        sent = one.state.batches.lines_sent + two.state.batches.lines_sent
        assert sent <= 9  # a line in flight at the drain, at most, is sent again
        assert two.state.batches.lines_sent >= 1


def test_on_redis_a_cancel_at_one_replica_stops_the_run_at_the_other(
    gateway_with, redis_server, workers, monkeypatch
):
    monkeypatch.setattr(runner_module, "POLL", 0.1)
    shared = {"redis_url": redis_server.url, "redis_timeout": 2.0, "batch_concurrency": 1}
    one, two = gateway_with(**shared), gateway_with(**shared)
    lines = [_chat(f"h{i}", script(texts=1, hang="after"), model=SCRIPTED_MODEL) for i in range(3)]
    with openai_sdk(one.url) as first, openai_sdk(two.url) as second:
        batch = _run(first, lines)
        wait_until(lambda: workers.scripted.active == 1, "a line in flight at replica one")
        assert second.batches.cancel(batch.id).status == "cancelling"
        done = _until(first, batch.id, "cancelled")
        assert done.request_counts.completed == 0
        wait_until(lambda: workers.scripted.active == 0, "the line to end")
        assert one.state.batches.lines_sent == 1 and two.state.batches.lines_sent == 0
    assert_nothing_left(one, workers)


def test_embeddings_and_responses_batches(gateway):
    embed = [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": DEMO_MODEL, "input": f"text {i}"},
        }
        for i in range(2)
    ]
    respond = [
        {
            "custom_id": "r0",
            "method": "POST",
            "url": "/v1/responses",
            "body": {"model": DEMO_MODEL, "input": "hello there", "max_output_tokens": 4},
        }
    ]
    with openai_sdk(gateway.url) as api:
        embedded = _until(api, _run(api, embed, "/v1/embeddings").id, "completed")
        vectors = _lines(api, embedded.output_file_id)
        assert vectors["e1"]["response"]["body"]["data"][0]["object"] == "embedding"
        answered = _until(api, _run(api, respond, "/v1/responses").id, "completed")
        response = _lines(api, answered.output_file_id)["r0"]["response"]["body"]
        assert response["object"] == "response" and response["status"] == "completed"
        assert answered.usage.output_tokens == response["usage"]["output_tokens"] > 0
        # stored, as any response the Responses API answers with `store` left on
        assert api.responses.retrieve(response["id"]).id == response["id"]


def test_on_redis_a_stalled_store_delays_a_batch_and_loses_no_line(
    gateway_with, redis_server, workers, monkeypatch
):
    """Redis stops answering for a while in the middle of a run: the lines whose answers
    could not be recorded are sent again once it is back, and the batch completes with
    every line once."""
    monkeypatch.setattr(runner_module, "ORPHAN_POLL", 0.2)
    monkeypatch.setattr(runner_module, "POLL", 0.1)
    monkeypatch.setattr(runner_module, "MAX_BACKOFF", 0.2)
    gw = gateway_with(redis_url=redis_server.url, redis_timeout=0.2, batch_concurrency=2)
    lines = [_chat(f"r{i}", script(texts=1, delay=0.1), model=SCRIPTED_MODEL) for i in range(8)]
    with openai_sdk(gw.url) as api:
        batch = _run(api, lines)
        wait_until(
            lambda: api.batches.retrieve(batch.id).request_counts.completed >= 2, "two lines"
        )
        redis_server.stall()
        try:
            before = gw.state.batches.lines_sent
            wait_until(lambda: gw.state.batches.lines_sent >= before + 2, "lines sent meanwhile")
        finally:
            redis_server.resume()
        done = _until(api, batch.id, "completed")
        assert done.request_counts.completed == 8 and done.request_counts.failed == 0
        assert sorted(_lines(api, done.output_file_id)) == [f"r{i}" for i in range(8)]
    assert_nothing_left(gw, workers)


def test_a_rerank_batch(gateway):
    line = {
        "custom_id": "rank",
        "method": "POST",
        "url": "/v1/rerank",
        "body": {"model": DEMO_MODEL, "query": "a cat", "documents": ["a cat", "a dog"]},
    }
    with openai_sdk(gateway.url) as api:
        done = _until(api, _run(api, [line], "/v1/rerank").id, "completed")
        results = _lines(api, done.output_file_id)["rank"]["response"]["body"]["results"]
        assert results[0]["index"] == 0 and results[0]["document"] == {"text": "a cat"}
        assert results[0]["relevance_score"] == pytest.approx(1.0)


def test_a_fault_of_the_gateways_fails_the_batch_rather_than_resuming_it(gateway, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(runner_module, "read_lines", broken)
    with openai_sdk(gateway.url) as api:
        failed = _until(api, _run(api, [_chat("a", "b")]).id, "failed")
        assert [e.code for e in failed.errors.data] == ["server_error"]


def test_answers_past_what_memory_keeps_of_a_team_are_errors_and_deleting_frees_it(
    gateway_with, monkeypatch
):
    """The memory store keeps at most MEMORY_BYTES_PER_TEAM of a team's files, uploads
    and output alike: an answer past it is the line's `output_too_large` error (the
    batch still completes), an upload past it is refused, and deleting makes room."""
    lines = [_chat(f"r{i}", f"say {i}", max_tokens=4) for i in range(6)]
    monkeypatch.setattr(store_module, "MEMORY_BYTES_PER_TEAM", len(_jsonl(lines)) + 1500)
    with openai_sdk(gateway_with().url) as api:
        done = _until(api, _run(api, lines).id, "completed")
        assert done.request_counts.total == 6
        output = _lines(api, done.output_file_id)
        errors = _lines(api, done.error_file_id)
        assert output and errors and len(output) + len(errors) == 6
        assert {e["error"]["code"] for e in errors.values()} == {"output_too_large"}
        assert all(e["response"] is None for e in errors.values())
        with pytest.raises(openai.BadRequestError) as refused:
            api.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
        assert refused.value.body["param"] == "file"
        api.files.delete(done.input_file_id)
        api.files.delete(done.output_file_id)
        assert api.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch").id


def test_every_answer_has_its_request_id_and_an_ended_batchs_cancel_is_not_retried(gateway):
    """The Batch API's routes answer with `x-request-id` (the client's, or a new one), as
    the SDK shows it; cancelling an ended batch is a 409 that says `x-should-retry:
    false`, so the SDK (which retries a 409) asks once."""
    with openai_sdk(gateway.url) as api:
        uploaded = api.files.create(file=("in.jsonl", _jsonl([_chat("a", "hi")])), purpose="batch")
        assert uploaded._request_id
        batch = api.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        assert batch._request_id and batch._request_id != uploaded._request_id
        _until(api, batch.id, "completed")
        raw = api.with_options(max_retries=2).batches.with_raw_response.retrieve(
            batch.id, extra_headers={"x-request-id": "mine-1"}
        )
        assert raw.headers["x-request-id"] == "mine-1"
    sent: list[str] = []
    counting = httpx.Client(event_hooks={"request": [lambda r: sent.append(r.url.path)]})
    with (
        counting,
        openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", http_client=counting) as sdk,
        pytest.raises(openai.ConflictError) as raised,
    ):
        sdk.with_options(max_retries=2).batches.cancel(batch.id)
    assert raised.value.response.headers["x-should-retry"] == "false"
    assert raised.value.request_id
    assert sent == [f"/v1/batches/{batch.id}/cancel"]
