"""Per-model figures as JSON (`/metrics/json`), read back from the registry so
they can never disagree with `/metrics`."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from gateway.telemetry.metrics import PREFIX

#: The token counters' samples, each a figure of its own (`prompt_tokens`...).
_TOKENS = frozenset(
    f"{PREFIX}_{name}_total"
    for name in ("prompt_tokens", "cached_prompt_tokens", "completion_tokens")
)


def model_summary(registry: CollectorRegistry) -> dict[str, dict[str, Any]]:
    """Per-model figures as JSON: counts by outcome, tokens, and mean latencies."""
    models: dict[str, dict[str, Any]] = {}

    def entry(model: str) -> dict[str, Any]:
        return models.setdefault(
            model,
            {"requests": {}, "prompt_tokens": 0, "cached_prompt_tokens": 0, "completion_tokens": 0},
        )

    for metric in registry.collect():
        for sample in metric.samples:
            model = sample.labels.get("model")
            if model is None or not model:
                continue
            name = sample.name
            if name == f"{PREFIX}_requests_total":
                outcomes = entry(model)["requests"]
                outcome = sample.labels["outcome"]
                outcomes[outcome] = outcomes.get(outcome, 0) + int(sample.value)
            elif name in _TOKENS:
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
