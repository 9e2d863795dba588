"""Admission's figures for `/metrics`: the slots (total and free) and whether
the gateway drains, read at scrape time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric

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
