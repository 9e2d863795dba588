"""What each request tells operators: Prometheus metrics and one JSON access-log
line, from a `RequestRecord` the edge fills in as the answer goes out.

Per token the cost is at most one histogram observation (inter-token latency,
once per written batch, on a label child looked up once per request); the rest
is recorded once per request. Fleet figures (slots, retries, each worker's
load, health and ejections) are read from the live objects at scrape time.
Label values come from the config (model names, worker addresses), never from
what a client sends, so a client cannot blow up the series count.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.types import Event, Finished, Started, Text

if TYPE_CHECKING:
    from gateway.state import GatewayState

access_log = logging.getLogger("furnace.access")

PREFIX = "furnace_gateway"
# From a millisecond to minutes: a cached short prompt to a long queue.
TTFT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, 300, 600, 1800, 3600)

#: Outcomes of a request, the `outcome` label.
OUTCOMES = ("completed", "client_gone", "timeout", "engine_error", "rejected", "invalid")


def outcome_of(status: int, code: str | None) -> str:
    """The outcome an error response stands for."""
    if code in ("server_busy", "draining", "rate_limit_exceeded"):
        return "rejected"
    if status == 504:
        return "timeout"
    if status < 500:
        return "invalid"
    return "engine_error"


class RequestRecord:
    """One request as it goes: filled by the edge, read once at the end."""

    __slots__ = (
        "completion_tokens",
        "finished",
        "first_token_at",
        "itl",
        "last_token_at",
        "model",
        "outcome",
        "prompt",
        "prompt_tokens",
        "reason",
        "request_id",
        "started_at",
        "status",
        "stream",
        "tokens_sent",
        "worker",
    )

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.started_at = time.perf_counter()
        self.model = ""
        self.stream = False
        self.worker = ""
        self.status = 0
        self.outcome = ""
        self.reason = ""
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.tokens_sent = 0  # completion tokens written so far (a team's limits read it)
        self.first_token_at: float | None = None
        self.last_token_at = 0.0
        self.finished: Finished | None = None
        self.prompt: Any = None
        self.itl: Any = None  # the model's inter-token-latency histogram child

    def take(self, batch: list[Event]) -> str:
        """Records a batch of events as it is written; returns its text, joined."""
        pieces = []
        tokens = 0
        for event in batch:
            kind = type(event)
            if kind is Text:
                pieces.append(event.text)
                tokens += event.tokens
            elif kind is Started:
                self.prompt_tokens = event.prompt_tokens
            elif kind is Finished:
                self.finished = event
                self.completion_tokens = event.completion_tokens
                if event.prompt_tokens is not None:
                    self.prompt_tokens = event.prompt_tokens
        if tokens:
            self.tokens_sent += tokens
            now = time.perf_counter()
            if self.first_token_at is None:
                self.first_token_at = now
            elif self.itl is not None:
                self.itl.observe((now - self.last_token_at) / tokens)
            self.last_token_at = now
        return "".join(pieces)


class Telemetry:
    """The gateway's metric families, in a registry of its own, and the access log."""

    def __init__(self, state: GatewayState) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Requests by model, outcome and HTTP status.",
            ["model", "outcome", "status"],
            registry=r,
        )
        self.rejections = Counter(
            f"{PREFIX}_rejections",
            "Requests refused before reaching a worker, by reason.",
            ["model", "reason"],
            registry=r,
        )
        self.inflight = Gauge(
            f"{PREFIX}_inflight_requests", "Requests being served.", ["model"], registry=r
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "From arrival to the first token written.",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Time between tokens written, per token.",
            ["model"],
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "From arrival to the last byte.",
            ["model"],
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of answered requests.", ["model"], registry=r
        )
        self.completion_tokens = Counter(
            f"{PREFIX}_completion_tokens",
            "Completion tokens sent, streams included.",
            ["model"],
            registry=r,
        )
        r.register(_FleetCollector(state))
        self.log_prompts = state.config.log_prompts

    def begin(self, record: RequestRecord, model: str) -> None:
        """The request has a model and a slot."""
        record.model = model
        record.itl = self.itl.labels(model)
        self.inflight.labels(model).inc()

    def finish(self, record: RequestRecord) -> None:
        """Records the request's figures and writes its log line."""
        model = record.model
        end = time.perf_counter()
        if record.itl is not None:  # begun: it held a slot
            self.inflight.labels(model).dec()
        self.requests.labels(model, record.outcome, str(record.status)).inc()
        if record.outcome == "rejected":
            self.rejections.labels(model, record.reason).inc()
        ttft = None
        if record.first_token_at is not None:
            ttft = record.first_token_at - record.started_at
            self.ttft.labels(model).observe(ttft)
        if model and record.status == 200:
            self.e2e.labels(model).observe(end - record.started_at)
            self.prompt_tokens.labels(model).inc(record.prompt_tokens)
            self.completion_tokens.labels(model).inc(record.completion_tokens)
        line: dict[str, Any] = {
            "request_id": record.request_id,
            "model": model,
            "worker": record.worker,
            "stream": record.stream,
            "status": record.status,
            "outcome": record.outcome,
            "ttft_ms": None if ttft is None else round(ttft * 1000, 3),
            "prompt_tokens": record.prompt_tokens,
            "completion_tokens": record.completion_tokens,
            "duration_ms": round((end - record.started_at) * 1000, 3),
        }
        if self.log_prompts and record.prompt is not None:
            line["prompt"] = record.prompt
        access_log.info(orjson.dumps(line).decode())


class _FleetCollector:
    """Slots, retries and per-worker figures, read when Prometheus scrapes."""

    def __init__(self, state: GatewayState) -> None:
        self.state = state

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        state = self.state
        slots = GaugeMetricFamily(f"{PREFIX}_slots", "Concurrency slots.", labels=["state"])
        slots.add_metric(["total"], state.slots.limit)
        slots.add_metric(["free"], state.slots.limit - state.slots.in_use)
        yield slots
        draining = GaugeMetricFamily(f"{PREFIX}_draining", "1 while the gateway drains.")
        draining.add_metric([], 1 if state.draining else 0)
        yield draining
        if state.fleet is None:
            return
        retries = CounterMetricFamily(
            f"{PREFIX}_retries", "Tries on another worker before the first event.", labels=["model"]
        )
        inflight = GaugeMetricFamily(
            f"{PREFIX}_worker_inflight_requests",
            "Calls in flight per worker.",
            labels=["model", "worker"],
        )
        healthy = GaugeMetricFamily(
            f"{PREFIX}_worker_healthy",
            "1 when the worker takes new requests.",
            labels=["model", "worker", "state"],
        )
        ejections = CounterMetricFamily(
            f"{PREFIX}_worker_ejections",
            "Passive ejections per worker.",
            labels=["model", "worker"],
        )
        now = time.monotonic()
        for pool in state.fleet.models.values():
            retries.add_metric([pool.name], pool.retries_total)
            for worker in pool.workers.values():
                labels = [pool.name, worker.address]
                inflight.add_metric(labels, worker.outstanding)
                healthy.add_metric([*labels, worker.state], 1 if worker.available(now) else 0)
                ejections.add_metric(labels, worker.ejections_total)
        yield from (retries, inflight, healthy, ejections)


def model_summary(telemetry: Telemetry) -> dict[str, dict[str, Any]]:
    """Per-model figures as JSON: counts by outcome, tokens, and mean latencies."""
    models: dict[str, dict[str, Any]] = {}

    def entry(model: str) -> dict[str, Any]:
        return models.setdefault(
            model, {"requests": {}, "prompt_tokens": 0, "completion_tokens": 0}
        )

    for metric in telemetry.registry.collect():
        for sample in metric.samples:
            model = sample.labels.get("model")
            if model is None or not model:
                continue
            name = sample.name
            if name == f"{PREFIX}_requests_total":
                outcomes = entry(model)["requests"]
                outcome = sample.labels["outcome"]
                outcomes[outcome] = outcomes.get(outcome, 0) + int(sample.value)
            elif name in (f"{PREFIX}_prompt_tokens_total", f"{PREFIX}_completion_tokens_total"):
                entry(model)[name.removeprefix(f"{PREFIX}_").removesuffix("_total")] = int(
                    sample.value
                )
            elif name == f"{PREFIX}_inflight_requests":
                entry(model)["inflight"] = int(sample.value)
            elif name.endswith(("_seconds_sum", "_seconds_count")):
                base, _, part = name.removeprefix(f"{PREFIX}_").rpartition("_")
                entry(model).setdefault(base, {})[part] = sample.value
    for figures in models.values():
        for key, value in list(figures.items()):
            if isinstance(value, dict) and "count" in value:
                count = value["count"]
                figures[key.removesuffix("_seconds") + "_mean_ms"] = (
                    round(value["sum"] / count * 1000, 3) if count else None
                )
                del figures[key]
    return models
