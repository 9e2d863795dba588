"""The figures of a run, defined as vLLM's `bench serve` defines them.

- TTFT: from sending the request to its first content chunk (streams only).
- ITL: every gap between successive content chunks, pooled over requests.
- TPOT: per request, (e2e - TTFT) / (output tokens - 1), for answers of 2+ tokens.
- E2E: from sending the request to its last byte.
- Output tokens: the usage's `completion_tokens` where the server sent usage,
  else the content chunks counted.
- Throughputs: over the run's duration, from the first request sent to the last
  one over; failed requests count in no figure but the errors.

Percentiles interpolate linearly between ranks, as numpy's (and so vLLM's) do.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.bench.client import Result
from gateway.bench.workload import Request

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (q in [0, 100]), linearly interpolated."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Distribution:
    """Mean and percentiles of some durations, in milliseconds."""

    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Distribution | None:
        """The summary of `seconds`, or None when there are none."""
        if not seconds:
            return None
        ms = [s * 1e3 for s in seconds]
        p50, p90, p99 = (percentile(ms, q) for q in PERCENTILES)
        return cls(mean=sum(ms) / len(ms), p50=p50, p90=p90, p99=p99)


@dataclass(frozen=True)
class Summary:
    """Everything a report says about a run."""

    duration_s: float
    requests: int
    completed: int
    failed: int
    errors: dict[str, int]  # failed requests by kind, most frequent first
    input_tokens: int  # usage's prompt_tokens, else the words sent
    output_tokens: int
    requested_output_tokens: int  # the completed requests' max_tokens
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens per second
    total_token_throughput: float  # input and output tokens per second
    ttft_ms: Distribution | None
    itl_ms: Distribution | None
    tpot_ms: Distribution | None
    e2e_ms: Distribution | None


def summarize(requests: Sequence[Request], results: Sequence[Result]) -> Summary:
    """The figures of a run: `results[i]` answers `requests[i]`."""
    done = [(req, res) for req, res in zip(requests, results, strict=True) if res.ok]
    answered = [res for _, res in done]
    duration = (max(r.end for r in results) - min(r.sent for r in results)) if results else 0.0
    input_tokens = sum(
        req.input_words if res.prompt_tokens is None else res.prompt_tokens for req, res in done
    )
    output_tokens = sum(res.output_tokens for res in answered)
    errors = Counter(res.error for res in results if res.error is not None)

    def per_second(count: float) -> float:
        return count / duration if duration > 0 else 0.0

    return Summary(
        duration_s=duration,
        requests=len(results),
        completed=len(answered),
        failed=len(results) - len(answered),
        errors=dict(errors.most_common()),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        requested_output_tokens=sum(req.max_tokens for req, _ in done),
        request_throughput=per_second(len(answered)),
        output_throughput=per_second(output_tokens),
        total_token_throughput=per_second(input_tokens + output_tokens),
        ttft_ms=Distribution.of([r.ttft for r in answered if r.ttft is not None]),
        itl_ms=Distribution.of([gap for r in answered for gap in r.itl]),
        tpot_ms=Distribution.of([t for r in answered if (t := r.tpot) is not None]),
        e2e_ms=Distribution.of([r.latency for r in answered]),
    )


def by_priority(requests: Sequence[Request], results: Sequence[Result]) -> dict[int, Summary]:
    """`summarize` for the requests of each priority, highest first (empty without any)."""
    levels = sorted({r.priority for r in requests if r.priority is not None}, reverse=True)
    out = {}
    for level in levels:
        pairs = [(q, r) for q, r in zip(requests, results, strict=True) if q.priority == level]
        out[level] = summarize([q for q, _ in pairs], [r for _, r in pairs])
    return out
