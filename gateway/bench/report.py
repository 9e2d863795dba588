"""A run's summary for people (text, in the shape of vLLM's) and for machines
(JSON with the settings that produced it)."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson

from gateway.bench.stats import Distribution, Summary

WIDTH = 50
LATENCIES = (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_ms"))


def _line(label: str, value: object) -> str:
    return f"{label + ':':<34}{value}"


def _latency_table(summary: Summary) -> list[str]:
    lines = [f"{'(ms)':<8}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}"]
    for label, name in LATENCIES:
        dist: Distribution | None = getattr(summary, name)
        if dist is None:
            lines.append(f"{label:<8}{'n/a':>10}")
        else:
            cells = (dist.mean, dist.p50, dist.p90, dist.p99)
            lines.append(f"{label:<8}" + "".join(f"{v:>10.2f}" for v in cells))
    return lines


def _ms(dist: Distribution | None, q: str) -> str:
    return "n/a" if dist is None else f"{getattr(dist, q):.0f}"


def _priority_table(by_priority: dict[int, Summary]) -> list[str]:
    lines = [
        " By priority ".center(WIDTH, "-"),
        f"{'prio':<6}{'ok':>6}{'failed':>7}{'TTFT p50':>10}{'p99':>7}{'E2E p50':>9}{'p99':>7}",
    ]
    for level, s in by_priority.items():
        lines.append(
            f"{level:<6}{s.completed:>6}{s.failed:>7}{_ms(s.ttft_ms, 'p50'):>10}"
            f"{_ms(s.ttft_ms, 'p99'):>7}{_ms(s.e2e_ms, 'p50'):>9}{_ms(s.e2e_ms, 'p99'):>7}"
        )
    return lines


def render(
    summary: Summary, settings: dict[str, Any], by_priority: dict[int, Summary] | None = None
) -> str:
    """The report as text (latencies by priority in ms, when the run mixed them)."""
    s = summary
    target = f"{settings['base_url']} {settings['endpoint']} model {settings['model']}"
    lines = [
        " Benchmark result ".center(WIDTH, "="),
        _line("Target", target),
        _line("Load", settings["load"]),
        _line("Requests completed / failed", f"{s.completed} / {s.failed}"),
        _line("Duration (s)", f"{s.duration_s:.2f}"),
        _line("Input tokens", s.input_tokens),
        _line("Output tokens (requested)", f"{s.output_tokens} ({s.requested_output_tokens})"),
        _line("Request throughput (req/s)", f"{s.request_throughput:.2f}"),
        _line("Output token throughput (tok/s)", f"{s.output_throughput:.2f}"),
        _line("Total token throughput (tok/s)", f"{s.total_token_throughput:.2f}"),
        " Latency ".center(WIDTH, "-"),
        *_latency_table(s),
    ]
    if by_priority:
        lines += _priority_table(by_priority)
    if s.errors:
        lines.append(" Errors ".center(WIDTH, "-"))
        lines += [f"{count:>8}  {kind}" for kind, count in s.errors.items()]
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def as_json(
    summary: Summary, settings: dict[str, Any], by_priority: dict[int, Summary] | None = None
) -> bytes:
    """The settings and the summary as JSON (latencies in ms, null when not measured),
    with `by_priority` (each priority's summary, keyed by the priority) when given."""
    document: dict[str, Any] = {"settings": settings, **asdict(summary)}
    if by_priority:
        document["by_priority"] = {str(k): asdict(v) for k, v in by_priority.items()}
    return orjson.dumps(document, option=orjson.OPT_INDENT_2)


def write_json(
    path: str | Path,
    summary: Summary,
    settings: dict[str, Any],
    by_priority: dict[int, Summary] | None = None,
) -> None:
    """Writes `as_json` to `path`."""
    Path(path).write_bytes(as_json(summary, settings, by_priority))
