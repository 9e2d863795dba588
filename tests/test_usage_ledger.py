"""The usage ledger (gateway.teams.usage): rows per team x model x key id x day
in process and in a real Redis shared by two replicas, a flush that stalls and
is sent again counted once, retention, its CSV, and the prompt's cached tokens
(read as 0 from rows an older gateway wrote without them)."""

from __future__ import annotations

import asyncio
import csv
import io
from datetime import UTC, datetime, timedelta

from gateway.teams.redis_store import RedisStore
from gateway.teams.usage import COLUMNS, Ledger, to_csv
from tests.support.redis_server import RedisServer

TODAY = datetime.now(UTC).replace(hour=12, minute=0, second=0, microsecond=0)
NOON = TODAY.timestamp()
DAY = TODAY.date()


def test_rows_add_up_per_team_model_key_and_day_in_process() -> None:
    ledger = Ledger(30, None, "t")
    ledger.record("alpha", "m", "k1", 10, 5, 0.5, "completed", NOON)
    ledger.record("alpha", "m", "k1", 3, 0, 0.0, "client_gone", NOON)
    ledger.record("alpha", "m", None, 1, 1, 0.0, "completed", NOON)
    ledger.record("beta", "m", "k2", 7, 7, 0.0, "completed", NOON)
    ledger.record("alpha", "m", "k1", 100, 100, 0.0, "completed", NOON + 86_400)
    rows = asyncio.run(ledger.query("alpha", None, DAY, DAY))
    assert [
        (r["key_id"], r["prompt_tokens"], r["completion_tokens"], r["requests"]) for r in rows
    ] == [
        ("-", 1, 1, 1),
        ("k1", 13, 5, 2),
    ]
    assert rows[1]["outcome_completed"] == 1 and rows[1]["outcome_client_gone"] == 1
    assert rows[1]["spend"] == 0.5
    assert all(set(row) == set(COLUMNS) for row in rows)
    parsed = list(csv.DictReader(io.StringIO(to_csv(rows))))
    assert [row["prompt_tokens"] for row in parsed] == ["1", "13"]


def test_two_replicas_write_one_ledger_in_redis(redis_server: RedisServer) -> None:
    async def main() -> list[dict[str, str | float]]:
        stores = [RedisStore(redis_server.url, 1.0, "t") for _ in range(2)]
        one, two = (Ledger(30, store, "t") for store in stores)
        for i in range(50):
            (one if i % 2 else two).record("alpha", "m", "k", 2, 3, 0.0, "completed", NOON)
        await one.flush()
        rows = await two.query("alpha", "m", DAY, DAY)  # flushes its own first
        for store in stores:
            await store.close()
        return rows

    rows = asyncio.run(main())
    assert len(rows) == 1
    assert (rows[0]["prompt_tokens"], rows[0]["completion_tokens"], rows[0]["requests"]) == (
        100,
        150,
        50,
    )


def test_a_flush_that_stalls_is_kept_and_counted_once(redis_server: RedisServer) -> None:
    async def main() -> list[dict[str, str | float]]:
        store = RedisStore(redis_server.url, 0.2, "t")
        ledger = Ledger(30, store, "t")
        ledger.record("alpha", "m", "k", 5, 5, 0.0, "completed", NOON)
        redis_server.stall()
        try:
            await ledger.flush()  # times out: Redis runs it once it resumes
            assert not ledger.redis_up and ledger.batch is not None
            ledger.record("alpha", "m", "k", 1, 1, 0.0, "completed", NOON)
        finally:
            redis_server.resume()
        await ledger.flush()  # the same batch again (applied once), then the new rows
        assert ledger.redis_up and ledger.batch is None and not ledger.rows
        rows = await ledger.query("alpha", None, DAY, DAY)
        await store.close()
        return rows

    rows = asyncio.run(main())
    assert (rows[0]["prompt_tokens"], rows[0]["requests"]) == (6, 2)


def test_days_past_retention_expire(redis_server: RedisServer) -> None:
    async def main() -> int:
        store = RedisStore(redis_server.url, 1.0, "t")
        ledger = Ledger(2, store, "t")
        ledger.record("alpha", "m", "k", 1, 1, 0.0, "completed", NOON)
        await ledger.flush()
        ttl = int(await store.client.pexpiretime(f"t:usage:{{usage}}:{DAY.isoformat()}"))
        await store.close()
        return ttl

    ends = datetime.combine(DAY + timedelta(days=3), datetime.min.time(), UTC).timestamp() * 1000
    assert asyncio.run(main()) == ends


def test_cached_tokens_add_up_beside_the_prompts_in_process_and_csv() -> None:
    ledger = Ledger(30, None, "t")
    ledger.record("alpha", "m", "k1", 40, 2, 0.0, "completed", NOON)
    ledger.record("alpha", "m", "k1", 40, 2, 0.0, "completed", NOON, cached=37)
    ledger.record("alpha", "m", "k2", 5, 1, 0.0, "completed", NOON)
    rows = asyncio.run(ledger.query("alpha", None, DAY, DAY))
    assert [(r["key_id"], r["prompt_tokens"], r["cached_tokens"]) for r in rows] == [
        ("k1", 80, 37),
        ("k2", 5, 0),
    ]
    assert ledger.totals["alpha", "m"]["cached_tokens"] == 37
    assert COLUMNS.index("cached_tokens") == COLUMNS.index("prompt_tokens") + 1
    parsed = list(csv.DictReader(io.StringIO(to_csv(rows))))
    assert [row["cached_tokens"] for row in parsed] == ["37", "0"]


def test_cached_tokens_reach_redis_and_rows_written_without_them_read_zero(
    redis_server: RedisServer,
) -> None:
    """A day's hash an older gateway wrote (no `cached_tokens` field) reads whole, its
    cached tokens 0, and a newer gateway's rows add theirs beside it."""

    async def main() -> list[dict[str, str | float]]:
        store = RedisStore(redis_server.url, 1.0, "t")
        old = {"prompt_tokens": 10, "completion_tokens": 4, "requests": 1, "outcome_completed": 1}
        await store.client.hset(
            f"t:usage:{{usage}}:{DAY.isoformat()}",
            mapping={f"alpha|m|old|{name}": amount for name, amount in old.items()},
        )
        ledger = Ledger(30, store, "t")
        ledger.record("alpha", "m", "new", 40, 2, 0.0, "completed", NOON, cached=37)
        rows = await ledger.query("alpha", "m", DAY, DAY)  # flushes its own first
        await store.close()
        return rows

    rows = asyncio.run(main())
    by_key = {r["key_id"]: r for r in rows}
    assert set(by_key["old"]) == set(COLUMNS)
    assert (by_key["old"]["prompt_tokens"], by_key["old"]["cached_tokens"]) == (10, 0)
    assert by_key["old"]["outcome_completed"] == 1 and by_key["old"]["spend"] == 0.0
    assert (by_key["new"]["prompt_tokens"], by_key["new"]["cached_tokens"]) == (40, 37)
