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

from tests.support.clients import openai_sdk
from tests.support.scripted_worker import SCRIPTED_MODEL, script
from tests.support.servers import DEMO_MODEL
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
        assert [b.id for b in api.batches.list()][0] == batch.id
        files = {f.id: f for f in api.files.list()}
        assert files[done.output_file_id].purpose == "batch_output"
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
    # a form is taken only from a request that carries a key (a page cannot send one)
    response = httpx.post(gateway.url + "/v1/files", files={"file": b"x"}, data={"purpose": "batch"})
    assert response.status_code == 415


def test_a_cancel_ends_the_lines_in_flight_and_sends_no_more(gateway_with, workers):
    gw = gateway_with(max_concurrent_requests=64, batch_concurrency=2)
    from gateway.config import ModelConfig

    lines = [
        _chat(f"r{i}", script(texts=1, hang="after"), model=SCRIPTED_MODEL) for i in range(6)
    ]
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
        assert done.output_file_id is None
    assert len(workers.scripted.cancelled) >= 2
