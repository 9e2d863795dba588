"""What the gateway tells operators, one job per module:

    record.py      RequestRecord: the running tally of one request
    metrics.py     the request metrics (Prometheus families, `furnace_gateway_*`)
    access_log.py  one JSON line per request
    summary.py     per-model figures as JSON, read back from the registry
    tracing.py     OpenTelemetry spans, imported only when `tracing` is on
    merge.py       several processes' scrapes as one, each sample labelled `process`

`Telemetry` ties the registry, the request metrics and the access log
together. Layers above add their own collectors to the registry (the fleet's
workers, admission's slots, teams), read at scrape time from the live objects;
telemetry imports none of them.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from gateway.telemetry.access_log import AccessLog
from gateway.telemetry.metrics import PREFIX, RequestMetrics
from gateway.telemetry.record import RequestRecord

__all__ = ["PREFIX", "LiveCollector", "RequestRecord", "Telemetry"]


class LiveCollector(Collector):
    """A collector that reads live objects when Prometheus scrapes: it describes
    nothing up front, so registering it costs no collection."""

    def describe(self) -> list[Metric]:
        return []


class Telemetry:
    """The gateway's registry, request metrics and access log."""

    def __init__(self, log_prompts: bool = False) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.metrics = RequestMetrics(self.registry)
        self.access_log = AccessLog(log_prompts)
        self.log_prompts = log_prompts

    def begin(self, record: RequestRecord, model: str) -> None:
        """The request has a model and a slot."""
        self.metrics.begin(record, model)

    def finish(self, record: RequestRecord) -> None:
        """Records the request's figures and writes its log line."""
        end = time.perf_counter()
        ttft = self.metrics.finish(record, end)
        self.access_log.write(record, end, ttft)
