"""Specs: a streamed background response resumed on another replica sharing Redis
(shared_events.py), through the official `openai` SDK, with two real gateways on one
real Redis and the demo and scripted workers: a resume mid-run and after the end, with
the same events and sequence numbers as the replica running it serves; a resume from
before what is kept; an end marker that never reached Redis; a failed, a cancelled and
a drained run's resume; a client leaving a resume; and Redis stalling while a run writes
(the run goes on, other replicas catch up after)."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import Any

import httpx
import openai
import pytest
import redis

from gateway.edge.responses import background as background_module
from gateway.edge.responses import shared_events
from gateway.edge.responses.replay import EventLog
from tests.support.clients import openai_sdk
from tests.support.scripted_worker import SCRIPTED_MODEL, script
from tests.support.servers import Gateway, assert_nothing_left
from tests.support.waiting import HANG_GUARD, wait_until

SLOW_MODEL = "furnace-slow"  # the demo engine, 0.05 s a token


def _words(n: int) -> str:
    return " ".join(f"w{i}" for i in range(n))


@pytest.fixture
def replicas(request, gateway_with, redis_server) -> tuple[Gateway, Gateway]:
    """Two gateways on one Redis, as two replicas behind one Service; their
    `redis_timeout` a generous 2 s, or the test's own (indirect parametrization)."""
    timeout = getattr(request, "param", 2.0)
    settings = {"redis_url": redis_server.url, "redis_timeout": timeout, "keepalive_interval": 1.0}
    return gateway_with(**settings), gateway_with(**settings)


def _shared(gw: Gateway) -> shared_events.SharedEvents:
    route: Any = gw.state.app.hot["/v1/responses"]
    while not hasattr(route, "runs"):  # under the host, key and content-type checks
        route = route.app
    assert route.runs.shared is not None
    return route.runs.shared


def _nothing_left(*gateways: Gateway) -> None:
    """The suite's checks, and no writer, mirror or reader of Redis's copy left."""
    for gw in gateways:
        assert_nothing_left(gw, None)
        wait_until(lambda gw=gw: not gw.state.inflight.detached, "no background task left")
        shared = _shared(gw)
        wait_until(lambda s=shared: s.readers == 0, "no resume reading Redis left")
        assert not shared.mirrors and not shared.pending


def _start(api: openai.OpenAI, model: str, text: str, deltas: int) -> tuple[list[Any], str]:
    """A streamed background response: its events up to the `deltas`-th text delta
    (its client then leaves), and its id."""
    stream = api.responses.create(model=model, input=text, background=True, stream=True)
    seen: list[Any] = []
    for event in stream:
        seen.append(event)
        if sum(e.type == "response.output_text.delta" for e in seen) == deltas:
            break
    stream.close()
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    return seen, seen[0].response.id


def test_a_stream_resumes_on_another_replica_with_the_same_events(replicas):
    one, two = replicas
    with openai_sdk(one.url) as first, openai_sdk(two.url) as second:
        seen, response_id = _start(first, SLOW_MODEL, _words(30), 3)
        last = seen[-1].sequence_number
        assert second.responses.retrieve(response_id).status == "in_progress"  # still going
        rest = list(second.responses.retrieve(response_id, stream=True, starting_after=last))
        assert [e.sequence_number for e in rest] == list(range(last + 1, last + 1 + len(rest)))
        assert rest[-1].type == "response.completed"
        done = rest[-1].response
        deltas = [e.delta for e in [*seen, *rest] if e.type == "response.output_text.delta"]
        assert "".join(deltas) == done.output_text == _words(30)
        assert done.usage.output_tokens == 30
        # the replica that ran it serves the same events from its memory
        mine = list(first.responses.retrieve(response_id, stream=True, starting_after=last))
        assert [e.model_dump() for e in mine] == [e.model_dump() for e in rest]
        # from the start, on the other replica, once it ended
        again = list(second.responses.retrieve(response_id, stream=True))
        assert [e.model_dump() for e in again[: len(seen)]] == [e.model_dump() for e in seen]
        assert [e.model_dump() for e in again[len(seen) :]] == [e.model_dump() for e in rest]
    _nothing_left(one, two)


def test_a_finished_stream_resumes_on_another_replica(replicas, redis_server):
    one, two = replicas
    with redis.Redis.from_url(redis_server.url) as direct:
        direct.script_flush()  # as a restarted Redis: the scripts are loaded again
    with (
        openai_sdk(one.url) as first,
        openai_sdk(two.url) as second,
        httpx.Client(base_url=two.url, timeout=HANG_GUARD) as http,
    ):
        events = list(
            first.responses.create(model=SLOW_MODEL, input=_words(4), background=True, stream=True)
        )
        response_id, end = events[0].response.id, events[-1].sequence_number
        assert events[-1].type == "response.completed"
        rest = list(second.responses.retrieve(response_id, stream=True, starting_after=2))
        assert [e.model_dump() for e in rest] == [e.model_dump() for e in events[3:]]
        everything = list(second.responses.retrieve(response_id, stream=True))
        assert [e.model_dump() for e in everything] == [e.model_dump() for e in events]
        after_end = http.get(
            f"/v1/responses/{response_id}", params={"stream": "true", "starting_after": end}
        )
        assert after_end.status_code == 200 and after_end.text == ""
        # a background response made without `stream` has no events to resume
        plain = first.responses.create(model=SLOW_MODEL, input="a", background=True)
        wait_until(lambda: second.responses.retrieve(plain.id).status == "completed", "it to end")
        refused = http.get(f"/v1/responses/{plain.id}", params={"stream": "true"})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "stream"
        # an unknown id: not found
        missing = http.get("/v1/responses/resp_none", params={"stream": "true"})
        assert missing.status_code == 404
    _nothing_left(one, two)


def test_a_stream_whose_end_never_reached_redis_is_refused_by_name(
    replicas, redis_server, monkeypatch
):
    """As when Redis did not answer until the writer gave up: the response ended, its
    copy has no end marker. A resume with nothing left to send is a 400 naming
    `stream`; one with events left sends them and ends after a quiet interval."""
    monkeypatch.setattr(shared_events, "SETTLE", 0.1)
    one, two = replicas
    with (
        openai_sdk(one.url) as first,
        openai_sdk(two.url) as second,
        redis.Redis.from_url(redis_server.url) as direct,
    ):
        events = list(
            first.responses.create(model=SLOW_MODEL, input=_words(3), background=True, stream=True)
        )
        response_id, end = events[0].response.id, events[-1].sequence_number
        key = _shared(two).key("", response_id)
        wait_until(lambda: direct.xrevrange(key, count=1)[0][1] == {b"end": b"1"}, "its end")
        direct.xdel(key, f"{end + 1}-1")  # the end marker
        with pytest.raises(openai.BadRequestError) as refused:
            second.responses.retrieve(response_id, stream=True, starting_after=end)
        assert refused.value.body["param"] == "stream"
        assert "not all kept" in refused.value.body["message"]
        began = time.monotonic()
        rest = list(second.responses.retrieve(response_id, stream=True, starting_after=end - 2))
        assert [e.model_dump() for e in rest] == [e.model_dump() for e in events[-2:]]
        assert time.monotonic() - began < 10  # a keep-alive interval (1 s here), not more
    _nothing_left(one, two)


def test_a_resume_from_before_what_is_kept_is_refused_on_another_replica(replicas, monkeypatch):
    """With a bound of 2,000 bytes of events, the first are dropped as the answer
    streams (in memory and in Redis alike): a resume from them is a 400 naming
    `starting_after` on either replica, a resume from what is kept reads on."""
    monkeypatch.setattr(background_module, "EventLog", lambda: EventLog(limit=2000))
    one, two = replicas
    with openai_sdk(one.url) as first, openai_sdk(two.url) as second:
        _, response_id = _start(first, SLOW_MODEL, _words(20), 1)
        wait_until(lambda: first.responses.retrieve(response_id).status == "completed", "it to end")
        kept = set()
        for url in (one.url, two.url):
            refused = httpx.get(
                f"{url}/v1/responses/{response_id}",
                params={"stream": "true", "starting_after": "0"},
                timeout=HANG_GUARD,
            )
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == "starting_after"
            kept.add(int(error["message"].split()[3]))  # "The events before N are ..."
        (oldest,) = kept  # the same on both
        tail = list(second.responses.retrieve(response_id, stream=True, starting_after=oldest - 1))
        assert tail[0].sequence_number == oldest and tail[-1].type == "response.completed"
        assert [e.sequence_number for e in tail] == list(range(oldest, oldest + len(tail)))
        mine = list(first.responses.retrieve(response_id, stream=True, starting_after=oldest - 1))
        assert [e.model_dump() for e in mine] == [e.model_dump() for e in tail]
    _nothing_left(one, two)


def test_a_cancelled_runs_resume_on_another_replica_ends(replicas, monkeypatch):
    """A resume on the replica that does not run it follows the run; the cancel (at
    that replica: the runner hears of it by the flag) ends the run and the resume."""
    monkeypatch.setattr(background_module, "POLL", 0.1)
    one, two = replicas
    with openai_sdk(one.url) as first, openai_sdk(two.url) as second:
        seen, response_id = _start(first, SCRIPTED_MODEL, script(texts=2, hang="after"), 1)
        last = seen[-1].sequence_number
        followed: list[Any] = []
        failures: list[BaseException] = []

        def follow() -> None:
            try:
                for event in second.responses.retrieve(response_id, stream=True, starting_after=0):
                    followed.append(event)
            except BaseException as error:  # reported below
                failures.append(error)

        reader = threading.Thread(target=follow)
        reader.start()
        wait_until(lambda: len(followed) >= last, "the resume to catch up")
        assert second.responses.cancel(response_id).status == "cancelled"
        reader.join(HANG_GUARD)
        assert not reader.is_alive() and not failures, failures
        assert [e.sequence_number for e in followed] == list(range(1, 1 + len(followed)))
        assert [e.model_dump() for e in followed[:last]] == [e.model_dump() for e in seen[1:]]
        assert all(e.type != "response.completed" for e in followed)
        # once it ended: a resume on either replica reads to where it was cut, and ends
        for api in (first, second):
            again = list(api.responses.retrieve(response_id, stream=True, starting_after=0))
            assert [e.model_dump() for e in again] == [e.model_dump() for e in followed]
        assert second.responses.retrieve(response_id).status == "cancelled"
    _nothing_left(one, two)


def test_a_client_leaving_a_resume_stops_its_reader(replicas):
    one, two = replicas
    with openai_sdk(one.url) as first, openai_sdk(two.url) as second:
        _, response_id = _start(first, SCRIPTED_MODEL, script(texts=2, hang="after"), 1)
        resumed = second.responses.retrieve(response_id, stream=True, starting_after=0)
        next(iter(resumed))
        assert _shared(two).readers == 1
        resumed.close()  # the client goes away while the resume waits for more
        wait_until(lambda: _shared(two).readers == 0, "the resume's reader to stop")
        assert first.responses.cancel(response_id).status == "cancelled"
    _nothing_left(one, two)


@pytest.mark.parametrize("replicas", [0.5], indirect=True)  # a stall seen in 0.5 s
def test_redis_stalling_while_a_run_writes_neither_stops_nor_slows_it(
    replicas, redis_server, monkeypatch
):
    """Redis stops answering mid-run: the run's own client reads on without a pause
    (its events come from memory; only the copy's writer waits, then tries again), a
    resume on the other replica is a 503 meanwhile, and once Redis is back the copy
    catches up: the other replica serves the whole stream."""
    monkeypatch.setattr(shared_events, "RETRY", 0.2)
    one, two = replicas
    with openai_sdk(one.url) as first, openai_sdk(two.url) as second:
        stream = first.responses.create(
            model=SLOW_MODEL, input=_words(60), background=True, stream=True
        )
        events: list[Any] = []
        arrived: list[float] = []
        stalled_at = resumed_at = 0.0
        for event in stream:
            events.append(event)
            arrived.append(time.monotonic())
            deltas = sum(e.type == "response.output_text.delta" for e in events)
            if deltas == 5 and not stalled_at:
                redis_server.stall()
                stalled_at = time.monotonic()
            elif stalled_at and not resumed_at and time.monotonic() - stalled_at > 1.2:
                refused = httpx.get(
                    f"{two.url}/v1/responses/{events[0].response.id}",
                    params={"stream": "true"},
                    timeout=HANG_GUARD,
                )
                assert refused.status_code == 503, refused.text
                redis_server.resume()
                resumed_at = time.monotonic()
        assert stalled_at and resumed_at, "the stall came mid-run"
        assert events[-1].type == "response.completed"
        during = [
            b - a
            for a, b in itertools.pairwise(arrived)
            if stalled_at <= a and b <= resumed_at - 0.6  # not the 503's own wait
        ]
        assert during and max(during) < 0.3, during  # a token's 0.05 s, not Redis's 0.5
        response_id = events[0].response.id
        wait_until(lambda: not _shared(one).mirrors, "the copy to catch up")
        everything = list(second.responses.retrieve(response_id, stream=True))
        assert [e.model_dump() for e in everything] == [e.model_dump() for e in events]
    _nothing_left(one, two)


def test_a_failed_runs_stream_resumes_on_another_replica_to_its_end(replicas):
    one, two = replicas
    with openai_sdk(one.url) as first, openai_sdk(two.url) as second:
        events = list(
            first.responses.create(
                model=SCRIPTED_MODEL,
                input=script(status="UNAVAILABLE"),
                background=True,
                stream=True,
            )
        )
        assert [e.type for e in events] == ["response.created", "error", "response.failed"]
        response_id = events[0].response.id
        wait_until(lambda: not _shared(one).mirrors, "its end to be written")
        again = list(second.responses.retrieve(response_id, stream=True))
        assert [e.model_dump() for e in again] == [e.model_dump() for e in events]
    _nothing_left(one, two)


def test_a_drain_writes_the_end_of_the_streams_it_cuts(replicas, server_loop):
    """The drain cuts a streamed run: its `response.failed` and end marker reach Redis
    before the drain is over (it waits for the writer too), so the other replica's
    resume reads it to its end."""
    one, two = replicas
    with openai_sdk(one.url) as first, openai_sdk(two.url) as second:
        seen, response_id = _start(first, SCRIPTED_MODEL, script(texts=1, hang="after"), 1)
        drain = asyncio.run_coroutine_threadsafe(one.state.inflight.drain(0.05), server_loop.loop)
        drain.result(HANG_GUARD)
        assert not one.state.inflight.detached and not _shared(one).mirrors
        rest = list(second.responses.retrieve(response_id, stream=True, starting_after=0))
        assert [e.model_dump() for e in rest[: len(seen) - 1]] == [e.model_dump() for e in seen[1:]]
        assert [e.type for e in rest[-2:]] == ["error", "response.failed"]
        assert rest[-1].response.error.code == "gateway_shutdown"
    _nothing_left(one, two)
