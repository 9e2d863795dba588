"""/metrics and the access log after real requests of every outcome, read with
prometheus-client's own parser."""

import json
import logging
from collections import Counter

import httpx
from prometheus_client import CollectorRegistry, Histogram

from gateway.telemetry.metrics import ITL_BUCKETS, GapHistogram
from gateway.telemetry.record import ITL_BATCH
from tests.support.metrics import scrape, value
from tests.support.scripted_worker import script
from tests.support.waiting import HANG_GUARD, wait_until


def access_lines(caplog) -> list[dict]:
    """The access-log lines logged so far, as JSON."""
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "furnace.access"]


def test_every_outcome_is_counted_and_logged(gateway_with, workers, caplog):
    caplog.set_level(logging.INFO, logger="furnace.access")
    gw = gateway_with(max_concurrent_requests=2, request_timeout=0.5)
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        # completed: 2 plain, 1 streamed (3 + 3 + 2 completion tokens)
        client.post("/v1/completions", json={"prompt": "a b c"})
        client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x y z"}]}
        )
        client.post("/v1/completions", json={"prompt": "a b", "stream": True})
        # invalid
        client.post("/v1/completions", json={"prompt": "x", "temperature": 9})
        client.post("/v1/completions", json={"prompt": "w " * 70})  # context too long
        # engine error and timeout, on the scripted worker
        client.post(
            "/v1/completions", json={"model": "scripted", "prompt": script(status="INTERNAL")}
        )
        client.post("/v1/completions", json={"model": "scripted", "prompt": script(hang="before")})
        # rejected: both slots held by streams, a third request
        hold = {"model": "scripted", "prompt": script(texts=1, hang="after"), "stream": True}
        with (
            client.stream("POST", "/v1/completions", json=hold) as one,
            client.stream("POST", "/v1/completions", json=hold) as two,
        ):
            held = [one.iter_lines(), two.iter_lines()]
            for lines in held:
                next(lines)
            assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 503
            samples = scrape(gw.url)
            assert value(samples, "furnace_gateway_slots", state="free") == 0
            assert value(samples, "furnace_gateway_inflight_requests", model="scripted") == 2
            del held  # the clients of both streams go away
    wait_until(lambda: gw.state.slots.in_use == 0, "slots to be free")

    samples = scrape(gw.url)
    counted: Counter[tuple[str, str, str]] = Counter()
    routes: set[str] = set()
    for (name, label_items), v in samples.items():
        if name == "furnace_gateway_requests_total":
            labels = dict(label_items)
            counted[labels["model"], labels["outcome"], labels["status"]] += int(v)
            routes.add(labels["route"])
    # each request is counted under the API route it came by
    assert routes <= {"/v1/chat/completions", "/v1/completions"} and routes
    assert counted == {
        ("furnace-demo", "completed", "200"): 3,
        ("furnace-demo", "invalid", "400"): 2,  # the model is resolved before the parameters
        ("scripted", "engine_error", "500"): 1,
        ("scripted", "timeout", "504"): 1,
        ("furnace-demo", "rejected", "503"): 1,
        ("scripted", "client_gone", "200"): 2,
    }
    assert (
        value(
            samples, "furnace_gateway_rejections_total", model="furnace-demo", reason="slots_full"
        )
        == 1
    )
    assert value(samples, "furnace_gateway_prompt_tokens_total", model="furnace-demo") == 8
    assert value(samples, "furnace_gateway_completion_tokens_total", model="furnace-demo") == 8
    # the streams whose clients left count the token each wrote, as their teams' ledger does
    assert value(samples, "furnace_gateway_completion_tokens_total", model="scripted") == 2
    assert (
        value(samples, "furnace_gateway_time_to_first_token_seconds_count", model="furnace-demo")
        == 3
    )
    assert (
        value(samples, "furnace_gateway_e2e_request_latency_seconds_count", model="furnace-demo")
        == 3
    )
    assert value(samples, "furnace_gateway_inflight_requests", model="scripted") == 0
    assert value(samples, "furnace_gateway_slots", state="total") == 2
    assert value(samples, "furnace_gateway_slots", state="free") == 2
    demo_worker = workers.demo.address
    assert (
        value(
            samples,
            "furnace_gateway_worker_inflight_requests",
            model="furnace-demo",
            worker=demo_worker,
        )
        == 0
    )
    assert (
        value(
            samples,
            "furnace_gateway_worker_healthy",
            model="furnace-demo",
            worker=demo_worker,
            state="healthy",
        )
        == 1
    )
    assert (
        "furnace_gateway_worker_ejections_total",
        (("model", "furnace-demo"), ("worker", demo_worker)),
    ) in samples
    assert ("furnace_gateway_retries_total", (("model", "furnace-demo"),)) in samples

    # a line is written once its request is over, which may be just after its answer
    wait_until(lambda: len(access_lines(caplog)) >= 10, "every request's line")
    lines = access_lines(caplog)
    assert len(lines) == 10
    streamed = next(line for line in lines if line["stream"] and line["outcome"] == "completed")
    assert streamed["model"] == "furnace-demo"
    assert streamed["worker"] == demo_worker
    assert streamed["status"] == 200
    assert streamed["prompt_tokens"] == 2 and streamed["completion_tokens"] == 2
    assert streamed["ttft_ms"] > 0 and streamed["duration_ms"] >= streamed["ttft_ms"]
    assert len(streamed["request_id"]) == 32
    gone = [line for line in lines if line["outcome"] == "client_gone"]
    assert [line["completion_tokens"] for line in gone] == [1, 1]
    assert all("prompt" not in line for line in lines)  # prompts stay out by default
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "a b c" not in text and "x y z" not in text


def test_prompt_logging_when_turned_on(gateway_with, caplog):
    caplog.set_level(logging.INFO, logger="furnace.access")
    gw = gateway_with(log_prompts=True)
    httpx.post(gw.url + "/v1/completions", json={"prompt": "secret words"}, timeout=HANG_GUARD)
    wait_until(lambda: len(access_lines(caplog)) >= 1, "the request's line")
    lines = access_lines(caplog)
    assert lines[-1]["prompt"] == "secret words"
    assert "completion" not in lines[-1]
    # a chat's messages, their inline media cut to their start and size (the demo refuses
    # images and sounds; its request's line still holds the prompt)
    picture = "data:image/png;base64," + "A" * 4000
    url = "https://example.com/cat.png"
    parts = [
        {"type": "text", "text": "look"},
        {"type": "image_url", "image_url": {"url": picture}},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "input_audio", "input_audio": {"data": "UklG" * 1000, "format": "wav"}},
    ]
    chat = {"messages": [{"role": "user", "content": parts}]}
    httpx.post(gw.url + "/v1/chat/completions", json=chat, timeout=HANG_GUARD)
    wait_until(lambda: len(access_lines(caplog)) >= 2, "the chat's line")
    (message,) = access_lines(caplog)[-1]["prompt"]
    cut = picture[:48] + "... (4022 characters)"
    assert message["content"] == "look" and message["images"] == [cut, url]
    assert [part["url"] for part in message["parts"]] == ["", cut, url, ""]
    assert message["parts"][1]["type"] == "image_url"
    assert message["parts"][3]["data"] == "UklG" * 12 + "... (4000 characters)"
    assert message["parts"][3]["format"] == "wav"


def test_json_view(client):
    client.post("/v1/completions", json={"prompt": "a b"})
    body = client.get("/metrics/json").json()
    demo = body["models"]["furnace-demo"]
    assert demo["requests"]["completed"] >= 1
    assert demo["completion_tokens"] >= 2
    assert demo["e2e_request_latency_mean_ms"] > 0
    assert body["slots"]["total"] == 256


def test_inter_token_gaps_reach_the_histogram_as_a_long_answer_goes_and_all_by_its_end(
    gateway_with,
):
    gw = gateway_with()
    count = "furnace_gateway_inter_token_latency_seconds_count"
    texts = ITL_BATCH + 16
    expected = "".join(f"t{i} " for i in range(texts))
    # every text, 10 ms apart, then the answer stays open
    prompt = script(texts=texts, delay=0.01, hang="after")
    body = {"model": "scripted", "prompt": prompt, "stream": True}
    with (
        httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client,
        client.stream("POST", "/v1/completions", json=body) as answer,
    ):
        written, chunks = "", 0
        lines = answer.iter_lines()
        while written != expected:
            line = next(lines)
            if line.startswith("data: {"):
                text = json.loads(line[6:])["choices"][0]["text"]
                written += text
                chunks += bool(text)
        gaps = chunks - 1  # one a write after the first, each its time per token
        # observed in batches while the answer goes on
        assert value(scrape(gw.url), count, model="scripted") == gaps - gaps % ITL_BATCH
    wait_until(lambda: gw.state.slots.in_use == 0, "the stream to end")
    samples = scrape(gw.url)
    assert value(samples, count, model="scripted") == gaps  # the rest at its end
    bucket = "furnace_gateway_inter_token_latency_seconds_bucket"
    assert value(samples, bucket, model="scripted", le="+Inf") == gaps
    assert value(samples, "furnace_gateway_inter_token_latency_seconds_sum", model="scripted") > 0


def test_a_batch_of_gaps_fills_the_histogram_as_one_observation_each_would():
    samples = [0.0, 0.001, 0.0011, 0.0025, 0.004, 0.04, 0.7, 10, 11, 3600] * 3
    registry = CollectorRegistry()
    family = Histogram("gaps", "Gaps.", ["way"], buckets=ITL_BUCKETS, registry=registry)
    for sample in samples:
        family.labels("one").observe(sample)
    GapHistogram(family.labels("batch")).observe_all(samples)
    (metric,) = registry.collect()
    by_way: dict[str, list[tuple[str, tuple, float]]] = {"one": [], "batch": []}
    for sample in metric.samples:
        if not sample.name.endswith("_created"):
            rest = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "way"))
            by_way[sample.labels["way"]].append((sample.name, rest, sample.value))
    assert by_way["batch"] == by_way["one"]
    assert len(by_way["one"]) == len(ITL_BUCKETS) + 3  # the buckets, +Inf, count and sum
