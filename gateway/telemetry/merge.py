"""Several gateway processes' Prometheus texts as one exposition, each sample
labelled with the process it came from (`process="0"`, ...).

One scrape of the admin listener then sees every process: Prometheus' text
format wants each family once (one HELP and TYPE, its samples together), so the
texts are parsed and regrouped by family rather than concatenated. Summing away
the label (`sum by (model) (...)`) gives the gateway's totals; nothing is summed
here, so a gauge such as a worker's health stays per process.

The cost is a parse of each process's text per scrape (milliseconds), never on
a request's path.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

#: The label that names the process a sample came from.
PROCESS_LABEL = "process"


class _Fixed(Collector):
    """Families collected once, handed to `generate_latest`."""

    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self._families


def merge_expositions(texts: Sequence[str | None]) -> bytes:
    """The processes' expositions (None: that process did not answer) as one, every
    sample with `process="<its index>"`."""
    merged: dict[str, Metric] = {}
    for index, text in enumerate(texts):
        if text is None:
            continue
        process = str(index)
        for family in text_string_to_metric_families(text):
            target = merged.get(family.name)
            if target is None:
                target = Metric(family.name, family.documentation, family.type, family.unit)
                merged[family.name] = target
            for s in family.samples:
                labels = {**s.labels, PROCESS_LABEL: process}
                target.samples.append(Sample(s.name, labels, s.value, s.timestamp, s.exemplar))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(merged.values()))
    return generate_latest(registry)
