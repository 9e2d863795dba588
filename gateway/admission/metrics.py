"""Admission's figures for `/metrics`: the slots (total and free), whether the
gateway drains, and the queue (depth, waits, admissions and refusals by model
and priority), read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from gateway.admission.queue import Queue, WaitHistogram
from gateway.admission.requests import InFlight
from gateway.telemetry import PREFIX, LiveCollector


class AdmissionCollector(LiveCollector):
    """Slots and draining, read when Prometheus scrapes."""

    def __init__(self, inflight: InFlight) -> None:
        self.inflight = inflight

    def collect(self) -> Iterator[Metric]:
        slots = self.inflight.slots
        family = GaugeMetricFamily(f"{PREFIX}_slots", "Concurrency slots.", labels=["state"])
        family.add_metric(["total"], slots.limit)
        family.add_metric(["free"], slots.limit - slots.in_use)
        yield family
        draining = GaugeMetricFamily(f"{PREFIX}_draining", "1 while the gateway drains.")
        draining.add_metric([], 1 if self.inflight.draining else 0)
        yield draining


class QueueCollector(LiveCollector):
    """The queue's depth, waits, admissions and refusals, by model and priority."""

    def __init__(self, queue: Queue) -> None:
        self.queue = queue

    def collect(self) -> Iterator[Metric]:
        queue = self.queue
        labels = ["model", "priority"]
        depth = GaugeMetricFamily(
            f"{PREFIX}_queue_depth", "Requests waiting for a slot.", labels=labels
        )
        for (model, priority), n in sorted(queue.depth.items()):
            depth.add_metric([model, str(priority)], n)
        yield depth
        yield _histogram(
            f"{PREFIX}_queue_wait_seconds",
            "Seconds requests waited in the queue (served, timed out or gone).",
            queue.waits,
        )
        yield _histogram(
            f"{PREFIX}_queue_wait_ratio",
            "Waits in the queue as shares of its max_wait (1: waited it out).",
            queue.wait_ratios,
        )
        admitted = CounterMetricFamily(
            f"{PREFIX}_queue_admissions",
            "Requests given a slot with a queue configured: at once or after waiting.",
            labels=[*labels, "how"],
        )
        for (model, priority, how), n in sorted(queue.admitted.items()):
            admitted.add_metric([model, str(priority), how], n)
        yield admitted
        refused = CounterMetricFamily(
            f"{PREFIX}_queue_refusals",
            "Requests the queue refused (503), by reason.",
            labels=[*labels, "reason"],
        )
        for (model, priority, reason), n in sorted(queue.refused.items()):
            refused.add_metric([model, str(priority), reason], n)
        yield refused


def _histogram(
    name: str, documentation: str, histograms: dict[tuple[str, int], WaitHistogram]
) -> HistogramMetricFamily:
    """Histograms by (model, priority) as one family."""
    family = HistogramMetricFamily(name, documentation, labels=["model", "priority"])
    for (model, priority), histogram in sorted(histograms.items()):
        buckets, running = [], 0
        for bound, count in zip(histogram.bounds, histogram.counts, strict=True):
            running += count
            buckets.append((f"{bound:g}", running))
        buckets.append(("+Inf", histogram.total))
        family.add_metric([model, str(priority)], buckets, histogram.sum)
    return family
