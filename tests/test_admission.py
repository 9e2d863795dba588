"""Slots, timeouts, keep-alives and cancellation at the edge, with real clients
and a worker that hangs where a test tells it to."""

import socket
import uuid

import httpx
import pytest

from tests.support.requests import opened, sse_events
from tests.support.scripted_worker import script
from tests.support.waiting import HANG_GUARD, wait_until


def scripted(prompt: str, stream: bool, rid: str | None = None):
    return {
        "json": {"model": "scripted", "prompt": prompt, "stream": stream},
        "headers": {"x-request-id": rid or uuid.uuid4().hex},
    }


def test_one_request_too_many_gets_503_at_once(gateway_with, workers):
    gw = gateway_with(max_concurrent_requests=2)
    hold = {"model": "scripted", "stream": True}
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        chat_body = {
            **hold,
            "messages": [{"role": "user", "content": script(texts=1, hang="after")}],
        }
        with (
            client.stream("POST", "/v1/chat/completions", json=chat_body) as one,
            client.stream(
                "POST", "/v1/completions", json={**hold, "prompt": script(texts=1, hang="after")}
            ) as two,
        ):
            held = opened(one), opened(two)
            assert gw.state.slots.in_use == 2
            for route, body in (
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                ("/v1/completions", {"prompt": "x"}),
                ("/v1/completions", {"prompt": "x", "stream": True}),
            ):
                response = client.post(route, json=body)
                assert response.status_code == 503
                assert response.headers["retry-after"] == "1"
                error = response.json()["error"]
                assert (error["type"], error["code"]) == ("server_error", "server_busy")
            # the models list and probes take no slot
            assert client.get("/v1/models").status_code == 200
            assert gw.state.slots.in_use == 2
            del held
        wait_until(lambda: gw.state.slots.in_use == 0, "slots to come back")
        assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200


def test_slots_come_back_after_errors(gateway_with):
    gw = gateway_with(max_concurrent_requests=1)
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        for status in ("UNAVAILABLE", "INTERNAL", "OUT_OF_RANGE"):
            for prompt in (script(status=status), script(texts=1, status=status)):
                for stream in (False, True):
                    client.post("/v1/completions", **scripted(prompt, stream))
                    assert gw.state.slots.in_use == 0
        client.post("/v1/completions", json={"prompt": "not json at all"})
        client.post(
            "/v1/completions", content=b"{bad", headers={"content-type": "application/json"}
        )
        assert client.post("/v1/completions", json={"prompt": "ok"}).status_code == 200


def test_whole_answer_timeout_is_504_and_cancels_the_worker(gateway_with, workers):
    gw = gateway_with(request_timeout=0.5)
    for prompt in (script(hang="before"), script(texts=1, hang="after")):
        rid = uuid.uuid4().hex
        response = httpx.post(
            gw.url + "/v1/completions", **scripted(prompt, False, rid), timeout=HANG_GUARD
        )
        assert response.status_code == 504
        error = response.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "timeout")
        wait_until(lambda rid=rid: rid in workers.scripted.cancelled, "the worker's cancellation")
        assert 0 < workers.scripted.deadlines[rid] <= 0.51


def test_stream_waits_at_most_request_timeout_for_the_first_event(gateway_with, workers):
    gw = gateway_with(request_timeout=0.5)
    rid = uuid.uuid4().hex
    response = httpx.post(
        gw.url + "/v1/completions", **scripted(script(hang="before"), True, rid), timeout=30
    )
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "timeout"
    wait_until(lambda: rid in workers.scripted.cancelled, "the worker's cancellation")


def test_stream_idle_timeout_is_an_error_payload(gateway_with, workers):
    gw = gateway_with(request_timeout=0.5, stream_timeout=60)
    rid = uuid.uuid4().hex
    response = httpx.post(
        gw.url + "/v1/completions",
        **scripted(script(texts=2, hang="after"), True, rid),
        timeout=HANG_GUARD,
    )
    assert response.status_code == 200
    events = sse_events(response.text)
    assert events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "timeout"
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == "t0 t1 "
    wait_until(lambda: rid in workers.scripted.cancelled, "the worker's cancellation")
    # a stream's gRPC deadline is the stream timeout, not the per-event one
    assert 1 < workers.scripted.deadlines[rid] < 61


def test_keepalives_while_quiet_never_count_as_events(gateway_with):
    gw = gateway_with(request_timeout=1.0, keepalive_interval=0.1)
    slow = script(texts=3, delay=0.3)  # each gap well under the timeout: completes
    response = httpx.post(gw.url + "/v1/completions", **scripted(slow, True), timeout=30)
    assert ": keep-alive" in response.text
    events = sse_events(response.text)
    assert events[-2]["choices"][0]["finish_reason"] == "stop"

    too_slow = script(texts=2, delay=3.0)  # keep-alives flow, yet the event wait times out
    response = httpx.post(gw.url + "/v1/completions", **scripted(too_slow, True), timeout=30)
    assert ": keep-alive" in response.text
    assert sse_events(response.text)[-2]["error"]["code"] == "timeout"


def test_client_leaving_a_stream_cancels_the_worker(client, workers):
    rid = uuid.uuid4().hex
    with client.stream(
        "POST", "/v1/completions", **scripted(script(texts=1, hang="after"), True, rid)
    ) as response:
        opened(response)
    wait_until(lambda: rid in workers.scripted.cancelled, "the worker's cancellation")


def test_client_leaving_a_stream_stops_the_engine(client, workers):
    aborted = workers.slow_engine.aborted
    body = {"model": "furnace-slow", "prompt": "w " * 200, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        opened(response)
    wait_until(lambda: workers.slow_engine.aborted == aborted + 1, "the engine to stop")


@pytest.mark.parametrize("where", ["before", "after"])
def test_client_leaving_a_plain_request_cancels_the_worker(gateway, workers, where):
    rid = uuid.uuid4().hex
    prompt = script(hang="before") if where == "before" else script(texts=1, hang="after")
    body = httpx.Request("POST", "http://x", json={"model": "scripted", "prompt": prompt}).content
    host, port = gateway.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=HANG_GUARD) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            b"content-type: application/json\r\n"
            + f"x-request-id: {rid}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_until(lambda: rid in workers.scripted.calls, "the worker to get the call")
    wait_until(lambda: rid in workers.scripted.cancelled, "the worker's cancellation")
