"""The fleet's figures for `/metrics`: retries per model, and each worker's
calls in flight, health and ejections, read from the live pools at scrape time
(nothing is counted twice on the request path)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.telemetry import PREFIX, LiveCollector

if TYPE_CHECKING:
    from gateway.fleet import Fleet


class FleetCollector(LiveCollector):
    """Retries and per-worker figures, read when Prometheus scrapes."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Metric]:
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
        for pool in self.fleet.models.values():
            retries.add_metric([pool.name], pool.retries_total)
            for worker in pool.workers.values():
                labels = [pool.name, worker.address]
                inflight.add_metric(labels, worker.outstanding)
                healthy.add_metric([*labels, worker.state], 1 if worker.available(now) else 0)
                ejections.add_metric(labels, worker.ejections_total)
        yield from (retries, inflight, healthy, ejections)
