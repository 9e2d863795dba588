"""The bounded queue: bursts wait instead of being refused, overload is refused
early, priorities and weights order the wait, a client that leaves while queued
leaves the queue, and a drain refuses the queue."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from typing import Any

import httpx
import pytest

from gateway.config import ConfigError, ModelConfig, QueueConfig, parse_config
from gateway.worker.demo import DemoEngine
from tests.support.keys import bearer, keyed, new_key
from tests.support.metrics import scrape, value
from tests.support.requests import opened
from tests.support.scripted_worker import script
from tests.support.servers import make_config
from tests.support.waiting import HANG_GUARD, until, wait_until


def queued(workers, queue: QueueConfig, **overrides: Any) -> dict[str, Any]:
    """`gateway_with` overrides: every model of the test gateway queues with `queue`."""
    config = make_config(workers)
    models = tuple(replace(m, queue=queue) for m in config.models)
    return {"queue": queue, "models": models, **overrides}


def hold_slot(client: httpx.Client, headers: dict[str, str] | None = None):
    """A stream that holds a slot until it is closed."""
    body = {"model": "scripted", "prompt": script(texts=1, hang="after"), "stream": True}
    return client.stream("POST", "/v1/completions", json=body, headers=headers or {})


class Sender:
    """Requests on threads, the order their answers came in, and how long each took."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.done: list[tuple[str, int, str]] = []
        self.took: dict[str, float] = {}
        self.threads: list[threading.Thread] = []
        self.lock = threading.Lock()

    def send(self, name: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        def run() -> None:
            with httpx.Client(timeout=HANG_GUARD) as client:  # its TLS setup is not timed
                start = time.monotonic()
                response = client.post(self.url + "/v1/completions", json=body, headers=headers)
            with self.lock:
                self.took[name] = time.monotonic() - start
                self.done.append((name, response.status_code, response.text))

        thread = threading.Thread(target=run)
        thread.start()
        self.threads.append(thread)

    def join(self) -> list[tuple[str, int, str]]:
        for thread in self.threads:
            thread.join(HANG_GUARD)
        return self.done


def test_a_burst_of_twice_the_slots_waits_and_is_served(gateway_with, workers):
    gw = gateway_with(**queued(workers, QueueConfig(max_wait=30.0), max_concurrent_requests=4))
    sender = Sender(gw.url)
    # 2 s an answer: the 8 overlap even when a loaded machine starts their threads slowly
    body = {"model": "furnace-slow", "prompt": "a b c d e", "max_tokens": 40}
    for i in range(8):
        sender.send(str(i), body)
    done = sender.join()
    assert [status for _, status, _ in done] == [200] * 8
    samples = scrape(gw.url)
    count = value(
        samples, "furnace_gateway_queue_wait_seconds_count", model="furnace-slow", priority="0"
    )
    assert count >= 1  # some waited
    assert (
        value(samples, "furnace_gateway_queue_wait_seconds_sum", model="furnace-slow", priority="0")
        <= 30.0 * count
    )
    immediate = value(
        samples,
        "furnace_gateway_queue_admissions_total",
        model="furnace-slow",
        priority="0",
        how="immediate",
    )
    waited = value(
        samples,
        "furnace_gateway_queue_admissions_total",
        model="furnace-slow",
        priority="0",
        how="queued",
    )
    assert immediate + waited == 8


def test_a_priority_a_client_asks_is_no_metric_label(gateway_with, workers):
    # x-furnace-priority orders the wait; the queue's series are labelled by the team's
    # configured priority only (here no teams: 0), so a client cannot mint series
    gw = gateway_with(**queued(workers, QueueConfig(max_wait=30.0), max_concurrent_requests=2))
    sender = Sender(gw.url)
    body = {"model": "furnace-slow", "prompt": "a b c", "max_tokens": 3}
    for i in range(6):
        sender.send(str(i), body, {"x-furnace-priority": str(100 * i - 250)})
    assert [status for _, status, _ in sender.join()] == [200] * 6
    samples = scrape(gw.url)
    priorities = {
        dict(labels)["priority"]
        for name, labels in samples
        if name.startswith("furnace_gateway_queue_") and "priority" in dict(labels)
    }
    assert priorities == {"0"}
    admitted = sum(
        value(
            samples,
            "furnace_gateway_queue_admissions_total",
            model="furnace-slow",
            priority="0",
            how=how,
        )
        for how in ("immediate", "queued")
    )
    assert admitted == 6


def test_sustained_overload_is_refused_at_once_not_after_max_wait(gateway_with, workers):
    gw = gateway_with(**queued(workers, QueueConfig(max_wait=1.2), max_concurrent_requests=2))
    body = {"model": "furnace-slow", "prompt": "a b c d e f g h i j", "max_tokens": 10}
    for _ in range(2):  # the queue learns how long a slot is held (about 0.5 s)
        assert httpx.post(gw.url + "/v1/completions", json=body, timeout=HANG_GUARD).is_success
    sender = Sender(gw.url)
    for i in range(12):
        sender.send(str(i), body)
    done = sender.join()
    statuses = [status for _, status, _ in done]
    assert 200 in statuses and 503 in statuses
    early = [name for name, _, text in done if "expected wait" in text]
    assert early, done
    # refused at once: each such refusal came well before max_wait, which a request that
    # waited in the queue for its slot would have spent (answers take 0.5 s each)
    assert all(sender.took[name] < 1.2 for name in early), sender.took
    for _, status, text in done:
        if status == 503:
            assert json.loads(text)["error"]["code"] == "server_busy"
    samples = scrape(gw.url)
    refusals = value(
        samples,
        "furnace_gateway_queue_refusals_total",
        model="furnace-slow",
        priority="0",
        reason="queue_wait",
    )
    assert refusals == len(early)


def test_high_priority_is_admitted_before_queued_low_priority(gateway_with, workers):
    batch, product = new_key("batch"), new_key("product")
    teams = {"batch": {"priority": 0}, "product": {"priority": 10}}
    keys = keyed(teams, {batch: "batch", product: "product"})
    gw = gateway_with(
        **queued(workers, QueueConfig(max_wait=30.0), max_concurrent_requests=1, **keys)
    )
    queue = gw.state.admission.queue
    sender = Sender(gw.url)
    body = {"model": "furnace-slow", "prompt": "a b"}  # 0.1 s each: answers in order
    with (
        httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client,
        hold_slot(client, bearer(batch)) as held,
    ):
        held_lines = opened(held)
        # a batch request asks for more than its team's priority: capped at 0
        sender.send("batch", body, {**bearer(batch), "x-furnace-priority": "100"})
        wait_until(lambda: queue.waiting() == 1, "the batch request to queue")
        sender.send("product", body, bearer(product))
        wait_until(lambda: queue.waiting() == 2, "the product request to queue")
        assert dict(queue.depth) == {("furnace-slow", 0): 1, ("furnace-slow", 10): 1}
        del held_lines  # the held stream ends: its slot goes to the head of the queue
    done = sender.join()
    assert [(name, status) for name, status, _ in done] == [("product", 200), ("batch", 200)]


def test_weights_share_the_queue_within_a_priority(gateway_with, workers):
    heavy, light = new_key("heavy"), new_key("light")
    keys = keyed({"heavy": {"weight": 3}, "light": {"weight": 1}}, {heavy: "heavy", light: "light"})
    gw = gateway_with(
        **queued(workers, QueueConfig(max_wait=30.0), max_concurrent_requests=1, **keys)
    )
    queue = gw.state.admission.queue
    sender = Sender(gw.url)
    body = {"model": "furnace-slow", "prompt": "a b"}  # 0.1 s each: answers in order
    with (
        httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client,
        hold_slot(client, bearer(light)) as held,
    ):
        held_lines = opened(held)
        for n in range(8):
            name, key = ("light", light) if n % 2 == 0 else ("heavy", heavy)
            sender.send(name, body, bearer(key))
            wait_until(lambda n=n: queue.waiting() == n + 1, "a waiter")
        del held_lines
    done = sender.join()
    order = [name for name, _, _ in done]
    assert order[:4].count("heavy") == 3, order
    assert sorted(order) == ["heavy"] * 4 + ["light"] * 4


def test_a_client_that_leaves_while_queued_leaves_the_queue(gateway_with, workers):
    gw = gateway_with(
        **queued(workers, QueueConfig(max_wait=30.0, max_depth=1), max_concurrent_requests=1)
    )
    queue = gw.state.admission.queue
    port = int(gw.url.rsplit(":", 1)[1])
    body = json.dumps({"model": "furnace-demo", "prompt": "a"}).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        with hold_slot(client) as held:
            held_lines = opened(held)
            for _ in range(3):
                with socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD) as sock:
                    sock.sendall(request)
                    wait_until(lambda: queue.waiting() == 1, "the request to queue")
                    # the queue is full: one more is refused at once
                    full = client.post(
                        "/v1/completions", json={"model": "furnace-demo", "prompt": "a"}
                    )
                    assert full.status_code == 503
                    assert full.headers["retry-after"] == "1"
                wait_until(lambda: queue.waiting() == 0, "the queue to empty")
            del held_lines
        samples = scrape(gw.url)
        assert (
            value(
                samples,
                "furnace_gateway_queue_refusals_total",
                model="furnace-demo",
                priority="0",
                reason="client_gone",
            )
            == 3
        )
        assert (
            value(
                samples,
                "furnace_gateway_queue_refusals_total",
                model="furnace-demo",
                priority="0",
                reason="queue_full",
            )
            == 3
        )
        assert not any(name == "furnace_gateway_queue_depth" for name, _ in samples)
        assert client.post(
            "/v1/completions", json={"model": "furnace-demo", "prompt": "a"}
        ).is_success


def test_drain_refuses_the_queued_and_serves_the_running(gateway_with, workers, server_loop):
    gw = gateway_with(**queued(workers, QueueConfig(max_wait=30.0), max_concurrent_requests=1))
    queue = gw.state.admission.queue
    sender = Sender(gw.url)
    words = " ".join(["w"] * 40)  # 2 s on the slow worker: time to queue three behind it
    body = {"model": "furnace-slow", "prompt": words, "stream": True}
    with (
        httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client,
        client.stream("POST", "/v1/completions", json=body) as running,
    ):
        lines = opened(running)
        for i in range(3):
            sender.send(f"queued{i}", {"model": "furnace-demo", "prompt": "a"})
            wait_until(lambda i=i: queue.waiting() == i + 1, "a request to queue")
        drain = asyncio.run_coroutine_threadsafe(
            gw.state.inflight.drain(HANG_GUARD), server_loop.loop
        )
        done = sender.join()
        assert [status for _, status, _ in done] == [503] * 3
        assert queue.waiting() == 0
        text = "\n".join(lines)
    drain.result(HANG_GUARD)
    assert text.rstrip().endswith("data: [DONE]") and '"error"' not in text
    samples = scrape(gw.url)
    refused = value(
        samples,
        "furnace_gateway_queue_refusals_total",
        model="furnace-demo",
        priority="0",
        reason="draining",
    )
    assert refused == 3


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"queue": {"max_depth": 3}}, "queue.max_wait: required"),
        ({"queue": {"max_wait": 0}}, "queue.max_wait: must be at least"),
        ({"queue": {"max_wait": 1, "depth": 3}}, "queue.depth: unknown field"),
        ({"teams": {"a": {"priority": 5000}}}, "teams.a.priority: must be at most"),
    ],
)
def test_queue_config_is_checked(raw, message):
    models = [{"name": "m", "workers": ["127.0.0.1:1"]}]
    with pytest.raises(ConfigError, match=message):
        parse_config({"models": models, **raw}, env={})


def test_a_model_overrides_the_queue():
    models = [
        {"name": "a", "workers": ["127.0.0.1:1"]},
        {"name": "b", "workers": ["127.0.0.1:1"], "queue": {"max_wait": 9}},
        {"name": "c", "workers": ["127.0.0.1:1"], "queue": {"max_wait": 2}},
    ]
    config = parse_config({"models": models[:2], "queue": {"max_wait": 1, "max_depth": 7}}, env={})
    assert config.models[0].queue == QueueConfig(max_wait=1.0, max_depth=7)
    assert config.models[1].queue == QueueConfig(max_wait=9.0, max_depth=7)
    alone = parse_config({"models": [models[0], models[2]]}, env={})
    assert alone.queue is None and alone.models[0].queue is None
    assert alone.models[1].queue == QueueConfig(max_wait=2.0)


def test_bench_sends_mixed_priorities_and_reports_each(gateway_with, workers, tmp_path):
    gw = gateway_with(**queued(workers, QueueConfig(max_wait=30.0), max_concurrent_requests=2))
    path = tmp_path / "report.json"
    args = [
        *("--base-url", gw.url, "--model", "furnace-slow", "--json", str(path)),
        *("--request-rate", "inf", "--num-requests", "30", "--priorities", "10:1,0:2"),
        *("--input-len", "4", "--output-len", "4", "--no-progress"),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "bench", *args],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
    )
    assert done.returncode == 0, done.stderr
    assert "By priority" in done.stdout
    report = json.loads(path.read_text())
    assert report["completed"] == 30 and report["failed"] == 0  # all waited, none refused
    high, low = report["by_priority"]["10"], report["by_priority"]["0"]
    assert high["completed"] + low["completed"] == 30
    assert high["completed"] and low["completed"]
    # sent all at once: the high priority is served first, while the low one waits
    assert high["e2e_ms"]["p50"] < low["e2e_ms"]["p50"]


def test_a_model_whose_workers_are_at_their_capacity_is_shed_before_the_slots(
    gateway_with, serve_engines
):
    engine = DemoEngine("capped", max_context=4096, token_delay=0.05, capacity=2)
    (worker,) = serve_engines(engine)
    gw = gateway_with(
        models=(ModelConfig("capped", workers=(worker.address,)),), max_concurrent_requests=64
    )
    pool = gw.state.fleet.models["capped"]
    wait_until(lambda: [w.capacity for w in pool.workers.values()] == [2], "the worker's Describe")
    body = {"model": "capped", "prompt": " ".join(["w"] * 40), "stream": True}
    with (
        httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client,
        client.stream("POST", "/v1/completions", json=body) as one,
        client.stream("POST", "/v1/completions", json=body) as two,
    ):
        held = opened(one), opened(two)
        shed = client.post("/v1/completions", json={"model": "capped", "prompt": "a"})
        assert shed.status_code == 503
        assert shed.headers["retry-after"] == "1"
        assert shed.json()["error"]["code"] == "server_busy"
        assert "as many requests as it says it can" in shed.json()["error"]["message"]
        assert engine.calls == 2  # the worker never saw the third
        samples = scrape(gw.url)
        assert (
            value(
                samples,
                "furnace_gateway_rejections_total",
                model="capped",
                reason="workers_saturated",
            )
            == 1
        )
        del held
    wait_until(lambda: not pool.saturated(), "the worker's calls to end")
    answered = httpx.post(
        gw.url + "/v1/completions", json={"model": "capped", "prompt": "a"}, timeout=HANG_GUARD
    )
    assert answered.status_code == 200


def test_a_low_priority_waiter_past_max_starvation_is_served_next(gateway_with, workers):
    batch, product = new_key("batch"), new_key("product")
    teams = {"batch": {"priority": 0}, "product": {"priority": 10}}
    keys = keyed(teams, {batch: "batch", product: "product"})
    queue_config = QueueConfig(max_wait=30.0, max_starvation=0.2)
    gw = gateway_with(**queued(workers, queue_config, max_concurrent_requests=1, **keys))
    queue = gw.state.admission.queue
    sender = Sender(gw.url)
    body = {"model": "furnace-slow", "prompt": "a b"}
    with (
        httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client,
        hold_slot(client, bearer(batch)) as held,
    ):
        held_lines = opened(held)
        sender.send("batch", body, bearer(batch))
        wait_until(lambda: queue.waiting() == 1, "the batch request to queue")
        time.sleep(0.3)  # at least max_starvation: the batch request has starved
        sender.send("product", body, bearer(product))
        wait_until(lambda: queue.waiting() == 2, "the product request to queue")
        del held_lines
    done = sender.join()
    assert [(name, status) for name, status, _ in done] == [("batch", 200), ("product", 200)]


def test_shedding_counts_what_other_gateways_send_the_worker(gateway_with, serve_engines):
    """Two replicas share a worker of capacity 2: the second sheds from the load the
    worker reports (Describe, refreshed every health interval), not only its own calls."""
    engine = DemoEngine("shared", max_context=4096, token_delay=0.05, capacity=2)
    (worker,) = serve_engines(engine)
    models = (ModelConfig("shared", workers=(worker.address,)),)
    one = gateway_with(models=models)
    two = gateway_with(models=models, health_check_interval=0.05)
    seen = two.state.fleet.models["shared"].workers
    body = {"model": "shared", "prompt": " ".join(["w"] * 40), "stream": True}
    with (
        httpx.Client(base_url=one.url, timeout=HANG_GUARD) as client,
        client.stream("POST", "/v1/completions", json=body) as first,
        client.stream("POST", "/v1/completions", json=body) as second,
    ):
        held = opened(first), opened(second)
        wait_until(
            lambda: [w.reported_load for w in seen.values()] == [2], "the worker's report of 2"
        )
        shed = httpx.post(
            two.url + "/v1/completions", json={"model": "shared", "prompt": "a"}, timeout=HANG_GUARD
        )
        assert shed.status_code == 503
        assert shed.json()["error"]["code"] == "server_busy"
        assert engine.calls == 2  # the worker never saw the third
        snapshot = httpx.get(two.url + "/admin/workers", timeout=HANG_GUARD).json()
        assert snapshot["models"][0]["workers"][0]["reported_load"] == 2
        del held
    wait_until(lambda: [w.reported_load for w in seen.values()] == [0], "the report of 0")
    answered = httpx.post(
        two.url + "/v1/completions", json={"model": "shared", "prompt": "a"}, timeout=HANG_GUARD
    )
    assert answered.status_code == 200


def test_waiters_that_left_leave_nothing_behind():
    # 5,000 waiters whose clients left, behind one slot that never comes back: what
    # they held goes with them (60,000 had stayed: 26 MiB, 0.7 ms a new arrival)
    from gateway.admission.queue import Queue, QueueSettings
    from gateway.admission.slots import Slots

    async def run() -> tuple[int, int]:
        queue = Queue(Slots(1))
        settings = QueueSettings(max_wait=HANG_GUARD, max_depth=100_000, max_starvation=60.0)
        async with queue.hold("m", settings):
            # one waiter stays at the head of the queue, so those behind it that leave
            # are not simply popped off the top
            first = asyncio.create_task(queue.hold("m", settings, priority=1).__aenter__())
            await until(lambda: queue.waiting() == 1, "the first waiter to queue")
            for _ in range(10):
                tasks = [
                    asyncio.create_task(queue.hold("m", settings).__aenter__()) for _ in range(500)
                ]
                await until(lambda: queue.waiting() == 501, "500 more waiters to queue")
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            left = len(queue._heap)
            waiting = queue.waiting()
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
        return left, waiting

    left, waiting = asyncio.run(asyncio.wait_for(run(), HANG_GUARD))
    assert waiting == 1  # the first
    assert left <= 2 * 1 + 16


def test_waits_are_also_counted_as_shares_of_max_wait():
    """With a max_wait past the seconds histogram's top bucket (60 s) a quantile of the
    seconds never gets near it; the shares of max_wait do, whatever it is (the chart's
    queue alert reads them). On a virtual clock: one waits 270 s of 300, one waits it out."""
    from gateway.admission.metrics import QueueCollector
    from gateway.admission.queue import Queue, QueueSettings
    from gateway.admission.slots import Slots
    from gateway.protocol import errors
    from tests.support.virtual_time import run_virtual

    async def run() -> Queue:
        queue = Queue(Slots(1), clock=asyncio.get_running_loop().time)
        settings = QueueSettings(max_wait=300.0, max_depth=10, max_starvation=600.0)

        async def hold(seconds: float) -> None:
            async with queue.hold("m", settings):
                await asyncio.sleep(seconds)

        first = asyncio.create_task(hold(270))
        await asyncio.sleep(0)  # it has the slot
        second = asyncio.create_task(hold(400))  # waits 270 s for it
        await asyncio.sleep(1)
        with pytest.raises(errors.Busy, match="within 300s"):
            await hold(0)  # waits its 300 s out
        await asyncio.gather(first, second)
        return queue

    queue = run_virtual(run())
    buckets = {
        (family.name, sample.labels["le"]): sample.value
        for family in QueueCollector(queue).collect()
        for sample in family.samples
        if sample.name.endswith("_bucket")
    }
    ratio, seconds = "furnace_gateway_queue_wait_ratio", "furnace_gateway_queue_wait_seconds"
    assert [buckets[ratio, le] for le in ("0.8", "0.9", "0.95", "1", "+Inf")] == [0, 1, 1, 2, 2]
    assert [buckets[seconds, le] for le in ("60", "+Inf")] == [0, 2]


def _held_streams(client: httpx.Client, model: str, count: int, headers=None):
    """`count` streamed completions of `model` held open (each its first bytes read)."""
    body = {"model": model, "prompt": " ".join(["w"] * 40), "stream": True}
    streams = [
        client.stream("POST", "/v1/completions", json=body, headers=headers) for _ in range(count)
    ]
    return [opened(stream.__enter__()) for stream in streams], streams


def test_low_priorities_leave_a_share_of_the_workers_capacity_to_the_others(
    gateway_with, serve_engines
):
    """Without a queue, a request of a priority below 0 (a batch line's) is refused at
    once while the model's workers run more than 1 - `low_priority_headroom` of their
    capacity (here 3 of 4), which the others may still take; the team's own priority
    counts as the header does."""
    engine = DemoEngine("capped", max_context=4096, token_delay=0.05, capacity=4)
    (worker,) = serve_engines(engine)
    low_team, key = new_key("low"), new_key("normal")
    keys = keyed({"low": {"priority": -5}, "normal": {}}, {low_team: "low", key: "normal"})
    gw = gateway_with(
        models=(ModelConfig("capped", workers=(worker.address,)),),
        max_concurrent_requests=64,
        admin_port=0,
        **keys,
    )
    pool = gw.state.fleet.models["capped"]
    wait_until(lambda: [w.capacity for w in pool.workers.values()] == [4], "the worker's Describe")
    ask = {"model": "capped", "prompt": "a"}
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        held, streams = _held_streams(client, "capped", 3, bearer(key))
        try:
            for headers in ({**bearer(key), "x-furnace-priority": "-1"}, bearer(low_team)):
                refused = client.post("/v1/completions", json=ask, headers=headers)
                assert refused.status_code == 503, refused.text
                assert refused.headers["retry-after"] == "1"
                assert refused.json()["error"]["code"] == "server_busy"
                assert "keeps 25% of its capacity" in refused.json()["error"]["message"]
            assert engine.calls == 3  # the worker never saw them
            rejections = value(
                scrape(gw.admin_url),
                "furnace_gateway_rejections_total",
                model="capped",
                reason="low_priority_headroom",
            )
            assert rejections == 2
            served = client.post("/v1/completions", json=ask, headers=bearer(key))
            assert served.status_code == 200, served.text
        finally:
            del held
            for stream in streams:
                stream.__exit__(None, None, None)
        wait_until(lambda: pool.busy_share() == 0, "the worker's calls to end")
        low = client.post(
            "/v1/completions", json=ask, headers={**bearer(key), "x-furnace-priority": "-1"}
        )
        assert low.status_code == 200, low.text


@pytest.mark.parametrize("headroom", [0.25, 0.0])
def test_low_priorities_leave_a_share_of_the_slots_to_the_others(gateway_with, workers, headroom):
    gw = gateway_with(max_concurrent_requests=4, low_priority_headroom=headroom)
    ask = {"model": "furnace-slow", "prompt": "a", "max_tokens": 1}
    low = {"x-furnace-priority": "-100"}
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        held, streams = _held_streams(client, "furnace-slow", 3)
        try:
            answer = client.post("/v1/completions", json=ask, headers=low)
            assert answer.status_code == (503 if headroom else 200), answer.text
            assert client.post("/v1/completions", json=ask).status_code == 200
        finally:
            del held
            for stream in streams:
                stream.__exit__(None, None, None)


def test_with_a_queue_low_priorities_wait_below_the_headroom(gateway_with, workers):
    """With a queue, a request of a priority below 0 that finds the last
    `low_priority_headroom` of the slots taken waits (it is not refused), while an
    interactive one takes the free slot at once; the low one is served once the slots
    in use fall below the headroom."""
    gw = gateway_with(**queued(workers, QueueConfig(max_wait=30.0), max_concurrent_requests=4))
    queue = gw.state.admission.queue
    sender = Sender(gw.url)
    ask = {"model": "furnace-slow", "prompt": "a", "max_tokens": 1}
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        held, streams = _held_streams(client, "furnace-slow", 3)
        try:
            sender.send("low", ask, {"x-furnace-priority": "-100"})
            wait_until(lambda: queue.waiting() == 1, "the low request to wait")
            served = client.post("/v1/completions", json=ask)  # the fourth slot, at once
            assert served.status_code == 200, served.text
            assert queue.waiting() == 1 and not sender.done
        finally:
            del held
            for stream in streams:
                stream.__exit__(None, None, None)
    assert [(name, status) for name, status, _ in sender.join()] == [("low", 200)]


def test_a_queue_hands_low_priorities_only_the_slots_below_their_cap():
    from gateway.admission.queue import Queue, QueueSettings
    from gateway.admission.slots import Slots

    async def run() -> list[str]:
        queue = Queue(Slots(4))
        settings = QueueSettings(max_wait=HANG_GUARD, max_depth=10, max_starvation=0.0)
        served: list[str] = []
        release = asyncio.Event()

        async def hold(name: str, priority: int = 0, cap: int | None = None) -> None:
            async with queue.hold("m", settings, priority, cap=cap):
                served.append(name)
                await release.wait()

        held = [asyncio.create_task(hold(f"held{i}")) for i in range(3)]
        await until(lambda: len(served) == 3, "three slots taken")
        low = asyncio.create_task(hold("low", -100, cap=3))
        await until(lambda: queue.waiting() == 1, "the low request to wait")
        await asyncio.sleep(0.01)  # past its max_starvation: starving is no way past its cap
        high = asyncio.create_task(hold("high"))  # the free slot, past the waiting one
        await until(lambda: "high" in served, "the interactive request to be served")
        assert queue.waiting() == 1 and "low" not in served
        release.set()
        await asyncio.gather(*held, low, high)
        return served

    served = asyncio.run(asyncio.wait_for(run(), HANG_GUARD))
    assert served[3:] == ["high", "low"]
