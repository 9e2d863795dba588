"""Budgets: what a team (or one of its keys) may spend over a calendar window
(a UTC day or month), in tokens or in spend (the models' `prices`), held in
this gateway's memory or, with `redis_url`, in Redis for every replica.

Reserve, then settle, as the per-minute token limit does: admission reserves the
most a request can cost (its prompt, estimated, plus `max_tokens` x `n`), and
only if every budget of the team has room for it; the request's end settles each
budget to what the engine counted (prompt and completion tokens), refunding the
rest: finished, cut by the client, timed out or refused by the worker alike,
since it runs where admission's lease ends. A request with no bound reserves the
rest of its model's context for each choice (or what its team's minute granted
it, if less); where that does not fit, half of it, and so on down to one token,
and the first that fits becomes its `max_tokens` (as the per-minute limit grants
one): it cannot write past its budget. So a window can end above its budget by
no more than what the estimate missed of prompts (and, for a model whose context
the gateway does not know, what requests with no bound wrote), of requests
admitted before the budget was reached.

One budget counter per window, `P:budget:{team}:<meter>:<window>[:key]`, holds
the settled usage plus the reservations outstanding. In Redis one Lua script
(`_APPLY`) checks and adds every counter of a request at once: atomic across
replicas, so two gateways cannot both take the last room. A counter expires a
day after its window ends.

While Redis does not answer, `budget_store_failure` decides: `open` goes on
with this gateway's counters (seeded with the last shared figures it saw) and
adds what it counted meanwhile to Redis once Redis answers again; `closed`
refuses with 503. A settlement is counted where its reservation was (window
and store), so a request that straddles midnight is charged to the day it
was admitted.

The cost on the hot path: nothing for a team without budgets; otherwise a dict
look-up per counter at admission and at the end, or one script call to Redis
for each (~0.1-0.3 ms of round trip, measured by benchmarks/bench_budgets.py).
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from gateway.config import BudgetConfig, Config
from gateway.protocol import errors

if TYPE_CHECKING:
    from gateway.teams.redis_store import RedisStore
    from gateway.teams.team import Team

log = logging.getLogger("furnace.budgets")

#: Seconds a counter is kept in Redis after its window ends.
KEEP_AFTER = 86_400
#: Soft thresholds, as fractions of a budget, reported as metrics.
THRESHOLDS = (0.8, 1.0)
#: How the store fails: a refused connection is an OSError, a stall a TimeoutError.
STORE_FAILURES = (OSError, TimeoutError)

# KEYS[1]: the call's marker; KEYS[2..]: counters. ARGV[1]: `check` (adds only if every
# positive amount fits), `add`, or `undo` (of a call that timed out); ARGV[2]: the
# marker's life (ms); then per counter: limit, amount (negative: a refund), expiry (unix
# ms). Returns {0, each counter's usage after}, or {i, usage} when counter i (1-based)
# refused, or {-1} for a call that ran before (never applied twice). An `undo` of a call
# that applied adds the amounts it is given (the call's, negated); of one that never
# ran, marks it so that it never will.
_APPLY = """
local mode, prior = ARGV[1], redis.call('GET', KEYS[1])
local function mark(state) redis.call('SET', KEYS[1], state, 'PX', ARGV[2]) end
if mode == 'undo' then
  if prior ~= 'applied' then mark('undone') return {-1} end
elseif prior then
  return {-1}
end
local n = #KEYS - 1
if mode == 'check' then
  for i = 1, n do
    local limit, amount = tonumber(ARGV[3 * i]), tonumber(ARGV[3 * i + 1])
    local used = tonumber(redis.call('GET', KEYS[i + 1]) or '0')
    if amount > 0 and used + amount > limit then
      mark('refused')
      return {i, tostring(used)}
    end
  end
end
local used = {0}
for i = 1, n do
  used[i + 1] = redis.call('INCRBYFLOAT', KEYS[i + 1], ARGV[3 * i + 1])
  redis.call('PEXPIREAT', KEYS[i + 1], ARGV[3 * i + 2])
end
mark(mode == 'undo' and 'undone' or 'applied')
return used
"""
#: (team, key id) pairs whose counters are kept at most (each key of a team is one).
MAX_CACHED = 4096
#: Milliseconds a call's marker lives: long enough for the probe that follows a stall.
MARKER_MS = 120_000


#: One call's counters: keys, limits, amounts and expiries (unix ms).
Call = tuple[list[str], list[float], list[float], list[int]]


def window_of(budget: BudgetConfig, now: float) -> tuple[str, float]:
    """The window of `budget` that holds `now` (unix seconds): its name (its start's
    date) and when it ends (unix seconds)."""
    at = datetime.fromtimestamp(now, UTC)
    if budget.window == "day":
        start = at.replace(hour=budget.start_hour, minute=0, second=0, microsecond=0)
        if start > at:
            start -= timedelta(days=1)
        end = start + timedelta(days=1)
        return start.strftime("%Y-%m-%d"), end.timestamp()
    start = at.replace(day=budget.start_day, hour=budget.start_hour, minute=0, second=0)
    start = start.replace(microsecond=0)
    if start > at:  # the window began last month
        year, month = (start.year, start.month - 1) if start.month > 1 else (start.year - 1, 12)
        start = start.replace(year=year, month=month)
    year, month = (start.year, start.month + 1) if start.month < 12 else (start.year + 1, 1)
    end = start.replace(year=year, month=month)
    return start.strftime("%Y-%m-%d"), end.timestamp()


def spend(prices: tuple[float, float] | None, prompt: float, completion: float) -> float:
    """The spend of `prompt` and `completion` tokens at `prices` per million."""
    if prices is None:
        return 0.0
    return (prompt * prices[0] + completion * prices[1]) / 1e6


class Meter:
    """One counter a request touches: a budget's tokens or spend, in one window."""

    __slots__ = ("budget", "ends", "key", "kind", "limit", "name")

    def __init__(self, team: str, budget: BudgetConfig, kind: str, now: float, prefix: str) -> None:
        self.budget = budget
        self.kind = kind  # "tokens" or "spend"
        self.limit = float((budget.tokens if kind == "tokens" else budget.spend) or 0)
        self.name, self.ends = window_of(budget, now)
        suffix = f":{budget.key}" if budget.key else ""
        self.key = f"{prefix}:budget:{{{team}}}:{kind}:{budget.window}:{self.name}{suffix}"

    def cost(self, prices: tuple[float, float] | None, prompt: float, completion: float) -> float:
        if self.kind == "tokens":
            return prompt + completion
        return spend(prices, prompt, completion)


class Reservation:
    """What one request reserved, to be settled at its end."""

    __slots__ = ("completion", "granted", "meters", "prices", "prompt", "reserved", "team")

    def __init__(self, team: Team, meters: list[Meter], prices: tuple[float, float] | None) -> None:
        self.team = team
        self.meters = meters
        self.prices = prices
        self.reserved = [0.0] * len(meters)
        #: The tokens reserved: the prompt's estimate and the completion's.
        self.prompt = self.completion = 0
        #: For a request with no bound: the completion tokens the budgets granted it
        #: (fewer than asked: its bound from here); None: all it asked.
        self.granted: int | None = None


class Budgets:
    """Every team's budgets on this gateway: `reserve` at admission, `settle` at the end."""

    def __init__(self, config: Config, store: RedisStore | None) -> None:
        self.prefix = config.redis_key_prefix
        self.fail_open = config.budget_store_failure == "open"
        self.prices: dict[str, tuple[float, float] | None] = {}
        self.store = store
        self._apply = store.script(_APPLY) if store is not None else None
        #: Whether Redis answered last time.
        self.redis_up = store is not None
        #: Each counter's usage (settled and reserved), as this gateway knows it.
        self.used: dict[str, float] = {}
        #: When each counter's window ends (unix seconds), to forget it after.
        self.ends: dict[str, float] = {}
        #: What this gateway counted while Redis was down, to add to Redis later:
        #: counter → (amount, when its window ends).
        self.unsynced: dict[str, tuple[float, float]] = {}
        #: Calls to Redis that failed and may yet run (undone once Redis answers).
        self.uncertain: dict[str, Call] = {}
        self._gateway = secrets.token_hex(6)  # names this gateway's calls
        self._count = 0
        #: Each (team, key id)'s counters, and when the first of their windows ends.
        self._meters: dict[tuple[str, str | None], tuple[float, list[Meter]]] = {}
        #: Refusals by team (the metric).
        self.refusals: dict[str, int] = {}
        self.configure(config)

    def configure(self, config: Config) -> None:
        """Takes `config`'s prices, and its teams' budgets from the next request on
        (at start, and on a reload: the counters, and what they hold, stay)."""
        self.prices = {m.name: m.prices for m in config.models}
        self._meters.clear()

    @staticmethod
    def has_budgets(team: Team | None) -> bool:
        return team is not None and bool(team.config.budgets)

    def meters(self, team: Team, key_id: str | None, now: float) -> list[Meter]:
        """The counters a request of `team` (made with key `key_id`) touches now (kept
        until the first of their windows ends: the window's dates are the cost)."""
        cached = self._meters.get((team.name, key_id))
        if cached is not None and now < cached[0]:
            return cached[1]
        meters = []
        for budget in team.config.budgets:
            if budget.key is not None and (key_id is None or not key_id.startswith(budget.key)):
                continue
            for kind in ("tokens", "spend"):
                if getattr(budget, kind) is not None:
                    meters.append(Meter(team.name, budget, kind, now, self.prefix))
        if len(self._meters) >= MAX_CACHED:
            self._meters.clear()
        self._meters[(team.name, key_id)] = (
            min((m.ends for m in meters), default=now + 60),
            meters,
        )
        return meters

    # -- admission ----------------------------------------------------------------

    async def reserve(
        self,
        team: Team,
        key_id: str | None,
        model: str,
        prompt: int,
        completion: int,
        unbounded: bool = False,
    ) -> Reservation | None:
        """Reserves `prompt` + `completion` tokens (their spend at `model`'s prices) on
        every budget of `team`; raises BudgetExceeded if one has no room, or Busy if
        Redis is down and budgets fail closed. None: the team has no budget. An
        `unbounded` request (no `max_tokens`: `completion` is the rest of its model's
        context) that does not fit asks half as much again, down to one token, and is
        granted the first that fits (`Reservation.granted`)."""
        if not team.config.budgets:
            return None
        now = time.time()
        meters = self.meters(team, key_id, now)
        prices = self.prices.get(model)
        held = Reservation(team, meters, prices)
        while True:
            amounts = [m.cost(prices, prompt, completion) for m in meters]
            refused = await self._apply_all(held, amounts, check=True)
            if refused is None:
                break
            if not unbounded or completion <= 1:
                raise self._exceeded(team, meters[refused], now)
            completion //= 2
            held.granted = completion
        held.reserved, held.prompt, held.completion = amounts, prompt, completion
        self._mark(team, meters)
        return held

    async def reprice(self, held: Reservation, model: str) -> None:
        """Moves `held` to `model`'s prices (a fallback serves the request): every counter
        changes by the difference at once, and only if what it adds fits
        (`BudgetExceeded` otherwise, `held` unchanged)."""
        prices = self.prices.get(model)
        if prices == held.prices:
            return
        amounts = [m.cost(prices, held.prompt, held.completion) for m in held.meters]
        deltas = [a - r for a, r in zip(amounts, held.reserved, strict=True)]
        refused = await self._apply_all(held, deltas, check=True)
        if refused is not None:
            raise self._exceeded(held.team, held.meters[refused], time.time())
        held.prices, held.reserved = prices, amounts
        self._mark(held.team, held.meters)

    async def settle(self, held: Reservation, prompt: int, completion: int) -> None:
        """Charges what the request used instead of what it reserved."""
        used = [m.cost(held.prices, prompt, completion) for m in held.meters]
        deltas = [u - r for u, r in zip(used, held.reserved, strict=True)]
        held.reserved = used
        if any(deltas):
            await self._apply_all(held, deltas, check=False)
            self._mark(held.team, held.meters)

    async def _apply_all(
        self, held: Reservation, amounts: Sequence[float], check: bool
    ) -> int | None:
        """Adds `amounts` to the counters (if `check`, only if all fit): in Redis while
        it answers, else here (and kept to add to Redis later); the index of the
        counter that refused, or None."""
        if self._apply is not None and self.redis_up:
            marker = self._marker(held.meters[0].key)
            try:
                return await self._apply_shared(marker, held.meters, amounts, check)
            except STORE_FAILURES as error:
                self._failed(error)
        if self._apply is not None and check and not self.fail_open:
            raise errors.Busy(
                "Budgets cannot be checked now; try again shortly.", reason="budget_store_down"
            )
        refused = self._apply_local(held.meters, amounts, check)
        if refused is None and self._apply is not None:
            for meter, amount in zip(held.meters, amounts, strict=True):
                total, _ = self.unsynced.get(meter.key, (0.0, meter.ends))
                self.unsynced[meter.key] = (total + amount, meter.ends)
        return refused

    async def _apply_shared(
        self, marker: str, meters: Sequence[Meter], amounts: Sequence[float], check: bool
    ) -> int | None:
        call = (
            [m.key for m in meters],
            [m.limit for m in meters],
            list(amounts),
            [int((m.ends + KEEP_AFTER) * 1000) for m in meters],
        )
        try:
            reply = await self._call(marker, "check" if check else "add", call)
        except STORE_FAILURES:
            self.uncertain[marker] = call  # it may run yet, once Redis resumes
            raise
        if int(reply[0]) < 0:
            return None
        if int(reply[0]):
            index = int(reply[0]) - 1
            self.used[meters[index].key] = float(reply[1])
            return index
        for meter, used in zip(meters, reply[1:], strict=True):
            self.used[meter.key] = float(used)
            self.ends[meter.key] = meter.ends
        return None

    async def _call(self, marker: str, mode: str, call: Call) -> list[bytes]:
        """One run of `_APPLY`, at most `redis_timeout` long."""
        assert self._apply is not None and self.store is not None
        keys, limits, amounts, expiries = call
        args: list[float | int | str] = [mode, MARKER_MS]
        for limit, amount, expiry in zip(limits, amounts, expiries, strict=True):
            args += [limit, amount, expiry]
        async with self.store.bounded():
            reply: list[bytes] = await self._apply(keys=[marker, *keys], args=args)
        return reply

    def _marker(self, key: str) -> str:
        """A new call's marker, in the Redis Cluster slot of `key` (its team's)."""
        self._count += 1
        return f"{key.split('}', 1)[0]}}}:call:{self._gateway}:{self._count}"

    def _apply_local(
        self, meters: Sequence[Meter], amounts: Sequence[float], check: bool
    ) -> int | None:
        used = self.used
        if check:
            for i, (meter, amount) in enumerate(zip(meters, amounts, strict=True)):
                if amount > 0 and used.get(meter.key, 0.0) + amount > meter.limit:
                    return i
        for meter, amount in zip(meters, amounts, strict=True):
            used[meter.key] = used.get(meter.key, 0.0) + amount
            self.ends[meter.key] = meter.ends
        return None

    def _mark(self, team: Team, meters: Iterable[Meter]) -> None:
        """Remembers the budgets' levels for headers and metrics (`Team.budget`)."""
        team.budget = {m.key: (m, self.used.get(m.key, 0.0)) for m in meters}

    def _exceeded(self, team: Team, meter: Meter, now: float) -> errors.BudgetExceeded:
        budget = meter.budget
        self.refusals[team.name] = self.refusals.get(team.name, 0) + 1
        resets = datetime.fromtimestamp(meter.ends, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        whose = f"key {budget.key} of team `{team.name}`" if budget.key else f"team `{team.name}`"
        limit = f"{meter.limit:g}" if meter.kind == "spend" else str(int(meter.limit))
        return errors.BudgetExceeded(
            f"The {budget.window} budget of {whose} is spent ({limit} {meter.kind}); "
            f"it resets at {resets}.",
            retry_after=max(1, math.ceil(meter.ends - now)),
            reason="budget_exceeded",
        )

    # -- Redis health ---------------------------------------------------------------

    def _failed(self, error: BaseException) -> None:
        if self.redis_up:
            mode = "counting in this gateway" if self.fail_open else "refusing budgeted teams"
            log.warning(
                "budgets store (Redis) failed (%s: %s): %s", type(error).__name__, error, mode
            )
        self.redis_up = False

    async def probe(self) -> None:
        """Once Redis answers again: adds what was counted meanwhile, and uses it again."""
        store = self.store
        if store is None or self._apply is None:
            return
        self.forget(time.time())
        if self.redis_up and not self.unsynced and not self.uncertain:
            return
        try:
            await store.ping()
            # first undo the calls that failed but ran: they were counted here instead
            for marker, (keys, limits, amounts, expiries) in list(self.uncertain.items()):
                undo = (keys, limits, [-amount for amount in amounts], expiries)
                await self._call(marker, "undo", undo)
                del self.uncertain[marker]
            for key, (amount, ends) in list(self.unsynced.items()):
                call = ([key], [0.0], [amount], [int((ends + KEEP_AFTER) * 1000)])
                marker = self._marker(key)
                try:
                    reply = await self._call(marker, "add", call)
                except STORE_FAILURES:
                    self.uncertain[marker] = call  # undone next time, then sent again
                    raise
                self.used[key] = float(reply[1])
                del self.unsynced[key]
        except STORE_FAILURES as error:
            self._failed(error)
            return
        if not self.redis_up:
            log.info("budgets store (Redis) answers: budgets are shared by every replica")
        self.redis_up = True

    def forget(self, now: float) -> None:
        """Drops the local figures of windows that ended."""
        for key in [k for k, ends in self.ends.items() if ends < now]:
            self.ends.pop(key, None)
            self.used.pop(key, None)


def levels(team: Team) -> list[tuple[Meter, float]]:
    """The team's last known budgets and their usage (for headers and metrics)."""
    return list(team.budget.values())
