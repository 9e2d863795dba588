"""What teams spend: their budgets (budgets.py) and the usage ledger (usage.py),
behind the two calls admission makes, `reserve` at its budgets stage and
`settle` at its one ending point, so every route that costs tokens is counted
the same way, however its request ended.

A request's cost at the end is what the engine counted: its prompt tokens and
its completion tokens (the `Finished` counts, or the tokens written when the
answer was cut before them: a client gone, a timeout). A tensor inference costs
a request and no tokens. Budgets and ledger are charged for the model that
served (an alias's target, a fallback).

A tick every `TICK` seconds sends the ledger's rows to Redis and, while Redis is
away, checks whether it answers again (budgets then add what they counted
meanwhile).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.config import Config
from gateway.protocol.types import AudioRequest, EmbedRequest, GenerateRequest
from gateway.teams.budgets import THRESHOLDS, Budgets, Reservation, spend
from gateway.teams.keys import bearer_token
from gateway.teams.limiter import estimate_tokens
from gateway.teams.team import Team
from gateway.teams.usage import AMOUNTS, Ledger
from gateway.telemetry import PREFIX, LiveCollector
from gateway.telemetry.record import RequestRecord

if TYPE_CHECKING:
    from gateway.teams.redis_store import RedisStore

log = logging.getLogger("furnace.accounts")

#: Seconds between flushes of the ledger and checks of Redis.
TICK = 1.0
#: Hex digits of a key's SHA-256 that name it in the ledger (`key_id`).
KEY_ID_DIGITS = 12
#: The team name of an open gateway's requests in the ledger.
OPEN = "-"


def key_id(headers: Iterable[tuple[bytes, bytes]]) -> str | None:
    """The id the ledger and per-key budgets know a request's key by: the first
    `KEY_ID_DIGITS` hex digits of its SHA-256 (never the key)."""
    token = bearer_token(headers)
    if token is None:
        return None
    return hashlib.sha256(token).hexdigest()[:KEY_ID_DIGITS]


def reservation_of(
    request: GenerateRequest | EmbedRequest | AudioRequest | None,
    max_context: int | None = None,
    granted: int | None = None,
) -> tuple[int, int, bool]:
    """What a request may cost at most: its prompt, estimated, its completion
    (`max_tokens` x `n`; with no bound, what the team's minute `granted` a choice, or the
    rest of `max_context`, whichever is less, x `n`, and 0 where neither is known; 0 for
    embeddings, transcriptions and tensors), and whether it has no bound of its own."""
    if request is None:
        return 0, 0, False
    prompt = estimate_tokens(request)
    if isinstance(request, EmbedRequest | AudioRequest):
        return prompt, 0, False
    if request.sampling.max_tokens is None:
        bounds = [b for b in (granted, max_context and max(1, max_context - prompt)) if b]
        if not bounds:
            return prompt, 0, False
        return prompt, min(bounds) * request.n, True
    return prompt, request.sampling.max_tokens * request.n, False


class Accounts:
    """Budgets and ledger of one gateway; start and close it on the serving loop."""

    def __init__(self, config: Config, teams: Iterable[Team], store: RedisStore | None) -> None:
        self.teams = list(teams)
        self.budgets = Budgets(config, store)
        self.ledger = Ledger(config.usage_retention_days, store, config.redis_key_prefix)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        """Stops the tick and sends the ledger's last rows."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.ledger.flush()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(TICK)
            try:
                await self.ledger.flush()
                await self.budgets.probe()
            except Exception:  # the tick must outlive any surprise
                log.exception("the accounts tick failed")

    async def reserve(
        self,
        team: Team | None,
        key: str | None,
        model: str,
        request: GenerateRequest | EmbedRequest | AudioRequest | None,
        max_context: int | None = None,
        granted: int | None = None,
    ) -> Reservation | None:
        """The budgets stage: reserves the most `request` may cost on its team's
        budgets (`BudgetExceeded` when one has no room; one with no bound may be granted
        fewer tokens than its model's context, or than its team's minute `granted` a
        choice: `Reservation.granted`, a choice's share of which is its bound). None:
        nothing reserved."""
        if team is None or not team.config.budgets:
            return None
        prompt, completion, unbounded = reservation_of(request, max_context, granted)
        held = await self.budgets.reserve(team, key, model, prompt, completion, unbounded)
        if held is not None and held.granted is not None and isinstance(request, GenerateRequest):
            held.granted = max(1, held.granted // request.n)
        return held

    async def reprice(self, held: Reservation, model: str) -> None:
        """A fallback serves: `held` is reserved at `model`'s prices instead, if it fits
        (`BudgetExceeded` otherwise), so budgets are charged for the model that served."""
        await self.budgets.reprice(held, model)

    async def settle(
        self,
        team: Team | None,
        key: str | None,
        model: str,
        held: Reservation | None,
        record: RequestRecord,
    ) -> None:
        """The ending: settles the budgets to what the request used, and writes it
        in the ledger."""
        prompt, completion = record.used()
        if held is not None:
            await self.budgets.settle(held, prompt, completion)
        cost = spend(self.budgets.prices.get(model), prompt, completion)
        name = OPEN if team is None else team.name
        # an `Outcome` is its own name (a StrEnum): the ledger keys its field by it
        self.ledger.record(
            name, model, key, prompt, completion, cost, record.outcome, cached=record.cached_tokens
        )

    @property
    def idle(self) -> bool:
        """Nothing waits to reach Redis."""
        return not self.ledger.rows and self.ledger.batch is None


class AccountsCollector(LiveCollector):
    """The ledger's totals since start and the budgets' levels, for /metrics. Labels:
    team and model names from the config, a budget's window and meter: at most
    teams x models series per counter, teams x budgets per gauge."""

    def __init__(self, accounts: Accounts) -> None:
        self.accounts = accounts

    def collect(self) -> Iterator[Metric]:
        ledger = self.accounts.ledger
        counters = {
            name: CounterMetricFamily(
                f"{PREFIX}_usage_{name}",
                f"Usage ledger: {name.replace('_', ' ')} by team and served model, since start.",
                labels=["team", "model"],
            )
            for name in AMOUNTS
        }
        for (team_name, model), totals in ledger.totals.items():
            for name in AMOUNTS:
                counters[name].add_metric([team_name, model], totals[name])
        yield from counters.values()
        used = GaugeMetricFamily(
            f"{PREFIX}_budget_used_ratio",
            "Each team budget's usage (settled and reserved) over its limit, in its current "
            "window, as this gateway last saw it; alerts fire at 0.8 and 1.",
            labels=["team", "window", "meter", "key_id"],
        )
        reached = GaugeMetricFamily(
            f"{PREFIX}_budget_threshold_reached",
            "1 once a budget's usage reached the threshold (a fraction of it) in its window.",
            labels=["team", "window", "meter", "key_id", "threshold"],
        )
        now = time.time()
        for team in self.accounts.teams:
            for meter, level in team.budget.values():
                if meter.ends < now:
                    continue
                ratio = level / meter.limit if meter.limit else 1.0
                labels = [team.name, meter.budget.window, meter.kind, meter.budget.key or ""]
                used.add_metric(labels, ratio)
                for threshold in THRESHOLDS:
                    reached.add_metric([*labels, f"{threshold:g}"], float(ratio >= threshold))
        yield used
        yield reached
        refused = CounterMetricFamily(
            f"{PREFIX}_budget_refusals",
            "Requests refused because a budget of their team was spent (429 budget_exceeded).",
            labels=["team"],
        )
        for team_name, count in self.accounts.budgets.refusals.items():
            refused.add_metric([team_name], count)
        yield refused
        store = GaugeMetricFamily(
            f"{PREFIX}_accounts_store_up",
            "1 while budgets and the usage ledger reach Redis (or live in memory alone).",
            labels=["part"],
        )
        store.add_metric(["budgets"], float(self.accounts.budgets.redis_up or not self._redis))
        store.add_metric(["ledger"], float(ledger.redis_up or not self._redis))
        yield store

    @property
    def _redis(self) -> bool:
        return self.accounts.ledger.store is not None
