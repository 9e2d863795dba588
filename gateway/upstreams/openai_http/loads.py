"""A vLLM OpenAI-HTTP server's load record, read from its Prometheus `/metrics`.

vLLM's HTTP server sends no load record with its KV events (its ZMQ publisher carries
blocks only), but its `/metrics` has the scheduler's gauges, one sample per engine (data
parallel ranks are labelled `engine`): `vllm:num_requests_running`,
`vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc` (a fraction, 0 to 1;
`vllm:gpu_cache_usage_perc` before vLLM 0.10). `engine_load` turns them into the
`EngineLoad` the other kinds of workers stream: running and waiting summed over the
engines, the fullest engine's KV use; no uncached-token count (vLLM does not export it).

The page is asked for with those names only (`LOAD_QUERY`, prometheus-client's `name[]`
filter, served by vLLM at `/metrics/`): vLLM 0.32's whole page is ~57 KB of mostly
histograms, whose rendering on the engine's API server and reading here cost about 2 ms of
the gateway's CPU a read, once a second an engine; the filtered page is ~540 bytes.

The body is read up to `MAX_METRICS_BYTES` and scanned with one regular expression for
those names only, not parsed whole: vLLM's document is mostly histograms, and a full
parse costs the event loop far more (vLLM 0.32's 57 KB page, idle: 48 µs here,
prometheus_client's text parser 37 ms).
A server whose page has no running and waiting gauges is not a vLLM: None.

`engine_ranks` reads the same page for the engines a data-parallel server runs (the
`engine` labels of its running gauge): vLLM's OpenAI server has no other place that says.
"""

from __future__ import annotations

import math
import re
from urllib.parse import urlencode

from gateway.protocol.kv_blocks import EngineLoad
from gateway.upstreams.base import MAX_ENGINE_RANKS

#: Bytes of `/metrics` read at most (vLLM 0.32's page is ~60 KB, most of it histograms;
#: it grows with more label values, such as LoRA adapters).
MAX_METRICS_BYTES = 1024 * 1024
#: A count above this is not believed (a hostile or broken server): clamped.
MAX_COUNT = 1 << 31

_RUNNING, _WAITING = b"num_requests_running", b"num_requests_waiting"
#: The gauges read, by their names after `vllm:`.
GAUGES = (
    "num_requests_running",
    "num_requests_waiting",
    "kv_cache_usage_perc",
    "gpu_cache_usage_perc",
)
#: `/metrics`' query for those gauges alone (prometheus-client's `name[]` filter).
LOAD_QUERY = urlencode([("name[]", f"vllm:{name}") for name in GAUGES])
#: `vllm:NAME{labels} value [timestamp]` after a newline (a literal start lets the engine
#: skip to candidates: 20x faster than `^` with MULTILINE); label values may hold `}`.
_SAMPLE = re.compile(
    rb"\nvllm:("
    + "|".join(GAUGES).encode()
    + rb')(\{(?:[^"}\n]|"(?:[^"\\\n]|\\.)*")*\})?[ \t]+(\S+)',
)
#: The `engine` label's value in a sample's labels.
_ENGINE = re.compile(rb'(?:\{|,)engine="([^"]*)"')


def engine_load(
    body: bytes, truncated: bool = False, engine: int | None = None
) -> EngineLoad | None:
    """The load record in a `/metrics` page (None: no vLLM scheduler gauges in it);
    `truncated`: the page was cut at the read bound, so its last line is not read;
    `engine`: one data-parallel engine's samples (label `engine`) alone, else all."""
    if truncated:
        body = body[: body.rfind(b"\n") + 1]
    running = waiting = 0
    usage = 0.0
    seen: set[bytes] = set()
    label = None if engine is None else b'engine="%d"' % engine
    for match in _SAMPLE.finditer(b"\n" + body):
        if label is not None and label not in (match[2] or b""):
            continue
        name = match[1]
        try:
            value = float(match[3])
        except ValueError:
            continue
        if not math.isfinite(value) or value < 0:
            continue
        seen.add(name)
        if name == _RUNNING:
            running = min(running + int(value), MAX_COUNT)
        elif name == _WAITING:
            waiting = min(waiting + int(value), MAX_COUNT)
        else:
            usage = max(usage, min(value, 1.0))
    if _RUNNING not in seen or _WAITING not in seen:
        return None
    return EngineLoad(running=running, waiting=waiting, kv_usage=usage)


def engine_ranks(body: bytes, truncated: bool = False) -> tuple[int, ...] | None:
    """The data-parallel ranks a `/metrics` page samples the running gauge of (the
    values of their label `engine`, in order; samples without it, one engine: rank 0):
    the engines a vLLM server runs. None when the page has no running gauge (not a
    vLLM)."""
    if truncated:
        body = body[: body.rfind(b"\n") + 1]
    ranks: set[int] = set()
    seen = False
    for match in _SAMPLE.finditer(b"\n" + body):
        if match[1] == _RUNNING and len(ranks) < MAX_ENGINE_RANKS:
            seen = True
            label = _ENGINE.search(match[2] or b"")
            if label is None:
                ranks.add(0)
            elif label[1].isdigit() and len(label[1]) <= 6:
                ranks.add(int(label[1]))
    return tuple(sorted(ranks)) if seen else None
