"""OpenAI's rate-limit headers, on every response to a team that has limits:
`x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, resets written as
OpenAI writes them (`20ms`, `1s`, `6m0s`); and a team's budgets, as this
gateway last saw them (reservations in flight counted as spent):
`x-furnace-budget-{limit,remaining,reset}-{tokens,spend}-{day,month}`."""

from __future__ import annotations

import time

from gateway.teams.bucket import Bucket
from gateway.teams.team import Team


def duration(seconds: float) -> str:
    """`seconds` as OpenAI's reset headers write it."""
    ms = round(seconds * 1000)
    if ms < 1000:
        return f"{ms}ms"
    minutes, rest = divmod(ms, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


def _bucket_headers(kind: bytes, bucket: Bucket, now: float) -> list[tuple[bytes, bytes]]:
    return [
        (b"x-ratelimit-limit-" + kind, str(bucket.limit).encode()),
        (b"x-ratelimit-remaining-" + kind, str(bucket.remaining(now)).encode()),
        (b"x-ratelimit-reset-" + kind, duration(bucket.reset(now)).encode()),
    ]


def rate_limit_headers(team: Team) -> list[tuple[bytes, bytes]]:
    """The team's limits and what is left of them, as this gateway knows now."""
    now = time.monotonic()
    headers = []
    if team.requests is not None:
        headers += _bucket_headers(b"requests", team.requests, now)
    if team.tokens is not None:
        headers += _bucket_headers(b"tokens", team.tokens, now)
    if team.budget:
        headers += _budget_headers(team)
    return headers


def _amount(value: float) -> bytes:
    """A budget's figure without exponent: whole tokens, spend to 6 decimals."""
    return f"{value:.6f}".rstrip("0").rstrip(".").encode()


def _budget_headers(team: Team) -> list[tuple[bytes, bytes]]:
    """The team's own budgets (a key's are left out: another key's request may read them)."""
    headers = []
    now = time.time()
    for meter, used in team.budget.values():
        if meter.budget.key is not None or meter.ends < now:
            continue
        name = f"{meter.kind}-{meter.budget.window}".encode()
        left = max(0.0, meter.limit - used)
        headers += [
            (b"x-furnace-budget-limit-" + name, _amount(meter.limit)),
            (b"x-furnace-budget-remaining-" + name, _amount(left)),
            (b"x-furnace-budget-reset-" + name, duration(meter.ends - now).encode()),
        ]
    return headers
