"""The teams' figures for /metrics, read from the live objects at scrape time.
Labels are team names from the config, never anything a client sends; no key
or digest ever appears."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.teams.limiter import Limiter
from gateway.teams.team import Team
from gateway.telemetry import PREFIX, LiveCollector


class Counted(Protocol):
    """What the figures are read from (`gateway.teams.Teams`), declared here so that the
    teams depend on their metrics and not both ways."""

    @property
    def limiter(self) -> Limiter: ...
    @property
    def auth_failures(self) -> int: ...
    @property
    def by_name(self) -> Mapping[str, Team]: ...


class TeamsCollector(LiveCollector):
    """Per-team in-flight, refusals and tokens; the limits store's health."""

    def __init__(self, teams: Counted) -> None:
        self.teams = teams

    def collect(self) -> Iterator[Metric]:
        teams = self.teams
        limiter = teams.limiter
        store = GaugeMetricFamily(
            f"{PREFIX}_limits_store_up",
            "1 while the teams' limits are held in the shared store (Redis); 0 while this "
            "gateway falls back to its local limits. Memory alone is always up.",
            labels=["store"],
        )
        if limiter.redis is None:
            store.add_metric(["memory"], 1)
        else:
            store.add_metric(["redis"], 1 if limiter.redis_up else 0)
        yield store
        failures = CounterMetricFamily(
            f"{PREFIX}_auth_failures", "Requests refused for a missing or unknown API key."
        )
        failures.add_metric([], teams.auth_failures)
        yield failures
        inflight = GaugeMetricFamily(
            f"{PREFIX}_team_inflight_requests",
            "Requests of each team being served.",
            labels=["team"],
        )
        refused = CounterMetricFamily(
            f"{PREFIX}_team_refusals",
            "Requests of each team refused by its limits (429) or its fair share (503).",
            labels=["team", "limit"],
        )
        tokens = CounterMetricFamily(
            f"{PREFIX}_team_tokens",
            "Tokens (prompt and completion) charged to each team.",
            labels=["team"],
        )
        slots = GaugeMetricFamily(
            f"{PREFIX}_team_slots",
            "Slots each team holds now on this gateway: the share it receives (fair share "
            "or the queue's weights).",
            labels=["team"],
        )
        for team in teams.by_name.values():
            inflight.add_metric([team.name], team.inflight)
            for limit, count in team.refused.items():
                refused.add_metric([team.name, limit], count)
            tokens.add_metric([team.name], team.tokens_charged)
            slots.add_metric([team.name], team.slots)
        yield from (inflight, refused, tokens, slots)
