"""The usage ledger: per team x model x key id x UTC day, the prompt and
completion tokens the engines counted (and of the prompt's, those their prefix
cache held: `cached_tokens`, reported, never billed apart), requests, their
outcomes and spend.
It answers "how much did each team use, of what?" on the admin port
(`GET /admin/usage`), where Prometheus rates cannot.

Each request is written once, where its team's admission ends (so every route
that costs tokens, streamed or not, however it ended). Rows add up in this
gateway's memory; with `redis_url` they go to Redis every `FLUSH_INTERVAL`
seconds, so every replica's requests land in one ledger kept
`usage_retention_days` days:

    P:usage:{usage}:YYYY-MM-DD   hash  "team|model|key|field" → amount

A field a row has no entry for reads 0: rows written before a field existed
(`cached_tokens`) read back whole, with nothing to migrate.

A flush is one Lua script: it applies a batch only if the batch's id is new
(`SET NX` of a marker kept a day), so a flush that timed out but ran is never
counted twice when it is sent again. While Redis does not answer, the batch
waits (and new rows gather behind it); the ledger catches up once Redis
answers. (All usage keys share one hash tag: one Cluster slot for one script;
the ledger is written a few times a second, not per token.)

Without Redis the ledger is this gateway's alone, for the same retention.
"""

from __future__ import annotations

import csv
import functools
import io
import logging
import secrets
import time
from collections.abc import Iterable
from datetime import UTC, date, datetime, timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.teams.redis_store import RedisStore

log = logging.getLogger("furnace.usage")

#: Seconds between flushes of the ledger to Redis.
FLUSH_INTERVAL = 1.0
#: The fields of a row, after its names; `outcome_*` count requests by how they ended.
AMOUNTS = ("prompt_tokens", "cached_tokens", "completion_tokens", "requests", "spend")
OUTCOMES = ("completed", "client_gone", "timeout", "engine_error", "rejected", "invalid")
FIELDS = (*AMOUNTS, *(f"outcome_{o}" for o in OUTCOMES))
#: An outcome's field in a row.
_OUTCOME_FIELDS = {o: f"outcome_{o}" for o in OUTCOMES}
#: The columns of a row (JSON keys and CSV header).
COLUMNS = ("day", "team", "model", "key_id", *FIELDS)
#: The most days one query may span.
MAX_DAYS = 366
#: How a missing key id is written.
NO_KEY = "-"
_SEP = "|"
STORE_FAILURES = (OSError, TimeoutError)

# KEYS[1]: the batch's marker; KEYS[2..]: the days' hashes. ARGV[1]: the marker's life
# (ms); ARGV[2..#KEYS]: each day hash's expiry (unix ms); then (day index, field, amount)
# triples. Applies the batch once: returns 1, or 0 when the batch was applied before.
_FLUSH = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'PX', ARGV[1]) then return 0 end
for j = #KEYS + 1, #ARGV, 3 do
  redis.call('HINCRBYFLOAT', KEYS[tonumber(ARGV[j]) + 1], ARGV[j + 1], ARGV[j + 2])
end
for i = 2, #KEYS do redis.call('PEXPIREAT', KEYS[i], ARGV[i]) end
return 1
"""

#: (day, team, model, key id) → field → amount.
Rows = dict[tuple[str, str, str, str], dict[str, float]]


def day_of(now: float) -> str:
    """The UTC day of `now` (unix seconds)."""
    return _day_name(int(now // 86_400))


@functools.lru_cache(maxsize=4)
def _day_name(day: int) -> str:
    """The name of the `day`-th UTC day since the epoch: kept, as every request's
    usage asks it and formatting a date costs ~15 µs here."""
    return datetime.fromtimestamp(day * 86_400, UTC).strftime("%Y-%m-%d")


def _add(rows: Rows, where: tuple[str, str, str, str], amounts: dict[str, float]) -> None:
    row = rows.setdefault(where, {})
    for name, amount in amounts.items():
        row[name] = row.get(name, 0.0) + amount


class Ledger:
    """This gateway's part of the ledger, and the way to all of it."""

    def __init__(self, retention_days: int, store: RedisStore | None, prefix: str) -> None:
        self.retention_days = retention_days
        self.store = store
        self.prefix = prefix
        self._flush = store.script(_FLUSH) if store is not None else None
        #: Rows not yet in Redis (all rows, without Redis).
        self.rows: Rows = {}
        #: A batch sent and not yet known applied: (its id, its rows).
        self.batch: tuple[str, Rows] | None = None
        self._gateway = secrets.token_hex(6)
        self._count = 0
        #: Totals since start, by (team, model): the Prometheus counters.
        self.totals: dict[tuple[str, str], dict[str, float]] = {}
        #: Whether the last flush reached Redis.
        self.redis_up = store is not None

    def record(
        self,
        team: str,
        model: str,
        key_id: str | None,
        prompt: int,
        completion: int,
        spend: float,
        outcome: str | None,
        now: float | None = None,
        *,
        cached: int = 0,
    ) -> None:
        """Counts one request: what the engine counted of it (`cached`: of its
        `prompt` tokens, those the engine's prefix cache held), and how it ended."""
        # added in place, into its row and its totals: every request passes here
        where = (day_of(time.time() if now is None else now), team, model, key_id or NO_KEY)
        row = self.rows.get(where)
        if row is None:
            row = self.rows[where] = dict.fromkeys(AMOUNTS, 0.0)
        total = self.totals.get((team, model))
        if total is None:
            total = self.totals[team, model] = dict.fromkeys(AMOUNTS, 0.0)
        for amounts in (row, total):
            amounts["prompt_tokens"] += prompt
            amounts["cached_tokens"] += cached
            amounts["completion_tokens"] += completion
            amounts["requests"] += 1.0
            amounts["spend"] += spend
        if outcome is not None and (field := _OUTCOME_FIELDS.get(outcome)) is not None:
            row[field] = row.get(field, 0.0) + 1.0

    # -- Redis ----------------------------------------------------------------------

    def _day_key(self, day: str) -> str:
        return f"{self.prefix}:usage:{{usage}}:{day}"

    async def flush(self) -> None:
        """Sends the rows gathered (and first any batch not known applied) to Redis."""
        if self._flush is None:
            self._expire_local()
            return
        try:
            if self.batch is not None:
                await self._send(*self.batch)
                self.batch = None
            if self.rows:
                self._count += 1
                self.batch = (f"{self._gateway}:{self._count}", self.rows)
                self.rows = {}
                await self._send(*self.batch)
                self.batch = None
        except STORE_FAILURES as error:
            if self.redis_up:
                log.warning(
                    "usage ledger (Redis) failed (%s: %s): keeping its rows until it answers",
                    type(error).__name__,
                    error,
                )
            self.redis_up = False
            return
        if not self.redis_up:
            log.info("usage ledger (Redis) answers: rows kept meanwhile sent")
        self.redis_up = True

    async def _send(self, batch_id: str, rows: Rows) -> None:
        assert self._flush is not None and self.store is not None
        days = sorted({day for day, *_ in rows})
        index = {day: i + 1 for i, day in enumerate(days)}
        keys = [f"{self.prefix}:usage:{{usage}}:batch:{batch_id}"]
        keys += [self._day_key(day) for day in days]
        args: list[str | float | int] = [86_400_000]
        for day in days:
            ends = datetime.strptime(day, "%Y-%m-%d").replace(tzinfo=UTC)
            ends += timedelta(days=self.retention_days + 1)
            args.append(int(ends.timestamp() * 1000))
        for (day, team, model, key_id), row in rows.items():
            field = _SEP.join((team, model, key_id))
            for name, amount in row.items():
                args += [index[day], f"{field}{_SEP}{name}", repr(amount)]
        async with self.store.bounded():
            await self._flush(keys=keys, args=args)

    def _expire_local(self) -> None:
        oldest = day_of(time.time() - self.retention_days * 86_400)
        for where in [w for w in self.rows if w[0] < oldest]:
            del self.rows[where]

    # -- reading --------------------------------------------------------------------

    async def query(
        self, team: str | None, model: str | None, first: date, last: date
    ) -> list[dict[str, str | float]]:
        """The rows of days `first`..`last` (UTC, both included), of `team` and `model`
        when given, in order. With Redis, every replica's rows (this gateway's sent
        first); raises OSError or TimeoutError when Redis does not answer."""
        rows: Rows = {}
        days = [(first + timedelta(days=i)).isoformat() for i in range((last - first).days + 1)]
        if self.store is not None:
            await self.flush()
            if not self.redis_up:
                raise ConnectionError("the usage ledger (Redis) does not answer")
            pipe = self.store.client.pipeline(transaction=False)
            for day in days:
                pipe.hgetall(self._day_key(day))
            async with self.store.bounded():
                answers = await pipe.execute()
            for day, fields in zip(days, answers, strict=True):
                for raw, amount in fields.items():
                    team_name, model_name, key_id, name = raw.decode().split(_SEP)
                    _add(rows, (day, team_name, model_name, key_id), {name: float(amount)})
        else:
            wanted = set(days)
            rows = {w: dict(r) for w, r in self.rows.items() if w[0] in wanted}
        selected = sorted(
            w for w in rows if (team is None or w[1] == team) and (model is None or w[2] == model)
        )
        return [_row(w, rows[w]) for w in selected]


def _row(where: tuple[str, str, str, str], amounts: dict[str, float]) -> dict[str, str | float]:
    day, team, model, key_id = where
    row: dict[str, str | float] = {"day": day, "team": team, "model": model, "key_id": key_id}
    for name in FIELDS:
        amount = amounts.get(name, 0.0)
        row[name] = amount if name == "spend" else round(amount)
    return row


def to_csv(rows: Iterable[dict[str, str | float]]) -> str:
    """The rows as CSV, with a header line of `COLUMNS`."""
    out = io.StringIO()
    writer = csv.DictWriter(out, COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()
