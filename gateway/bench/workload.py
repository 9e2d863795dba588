"""What a run sends, and when: prompts of random words, request bodies encoded
once before the clock starts, and arrival times.

Lengths follow vLLM's random dataset: with a range ratio r, each request's input
and output lengths are drawn uniformly from [len * (1 - r), len * (1 + r)].
Arrivals are a Poisson process at the request rate (exponential gaps), or all at
once for an infinite rate; the same seed gives the same run. With priorities
(`--priorities 10:1,0:3`), each request draws one by the shares given, sent as
`x-furnace-priority`; the prompts are those of the same run without.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import orjson

#: Plain words: any tokenizer splits them into few tokens, and the demo engine
#: (which echoes words) answers with exactly as many tokens as it is asked for.
VOCABULARY = (
    *("time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child"),
    *("world", "school", "state", "family", "student", "group", "country", "problem"),
    *("hand", "part", "place", "case", "week", "company", "system", "program", "question"),
    *("work", "government", "number", "night", "point", "home", "water", "room", "mother"),
    *("area", "money", "story", "fact", "month", "lot", "right", "study", "book", "eye"),
)
ENDPOINTS = {"chat": "/chat/completions", "completions": "/completions"}


@dataclass(frozen=True)
class WorkloadSpec:
    """The requests of a run."""

    model: str
    endpoint: str = "chat"  # a key of ENDPOINTS
    num_requests: int = 100
    input_len: int = 256  # words
    output_len: int = 128  # max_tokens
    range_ratio: float = 0.0
    stream: bool = True
    ignore_eos: bool = False  # vLLM's extension: generate max_tokens whatever the text
    seed: int = 0
    #: (priority, share) pairs: each request's x-furnace-priority is drawn by share.
    priorities: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True, slots=True)
class Request:
    """One request, encoded."""

    body: bytes
    input_words: int
    max_tokens: int
    priority: int | None = None


def lengths(count: int, mean: int, range_ratio: float, rng: random.Random) -> list[int]:
    """`count` lengths uniform in [mean * (1 - r), mean * (1 + r)], at least 1."""
    if not 0 <= range_ratio < 1:
        raise ValueError("the range ratio must be in [0, 1)")
    low = max(1, math.floor(mean * (1 - range_ratio)))
    high = max(low, math.ceil(mean * (1 + range_ratio)))
    return [rng.randint(low, high) for _ in range(count)]


def body(spec: WorkloadSpec, prompt: str, max_tokens: int) -> bytes:
    """The JSON body of one request."""
    payload: dict[str, object] = {"model": spec.model}
    if spec.endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": prompt}]
    else:
        payload["prompt"] = prompt
    payload["max_tokens"] = max_tokens
    if spec.stream:
        payload["stream"] = True
        payload["stream_options"] = {"include_usage": True}
    if spec.ignore_eos:
        payload["ignore_eos"] = True
    return orjson.dumps(payload)


def requests(spec: WorkloadSpec) -> list[Request]:
    """Every request of the run, in order."""
    rng = random.Random(spec.seed)
    inputs = lengths(spec.num_requests, spec.input_len, spec.range_ratio, rng)
    outputs = lengths(spec.num_requests, spec.output_len, spec.range_ratio, rng)
    drawn: list[int | None] = [None] * spec.num_requests
    if spec.priorities:
        levels, shares = zip(*spec.priorities, strict=True)
        pick = random.Random(f"priorities-{spec.seed}")
        drawn = list(pick.choices(levels, weights=shares, k=spec.num_requests))
    out = []
    for words, max_tokens, priority in zip(inputs, outputs, drawn, strict=True):
        prompt = " ".join(rng.choices(VOCABULARY, k=words))
        out.append(Request(body(spec, prompt, max_tokens), words, max_tokens, priority))
    return out


def parse_priorities(text: str) -> tuple[tuple[int, float], ...]:
    """`10:1,0:3` (priority:share, the share 1 when left out) as pairs; raises ValueError."""
    pairs = []
    for item in text.split(","):
        level, _, share = item.strip().partition(":")
        pairs.append((int(level), float(share) if share else 1.0))
    if not pairs or any(share <= 0 for _, share in pairs):
        raise ValueError("--priorities: shares must be positive")
    return tuple(pairs)


def arrival_times(count: int, rate: float, seed: int = 0) -> list[float]:
    """When each request is due, in seconds from the start: a Poisson process
    at `rate` requests per second, or all at 0 for an infinite rate."""
    if rate <= 0:
        raise ValueError("the request rate must be positive")
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(f"arrivals-{seed}")
    now, times = 0.0, []
    for _ in range(count):
        times.append(now)
        now += rng.expovariate(rate)
    return times
