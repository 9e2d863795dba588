"""Specs: background responses (`background: true` on `/v1/responses`) through the
official `openai` SDK and httpx against the real gateway and its scripted and demo
workers: queued → in_progress → completed polled, a cancel that stops the worker's call
and frees its slot, a client that leaves without stopping the run, the refusals
(without `store`, with `stream`, past the team's bound, a cancel of a finished or a
foreground response), two replicas on one Redis (one reads what the other runs, and a
cancel at one stops the other's run), and a drain that marks what it cuts."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import openai
import pytest

from gateway.config import ModelConfig, QueueConfig
from gateway.edge.responses import background as background_module
from tests.support.clients import openai_sdk
from tests.support.keys import keyed, new_key
from tests.support.metrics import scrape
from tests.support.scripted_worker import SCRIPTED_MODEL, script
from tests.support.servers import DEMO_MODEL, assert_nothing_left
from tests.support.waiting import HANG_GUARD, wait_until


def _until_status(client: openai.OpenAI, response_id: str, *statuses: str):
    found = []

    def reached() -> bool:
        found[:] = [client.responses.retrieve(response_id)]
        return found[0].status in statuses

    wait_until(reached, f"{response_id} to be {' or '.join(statuses)}")
    return found[0]


def _hanging(texts: int = 1) -> str:
    return script(texts=texts, hang="after")


def _background_gauge(url: str, team: str = "") -> float:
    samples = scrape(url)
    return samples.get(("furnace_gateway_background_responses", (("team", team),)), 0.0)


def test_a_background_response_is_queued_then_in_progress_then_completed(gateway_with, workers):
    """One slot, a model with a queue: the second background response waits in the
    queue (`queued`) while the first holds the slot, runs (`in_progress`) once the
    first ends, and completes; GET reads each state."""
    models = (
        ModelConfig(
            SCRIPTED_MODEL, workers=(workers.scripted.address,), queue=QueueConfig(max_wait=30)
        ),
    )
    gw = gateway_with(max_concurrent_requests=1, models=models)
    with openai_sdk(gw.url) as api:
        first = api.responses.create(
            model=SCRIPTED_MODEL, input=script(texts=3, delay=0.3), background=True
        )
        assert first.status == "queued" and first.background is True and first.output == []
        _until_status(api, first.id, "in_progress")
        second = api.responses.create(model=SCRIPTED_MODEL, input=script(texts=2), background=True)
        assert second.status == "queued"
        assert api.responses.retrieve(second.id).status == "queued"  # behind the first
        done = _until_status(api, first.id, "completed")
        assert done.output_text and done.usage.output_tokens == 3
        assert done.created_at == first.created_at and done.background is True
        assert _until_status(api, second.id, "completed").usage.output_tokens == 2
    wait_until(lambda: _background_gauge(gw.url) == 0, "the gauge to fall to 0")
    outcomes = {
        (dict(labels)["route"], dict(labels)["outcome"]): value
        for (name, labels), value in scrape(gw.url).items()
        if name == "furnace_gateway_requests_total"
    }
    assert outcomes == {("/v1/responses", "completed"): 2}  # once each, not twice


def test_the_demo_answers_a_background_response_as_a_foreground_one(gateway):
    with openai_sdk(gateway.url) as api:
        created = api.responses.create(
            model=DEMO_MODEL, input="one two three", background=True, metadata={"k": "v"}
        )
        assert created.status in ("queued", "in_progress", "completed")
        done = _until_status(api, created.id, "completed")
        assert done.output_text == "one two three" and done.metadata == {"k": "v"}
        follow = api.responses.create(model=DEMO_MODEL, input="four", previous_response_id=done.id)
        assert follow.usage.input_tokens == 7  # the background turn (3 + 3 words) and 1
    assert_nothing_left(gateway, None)


def test_cancelling_a_running_one_stops_its_call_and_frees_its_slot(gateway_with, workers):
    gw = gateway_with(max_concurrent_requests=1)
    with openai_sdk(gw.url) as api:
        created = api.responses.create(model=SCRIPTED_MODEL, input=_hanging(), background=True)
        _until_status(api, created.id, "in_progress")
        wait_until(lambda: workers.scripted.active == 1, "the worker to run it")
        cancelled = api.responses.cancel(created.id)
        assert cancelled.status == "cancelled" and cancelled.id == created.id
        # the slot is free when the cancel answers: the next request is served at once
        assert api.responses.create(model=DEMO_MODEL, input="next").output_text == "next"
        assert api.responses.retrieve(created.id).status == "cancelled"
        assert api.responses.cancel(created.id).status == "cancelled"  # again: as it is
        # as OpenAI's own example sends it, with no body and no Content-Type
        bare = httpx.post(f"{gw.url}/v1/responses/{created.id}/cancel", timeout=HANG_GUARD)
        assert bare.status_code == 200 and bare.json()["status"] == "cancelled", bare.text
        typed = httpx.post(
            f"{gw.url}/v1/responses/{created.id}/cancel",
            content=b"x",
            headers={"content-type": "text/plain"},
            timeout=HANG_GUARD,
        )
        assert typed.status_code == 415  # a type that is not JSON is still refused
    assert workers.scripted.cancelled, "the worker's call was cancelled"
    assert_nothing_left(gw, workers)
    assert _background_gauge(gw.url) == 0


def test_deleting_a_running_one_stops_it(gateway_with, workers):
    gw = gateway_with()
    with openai_sdk(gw.url) as api:
        created = api.responses.create(model=SCRIPTED_MODEL, input=_hanging(), background=True)
        _until_status(api, created.id, "in_progress")
        assert api.responses.delete(created.id) is None
        wait_until(lambda: workers.scripted.active == 0, "its call to end")
        with pytest.raises(openai.NotFoundError):
            api.responses.retrieve(created.id)  # its end was not stored again
    assert_nothing_left(gw, workers)
    assert _background_gauge(gw.url) == 0


def test_a_cancel_of_a_finished_foreground_or_unknown_response_is_refused(gateway):
    with openai_sdk(gateway.url) as api:
        done = api.responses.create(model=DEMO_MODEL, input="a b", background=True)
        _until_status(api, done.id, "completed")
        with pytest.raises(openai.BadRequestError) as refused:
            api.responses.cancel(done.id)
        assert refused.value.body["message"] == "Cannot cancel a completed response."
        assert refused.value.body["param"] == "response_id"
        foreground = api.responses.create(model=DEMO_MODEL, input="c")
        with pytest.raises(openai.BadRequestError) as refused:
            api.responses.cancel(foreground.id)
        assert "background" in refused.value.body["message"]
        with pytest.raises(openai.NotFoundError):
            api.responses.cancel("resp_nothing")


def test_a_client_that_goes_away_does_not_stop_it(gateway):
    """The POST's connection closes at once after its answer; the run goes on."""
    body = json.dumps(
        {"model": SCRIPTED_MODEL, "input": script(texts=3, delay=0.2), "background": True}
    ).encode()
    host, port = gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=HANG_GUARD) as raw:
        raw.sendall(
            b"POST /v1/responses HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            b"content-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        head = raw.recv(65536)
    assert b" 200 " in head.split(b"\r\n", 1)[0]
    response_id = json.loads(head.split(b"\r\n\r\n", 1)[1])["id"]
    with openai_sdk(gateway.url) as api:  # gone while it runs
        assert api.responses.retrieve(response_id).status in ("queued", "in_progress")
        done = _until_status(api, response_id, "completed", "failed", "cancelled")
        assert done.status == "completed" and done.usage.output_tokens == 3
    assert_nothing_left(gateway, None)


def test_background_without_store_is_refused_by_name(gateway):
    with httpx.Client(base_url=gateway.url, timeout=HANG_GUARD) as http:
        body = {"model": DEMO_MODEL, "input": "x", "background": True, "store": False}
        refused = http.post("/v1/responses", json=body)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "background"
        typed = http.post(
            "/v1/responses", json={"model": DEMO_MODEL, "input": "x", "background": "yes"}
        )
        assert typed.status_code == 400 and typed.json()["error"]["param"] == "background"
        plain = http.post(
            "/v1/responses", json={"model": DEMO_MODEL, "input": "x", "background": False}
        )
        assert plain.status_code == 200 and plain.json()["background"] is False


def test_a_failure_is_stored_as_failed_with_its_error(gateway):
    with openai_sdk(gateway.url) as api:
        refused = api.responses.create(
            model=SCRIPTED_MODEL, input=script(status="UNAVAILABLE"), background=True
        )
        failed = _until_status(api, refused.id, "failed")
        assert failed.error.code == "engine_unavailable" and failed.error.message
        broken = api.responses.create(
            model=SCRIPTED_MODEL, input=script(texts=1, status="INTERNAL"), background=True
        )
        assert _until_status(api, broken.id, "failed").error.code == "engine_error"
    assert_nothing_left(gateway, None)


def test_a_team_runs_at_most_its_bound_of_background_responses(gateway_with, workers):
    key, other = new_key("alpha"), new_key("beta")
    gw = gateway_with(
        responses_max_background=2,
        **keyed({"alpha": {}, "beta": {}}, {key: "alpha", other: "beta"}),
    )
    with openai_sdk(gw.url, key) as api, openai_sdk(gw.url, other) as beta:
        running = [
            api.responses.create(model=SCRIPTED_MODEL, input=_hanging(), background=True)
            for _ in range(2)
        ]
        with pytest.raises(openai.RateLimitError) as refused:
            api.responses.create(model=SCRIPTED_MODEL, input=_hanging(), background=True)
        assert refused.value.body["code"] == "rate_limit_exceeded"
        # another team's bound is its own
        theirs = beta.responses.create(model=DEMO_MODEL, input="b", background=True)
        assert _until_status(beta, theirs.id, "completed").output_text == "b"
        assert value_of(gw, "alpha") == 2
        for response in running:
            assert api.responses.cancel(response.id).status == "cancelled"
        again = api.responses.create(model=DEMO_MODEL, input="c", background=True)
        assert _until_status(api, again.id, "completed").output_text == "c"
    assert_nothing_left(gw, workers)


def value_of(gw, team: str) -> float:
    return gw.state.telemetry.metrics.background.labels(team)._value.get()


def test_two_replicas_on_one_redis_share_it_and_a_cancel_at_one_stops_the_other(
    gateway_with, redis_server, workers, monkeypatch
):
    monkeypatch.setattr(background_module, "POLL", 0.1)
    one = gateway_with(redis_url=redis_server.url, redis_timeout=2.0)
    two = gateway_with(redis_url=redis_server.url, redis_timeout=2.0)
    with openai_sdk(one.url) as first, openai_sdk(two.url) as second:
        done = first.responses.create(model=DEMO_MODEL, input="shared words", background=True)
        assert _until_status(second, done.id, "completed").output_text == "shared words"
        running = first.responses.create(model=SCRIPTED_MODEL, input=_hanging(), background=True)
        _until_status(second, running.id, "in_progress")
        wait_until(lambda: workers.scripted.active == 1, "the worker to run it")
        assert second.responses.cancel(running.id).status == "cancelled"
        # the replica running it hears of it within its poll, and its call ends
        wait_until(lambda: workers.scripted.active == 0, "the run on the other replica to stop")
        wait_until(lambda: not one.state.inflight.detached, "its task to end")
        assert first.responses.retrieve(running.id).status == "cancelled"
    assert_nothing_left(one, workers)


def _queued_scripted(workers) -> tuple[ModelConfig, ...]:
    queue = QueueConfig(max_wait=30)
    return (ModelConfig(SCRIPTED_MODEL, workers=(workers.scripted.address,), queue=queue),)


def _one_running_one_queued(gw, api: openai.OpenAI) -> tuple[str, str]:
    """Two background responses on a gateway of one slot: the first running, the second
    waiting in the model's queue; their ids."""
    running = api.responses.create(model=SCRIPTED_MODEL, input=_hanging(), background=True)
    _until_status(api, running.id, "in_progress")
    waiting = api.responses.create(model=SCRIPTED_MODEL, input=_hanging(), background=True)
    wait_until(lambda: gw.state.slots.queue.waiting() == 1, "the second to wait")
    return running.id, waiting.id


def test_cancelling_a_queued_one_takes_it_out_of_the_queue(gateway_with, workers):
    gw = gateway_with(max_concurrent_requests=1, models=_queued_scripted(workers))
    with openai_sdk(gw.url) as api:
        running, waiting = _one_running_one_queued(gw, api)
        assert api.responses.cancel(waiting).status == "cancelled"
        assert gw.state.slots.queue.waiting() == 0  # out of the queue when the cancel answers
        assert api.responses.retrieve(running).status == "in_progress"
        assert api.responses.cancel(running).status == "cancelled"
        assert api.responses.retrieve(waiting).status == "cancelled"
    assert_nothing_left(gw, workers)


def test_a_drain_marks_the_background_responses_it_cuts(gateway_with, server_loop, workers):
    """The running one is cut after the drain's grace, the queued one refused: each is
    stored `failed` with the drain's error, before the drain is over."""
    gw = gateway_with(max_concurrent_requests=1, models=_queued_scripted(workers))
    with openai_sdk(gw.url) as api:
        running, waiting = _one_running_one_queued(gw, api)
        drain = asyncio.run_coroutine_threadsafe(gw.state.inflight.drain(0.05), server_loop.loop)
        drain.result(HANG_GUARD)
        assert not gw.state.inflight.detached
        cut = api.responses.retrieve(running)
        assert cut.status == "failed"
        assert cut.error.code == "gateway_shutdown"
        refused = api.responses.retrieve(waiting)
        assert refused.status == "failed" and "shutting down" in refused.error.message
        with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as http:
            refused = http.post(
                "/v1/responses",
                json={"model": SCRIPTED_MODEL, "input": "x", "background": True},
            )
            assert refused.status_code == 503  # a draining gateway starts none
    assert_nothing_left(gw, workers)


def test_a_response_a_dead_replica_left_unfinished_reads_as_failed(
    gateway_with, server_loop, workers, monkeypatch
):
    """A replica killed without its drain never ends its runs: past their deadline,
    readers see them `failed`."""
    gw = gateway_with()
    monkeypatch.setattr(background_module, "LOST_GRACE", -3600.0)  # already past it
    with openai_sdk(gw.url) as api:
        running = api.responses.create(model=SCRIPTED_MODEL, input=_hanging(), background=True)
        lost = api.responses.retrieve(running.id)
        assert lost.status == "failed" and lost.error.code == "server_error"
        assert "stopped before it ended" in lost.error.message
        with pytest.raises(openai.BadRequestError):
            api.responses.cancel(running.id)  # it reads as finished

    async def end_it() -> None:  # this replica is alive: its run still goes
        tasks = list(gw.state.inflight.detached)
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)

    server_loop.call(end_it())
    assert_nothing_left(gw, workers)


def test_a_streamed_background_response_goes_on_without_its_client_and_resumes(gateway):
    """The POST streams the events as they come, `response.created` (queued) first; its
    client leaves after a few, the run goes on, and a GET with `stream` and
    `starting_after` reads the rest, in sequence, to `response.completed`."""
    with openai_sdk(gateway.url) as api:
        stream = api.responses.create(
            model=SCRIPTED_MODEL, input=script(texts=6, delay=0.1), background=True, stream=True
        )
        seen = []
        for event in stream:
            seen.append(event)
            if event.type == "response.output_text.delta":
                break
        stream.close()  # the client goes away mid-answer
        first = seen[0]
        assert first.type == "response.created" and first.sequence_number == 0
        assert first.response.status == "queued" and first.response.background is True
        assert [e.sequence_number for e in seen] == list(range(len(seen)))
        response_id, last = first.response.id, seen[-1].sequence_number
        assert api.responses.retrieve(response_id).status == "in_progress"  # it goes on
        rest = list(api.responses.retrieve(response_id, stream=True, starting_after=last))
        assert [e.sequence_number for e in rest] == list(range(last + 1, last + 1 + len(rest)))
        assert rest[-1].type == "response.completed"
        deltas = [e.delta for e in [*seen, *rest] if e.type == "response.output_text.delta"]
        assert "".join(deltas) == rest[-1].response.output_text
        assert rest[-1].response.usage.output_tokens == 6
        assert rest[-1].response.created_at == first.response.created_at
        # from the start again, after its end: the same events
        again = list(api.responses.retrieve(response_id, stream=True))
        assert [e.sequence_number for e in again] == list(range(len(again)))
        assert again[-1].type == "response.completed"
        assert api.responses.retrieve(response_id).status == "completed"
    assert_nothing_left(gateway, None)


def test_a_streamed_background_failure_ends_its_stream_with_response_failed(gateway):
    with openai_sdk(gateway.url) as api:
        events = list(
            api.responses.create(
                model=SCRIPTED_MODEL,
                input=script(status="UNAVAILABLE"),
                background=True,
                stream=True,
            )
        )
        assert [e.type for e in events] == ["response.created", "error", "response.failed"]
        assert [e.sequence_number for e in events] == [0, 1, 2]
        assert events[-1].response.error.code == "engine_unavailable"


def test_resuming_what_has_no_events_here_is_refused_by_name(gateway):
    with (
        openai_sdk(gateway.url) as api,
        httpx.Client(base_url=gateway.url, timeout=HANG_GUARD) as http,
    ):
        plain = api.responses.create(model=DEMO_MODEL, input="a", background=True)
        _until_status(api, plain.id, "completed")
        refused = http.get(f"/v1/responses/{plain.id}", params={"stream": "true"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream"
        missing = http.get("/v1/responses/resp_none", params={"stream": "true"})
        assert missing.status_code == 404
        streamed = list(
            api.responses.create(model=DEMO_MODEL, input="b", background=True, stream=True)
        )
        response_id = streamed[0].response.id
        for bad in ("-1", "x"):
            refused = http.get(
                f"/v1/responses/{response_id}", params={"stream": "true", "starting_after": bad}
            )
            assert refused.status_code == 400
            assert refused.json()["error"]["param"] == "starting_after"
