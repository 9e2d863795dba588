"""A gateway's /metrics read as samples, and its access-log lines as captured, for the
specs that check what it counts."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.waiting import HANG_GUARD

#: A sample's key: its name and its labels, sorted.
Key = tuple[str, tuple[tuple[str, str], ...]]


def scrape(url: str) -> dict[Key, float]:
    """Every sample of `url`/metrics as {(name, sorted labels): value}."""
    text = httpx.get(url + "/metrics", timeout=HANG_GUARD).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: dict[Key, float], name: str, **labels: str) -> float:
    """One sample's value; 0 when it is absent."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    """The access-log lines captured so far (the spec sets `furnace.access` to INFO)."""
    return [json.loads(r.getMessage()) for r in caplog.records if r.name == "furnace.access"]
