"""The request metrics: Prometheus families in the gateway's own registry, filled
once per request from its `RequestRecord` (and the inter-token histogram, as the
record observes its gaps in batches, through the model's `GapHistogram`).

Label values come from the config (model names) and from the error tree
(outcomes, refusal reasons), never from what a client sends, so a client cannot
blow up the series count. The same finiteness lets each label child be looked up
once and kept (`labels()` validates, locks and builds a tuple every call: about
2 µs each, six per request).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gateway.protocol.errors import Outcome
from gateway.telemetry.record import RequestRecord

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


class GapHistogram:
    """A histogram's label child that observes without `observe`'s checks and its walk
    over the buckets in Python: one sample (`observe`: a request's TTFT and e2e
    latency), or a batch (`observe_all`: the inter-token gaps), each sample's bucket
    found by bisection and each bucket's count added once.
    It adds to the child's own values, so the series reads as `observe` fills it;
    prometheus-client has no such call, so this reads the child's `_upper_bounds`,
    `_buckets` and `_sum` (its names through 0.x; test_telemetry checks the result
    against `observe`'s)."""

    __slots__ = ("_bounds", "_buckets", "_sum")

    def __init__(self, child: Histogram) -> None:
        self._bounds = child._upper_bounds  # ascending, +Inf last
        self._buckets = child._buckets  # one count each, not cumulative
        self._sum = child._sum

    def observe(self, sample: float) -> None:
        """Observes `sample` (into the first bucket whose bound is >= it)."""
        self._sum.inc(sample)
        self._buckets[bisect_left(self._bounds, sample)].inc(1)

    def observe_all(self, samples: list[float]) -> None:
        """Observes each of `samples`, as `observe` would."""
        bounds = self._bounds
        found = [bisect_left(bounds, sample) for sample in samples]  # each one's bucket
        self._sum.inc(sum(samples))
        buckets = self._buckets
        for i in set(found):  # the few buckets hit, not every bucket
            buckets[i].inc(found.count(i))


class _ModelSeries:
    """One model's label children of the per-request families. The in-flight gauge is
    kept as its child's value (`_value`, as `GapHistogram` reads its child's), which
    `Gauge.inc` and `dec` would add to after checks that hold for every child."""

    __slots__ = (
        "cached_prompt_tokens",
        "completion_tokens",
        "e2e",
        "inflight",
        "itl",
        "prompt_tokens",
        "ttft",
    )

    def __init__(self, metrics: RequestMetrics, model: str) -> None:
        self.inflight = metrics.inflight.labels(model)._value
        self.ttft = GapHistogram(metrics.ttft.labels(model))
        self.itl = GapHistogram(metrics.itl.labels(model))
        self.e2e = GapHistogram(metrics.e2e.labels(model))
        self.prompt_tokens = metrics.prompt_tokens.labels(model)
        self.cached_prompt_tokens = metrics.cached_prompt_tokens.labels(model)
        self.completion_tokens = metrics.completion_tokens.labels(model)


class RequestMetrics:
    """The per-request metric families, registered in `registry`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        #: Label children already looked up, by model and by (model, outcome, status).
        self._series: dict[str, _ModelSeries] = {}
        self._requests: dict[tuple[str, str, str, int], Any] = {}
        self._routed: dict[tuple[str, str], Any] = {}
        r = registry
        self.requests = Counter(
            f"{PREFIX}_requests",
            "Requests by model, API route, outcome and HTTP status.",
            ["model", "route", "outcome", "status"],
            registry=r,
        )
        self.routed = Counter(
            f"{PREFIX}_routed_requests",
            "Requests served by another model than the one they named: an alias's target, "
            "or a fallback; `asked` is a configured alias or model, never a client's string.",
            ["asked", "model"],
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
        self.background = Gauge(
            f"{PREFIX}_background_responses",
            "Background responses (the Responses API's `background: true`) this process "
            "runs, queued or in progress, by team.",
            ["team"],
            registry=r,
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
        # a share of the prompt tokens: cached / prompt is the engines' prefix-cache hit ratio
        self.cached_prompt_tokens = Counter(
            f"{PREFIX}_cached_prompt_tokens",
            "Of the prompt tokens of answered requests, those the engine found in its prefix "
            "cache (0 where the engine does not say).",
            ["model"],
            registry=r,
        )
        self.completion_tokens = Counter(
            f"{PREFIX}_completion_tokens",
            "Completion tokens sent, streams included.",
            ["model"],
            registry=r,
        )
        # tensor models (KServe v2): the body bytes read and written, per request
        self.tensor_bytes_received = Counter(
            f"{PREFIX}_tensor_bytes_received",
            "Request body bytes read by tensor model (KServe v2 infer).",
            ["model"],
            registry=r,
        )
        self.tensor_bytes_sent = Counter(
            f"{PREFIX}_tensor_bytes_sent",
            "Response body bytes written by tensor model (KServe v2 infer).",
            ["model"],
            registry=r,
        )

        # remote MCP servers a request let the model call (gateway/edge/mcp): `server` is
        # the operator's allowed prefix the server's URL is under, never a client's string
        self.mcp_steps = Counter(
            f"{PREFIX}_mcp_steps",
            "Steps with remote MCP servers (`list`: a server's tools; `call`: a tool call), by "
            "the allowed URL prefix (`mcp_allowed_urls`) and outcome (ok, failed).",
            ["server", "step", "outcome"],
            registry=r,
        )
        self.mcp_step_seconds = Histogram(
            f"{PREFIX}_mcp_step_seconds",
            "How long a step with a remote MCP server took.",
            ["server", "step"],
            buckets=E2E_BUCKETS,
            registry=r,
        )

        # answers that compacted their conversation first (gateway/edge/compacting.py)
        self.compactions = Counter(
            f"{PREFIX}_compactions",
            "Conversations the model summarized before answering (Anthropic's compaction, "
            "the Responses API's), by model and result: summarized, or empty (the model "
            "wrote no summary: the answer went on from the whole prompt). Both turns' tokens "
            "are in the token counters.",
            ["model", "result"],
            registry=r,
        )

        # the Batch API's runs (gateway/edge/batches): `team` is a configured team's name
        self.batch_lines = Counter(
            f"{PREFIX}_batch_lines",
            "Lines of batches (/v1/batches) this process sent, by team and outcome: "
            "completed (a 2xx in the output file), failed (the error file), retried (refused "
            "for later: no free slot, the team's limits), expired (the window passed first), "
            "ended (in flight when a cancel, a drain or the expiry ended it: not recorded).",
            ["team", "outcome"],
            registry=r,
        )
        self.batches_running = Gauge(
            f"{PREFIX}_batches_running",
            "Batches this process runs now, by team.",
            ["team"],
            registry=r,
        )
        self.batches_ended = Counter(
            f"{PREFIX}_batches_ended",
            "Batches this process ended, by team and status (completed, failed, expired, "
            "cancelled).",
            ["team", "status"],
            registry=r,
        )

    def mcp_step(self, server: str, step: str, ok: bool, seconds: float) -> None:
        """One step with a remote MCP server, under the allowed prefix `server`."""
        self.mcp_steps.labels(server, step, "ok" if ok else "failed").inc()
        self.mcp_step_seconds.labels(server, step).observe(seconds)

    def compaction(self, model: str, summarized: bool) -> None:
        """A conversation of `model` compacted: summarized, or not (no summary written)."""
        self.compactions.labels(model, "summarized" if summarized else "empty").inc()

    def tensor_bytes(self, model: str, received: int, sent: int) -> None:
        """One tensor request's bytes in and out (once per request, from the route)."""
        self.tensor_bytes_received.labels(model).inc(received)
        self.tensor_bytes_sent.labels(model).inc(sent)

    def _of(self, model: str) -> _ModelSeries:
        series = self._series.get(model)
        if series is None:
            series = self._series[model] = _ModelSeries(self, model)
        return series

    def begin(self, record: RequestRecord, model: str) -> None:
        """The request has a model and a slot."""
        series = self._of(model)
        record.model = model
        record.itl = series.itl
        series.inflight.inc(1)

    def finish(self, record: RequestRecord, end: float) -> float | None:
        """Records the request's figures; returns its time to first token."""
        model = record.model
        outcome = record.outcome or Outcome.ENGINE_ERROR
        series = self._series.get(model)  # None: never begun, no series of its own
        if record.itl is not None and series is not None:  # begun: it held a slot
            series.inflight.inc(-1)
            record.observe_gaps()
        key = (model, record.route, outcome, record.status)
        requests = self._requests.get(key)
        if requests is None:
            requests = self._requests[key] = self.requests.labels(
                model, record.route, outcome, str(record.status)
            )._value  # its value, as `_ModelSeries.inflight`
        requests.inc(1)
        if record.asked:  # an alias (admission found it configured), or a fallback's model
            routed = self._routed.get((record.asked, model))
            if routed is None:
                routed = self._routed[record.asked, model] = self.routed.labels(record.asked, model)
            routed.inc()
        if outcome is Outcome.REJECTED:
            self.rejections.labels(model, record.reason).inc()
        ttft = None
        if record.first_token_at is not None:
            ttft = record.first_token_at - record.started_at
            series = series or self._of(model)
            series.ttft.observe(ttft)
        if model and record.status == 200:
            series = series or self._of(model)
            series.e2e.observe(end - record.started_at)
            prompt, completion = record.used()
            series.prompt_tokens.inc(prompt)
            if record.cached_tokens:
                series.cached_prompt_tokens.inc(record.cached_tokens)
            series.completion_tokens.inc(completion)
        return ttft
