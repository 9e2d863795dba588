"""A team at run time: its config, its per-minute buckets, what it holds now,
and the counts its metrics show."""

from __future__ import annotations

from typing import Any

from gateway.config import TeamConfig
from gateway.teams.bucket import Bucket

#: Why a team's request was refused, the `limit` label of its metric.
REFUSALS = ("requests", "tokens", "concurrency", "fair_share")


class Team:
    """One team, shared by every request its keys make to this gateway."""

    __slots__ = (
        "allowed",
        "budget",
        "config",
        "inflight",
        "name",
        "refused",
        "requests",
        "slots",
        "tokens",
        "tokens_charged",
        "wanted_at",
        "weight",
    )

    def __init__(self, config: TeamConfig) -> None:
        self.config = config
        self.name = config.name
        self.weight = config.weight
        self.allowed = frozenset(config.models)
        rpm, tpm = config.requests_per_minute, config.tokens_per_minute
        self.requests = Bucket(rpm) if rpm else None
        self.tokens = Bucket(tpm) if tpm else None
        #: Requests admitted by the limits and not yet over, on this gateway.
        self.inflight = 0
        #: Slots held on this gateway (fair share).
        self.slots = 0
        #: When a request last found no slot it could take (monotonic): demand.
        self.wanted_at = float("-inf")
        self.refused = dict.fromkeys(REFUSALS, 0)
        self.tokens_charged = 0.0
        #: Its budgets' counters as last seen: key → (Meter, usage) (gateway.teams.budgets).
        self.budget: dict[str, tuple[Any, float]] = {}

    def sees(self, model: str) -> bool:
        """Whether the team's keys may use (and list) `model`."""
        return not self.allowed or model in self.allowed
