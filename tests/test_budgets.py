"""Budgets over calendar windows (gateway.teams.budgets): the windows' bounds,
reserve-then-settle held exactly by two replicas sharing a real Redis, the
store failing open or closed, and the whole path through real gateways: 429
`budget_exceeded` with Retry-After, streams cut by their clients, settlement to
what the engine counted, the ledger equal to what the clients received."""

from __future__ import annotations

import asyncio
import random
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import httpx
import orjson
import pytest
import redis

from gateway.config import BudgetConfig, parse_config
from gateway.protocol import errors
from gateway.teams.accounts import key_id
from gateway.teams.budgets import Budgets, window_of
from gateway.teams.redis_store import RedisStore
from gateway.teams.team import Team
from tests.support.keys import bearer, keyed, new_key
from tests.support.redis_server import RedisServer
from tests.support.waiting import HANG_GUARD, wait_until


def key_id_of(key: str) -> str:
    return str(key_id([(b"authorization", f"Bearer {key}".encode())]))


def at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


def test_windows_are_utc_calendar_days_and_months_from_their_start() -> None:
    day = BudgetConfig("day", tokens=1)
    assert window_of(day, at("2026-12-01T23:59:59")) == ("2026-12-01", at("2026-12-02T00:00:00"))
    late = BudgetConfig("day", tokens=1, start_hour=6)
    assert window_of(late, at("2026-12-01T05:00:00")) == ("2026-11-30", at("2026-12-01T06:00:00"))
    month = BudgetConfig("month", tokens=1)
    assert window_of(month, at("2026-12-31T12:00:00")) == ("2026-12-01", at("2027-01-01T00:00:00"))
    billing = BudgetConfig("month", tokens=1, start_day=15)
    assert window_of(billing, at("2026-01-10T00:00:00")) == (
        "2025-12-15",
        at("2026-01-15T00:00:00"),
    )


def config(**raw: Any) -> Any:
    base = {"models": [{"name": "m", "workers": ["127.0.0.1:1"]}], **raw}
    return parse_config(base, env={})


def team(budgets: list[dict[str, Any]], name: str = "alpha") -> Team:
    cfg = config(teams={name: {"budgets": budgets}})
    return Team(cfg.teams[0])


async def race(replicas: list[Budgets], alpha: Team, requests: int) -> tuple[int, float]:
    """`requests` concurrent reservations of 100 tokens spread over the replicas, each
    settled to a random usage at most its reservation: (admitted, tokens used)."""
    admitted, used = 0, 0.0

    async def one(i: int) -> None:
        nonlocal admitted, used
        budgets = replicas[i % len(replicas)]
        try:
            held = await budgets.reserve(alpha, None, "m", 40, 60)
        except errors.BudgetExceeded:
            return
        assert held is not None
        admitted += 1
        await asyncio.sleep(random.uniform(0, 0.01))
        prompt, completion = 40, random.randint(0, 60)
        used += prompt + completion
        await budgets.settle(held, prompt, completion)

    await asyncio.gather(*(one(i) for i in range(requests)))
    return admitted, used


def test_two_replicas_sharing_redis_admit_exactly_what_fits(
    redis_server: RedisServer,
) -> None:
    alpha = team([{"window": "day", "tokens": 5000}])
    cfg = config(redis_url=redis_server.url)

    async def main() -> tuple[int, float, float]:
        # 200 calls at once open as many connections: a generous timeout on a busy machine
        stores = [RedisStore(redis_server.url, 10.0, "t") for _ in range(2)]
        replicas = [Budgets(cfg, store) for store in stores]
        admitted, used = await race(replicas, alpha, 200)
        meter = replicas[0].meters(alpha, None, datetime.now(UTC).timestamp())[0]
        counter = float(await stores[0].client.get(meter.key) or 0)
        for store in stores:
            await store.close()
        return admitted, used, counter

    admitted, used, counter = asyncio.run(main())
    # every reservation is 100 and the budget 5000, settled only after all raced: at
    # most 50 fit, and at least 50 (refunds only make room)
    assert admitted >= 50
    assert counter == pytest.approx(used)
    assert used <= 5000


def test_replicas_sharing_redis_grant_requests_with_no_bound_only_what_fits(
    redis_server: RedisServer,
) -> None:
    """Requests with no bound at once on two replicas: each granted what is left when its
    turn comes, and together never more than the budget."""
    alpha = team([{"window": "day", "tokens": 1000}])
    cfg = config(redis_url=redis_server.url)

    async def main() -> tuple[list[int | None], float]:
        stores = [RedisStore(redis_server.url, 10.0, "t") for _ in range(2)]
        replicas = [Budgets(cfg, store) for store in stores]

        async def one(i: int) -> int | None:
            try:
                held = await replicas[i % 2].reserve(alpha, None, "m", 10, 4086, unbounded=True)
            except errors.BudgetExceeded:
                return None
            assert held is not None
            return held.completion

        granted = await asyncio.gather(*(one(i) for i in range(12)))
        meter = replicas[0].meters(alpha, None, datetime.now(UTC).timestamp())[0]
        counter = float(await stores[0].client.get(meter.key) or 0)
        for store in stores:
            await store.close()
        return list(granted), counter

    granted, counter = asyncio.run(main())
    served = [g for g in granted if g is not None]
    assert served and counter == sum(g + 10 for g in served) <= 1000


def test_the_local_store_admits_no_more_than_fits() -> None:
    alpha = team([{"window": "day", "tokens": 5000}, {"window": "month", "tokens": 10**6}])
    budgets = Budgets(config(), None)
    admitted, used = asyncio.run(race([budgets], alpha, 200))
    assert admitted >= 50
    assert sorted(budgets.used.values()) == [pytest.approx(used)] * 2


def test_a_refusal_names_the_window_and_when_it_resets() -> None:
    alpha = team([{"window": "day", "tokens": 100}])
    budgets = Budgets(config(), None)

    async def main() -> errors.BudgetExceeded:
        held = await budgets.reserve(alpha, None, "m", 50, 50)
        assert held is not None
        with pytest.raises(errors.BudgetExceeded) as refused:
            await budgets.reserve(alpha, None, "m", 1, 0)
        await budgets.settle(held, 10, 20)  # 70 refunded
        assert await budgets.reserve(alpha, None, "m", 30, 40) is not None
        return refused.value

    refused = asyncio.run(main())
    assert "day budget of team `alpha`" in refused.message
    assert "resets at" in refused.message
    assert 1 <= refused.retry_after <= 86_400
    assert refused.reason == "budget_exceeded"


def test_spend_budgets_weigh_tokens_by_the_models_prices() -> None:
    cfg = config(
        models=[
            {"name": "m", "workers": ["127.0.0.1:1"], "prices": {"prompt": 1, "completion": 3}}
        ],
        teams={"alpha": {"budgets": [{"window": "month", "spend": 0.01}]}},
    )
    alpha = Team(cfg.teams[0])
    budgets = Budgets(cfg, None)

    async def main() -> None:
        # 1,000 prompt + 3,000 completion tokens: 0.001 + 0.009 = the whole budget
        held = await budgets.reserve(alpha, None, "m", 1000, 3000)
        assert held is not None
        with pytest.raises(errors.BudgetExceeded, match=r"0\.01 spend"):
            await budgets.reserve(alpha, None, "m", 1, 0)

    asyncio.run(main())


def test_a_reservation_moves_to_a_fallbacks_prices_only_if_it_fits() -> None:
    cfg = config(
        models=[
            {"name": "cheap", "workers": ["127.0.0.1:1"], "prices": {"prompt": 1}},
            {"name": "dear", "workers": ["127.0.0.1:1"], "prices": {"prompt": 4}},
            {"name": "dearer", "workers": ["127.0.0.1:1"], "prices": {"prompt": 20}},
        ],
        teams={"alpha": {"budgets": [{"window": "day", "spend": 0.01, "tokens": 5000}]}},
    )
    alpha = Team(cfg.teams[0])
    budgets = Budgets(cfg, None)

    async def main() -> None:
        held = await budgets.reserve(alpha, None, "cheap", 1000, 0)  # 0.001 spent
        assert held is not None
        with pytest.raises(errors.BudgetExceeded, match="spend"):
            await budgets.reprice(held, "dearer")  # 0.02: no room
        assert sorted(budgets.used.values()) == [0.001, 1000]  # unchanged
        await budgets.reprice(held, "dear")  # 0.004: room
        assert sorted(budgets.used.values()) == [pytest.approx(0.004), 1000]
        await budgets.settle(held, 500, 0)  # settled at the prices of the model that served
        assert sorted(budgets.used.values()) == [pytest.approx(0.002), 500]

    asyncio.run(main())


def test_a_key_budget_counts_that_key_alone() -> None:
    alpha = team([{"window": "day", "tokens": 100, "key": "abcdef01"}])
    budgets = Budgets(config(), None)

    async def main() -> None:
        assert await budgets.reserve(alpha, "abcdef01ffff", "m", 100, 0) is not None
        with pytest.raises(errors.BudgetExceeded, match="key abcdef01"):
            await budgets.reserve(alpha, "abcdef01ffff", "m", 1, 0)
        assert await budgets.reserve(alpha, "0123456789ab", "m", 1000, 0) is not None

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_redis_down_mid_window_fails_as_configured(redis_server: RedisServer, mode: str) -> None:
    alpha = team([{"window": "day", "tokens": 1000}])
    cfg = config(redis_url=redis_server.url, budget_store_failure=mode)

    async def main() -> None:
        store = RedisStore(redis_server.url, 0.2, "t")
        budgets = Budgets(cfg, store)
        held = await budgets.reserve(alpha, None, "m", 100, 100)
        assert held is not None
        redis_server.stall()
        try:
            if mode == "closed":
                with pytest.raises(errors.Busy) as refused:
                    await budgets.reserve(alpha, None, "m", 100, 0)
                assert refused.value.reason == "budget_store_down"
            else:  # counts on from the shared figure it last saw: 200 of 1000
                kept = [await budgets.reserve(alpha, None, "m", 100, 100) for _ in range(4)]
                with pytest.raises(errors.BudgetExceeded):
                    await budgets.reserve(alpha, None, "m", 100, 100)
                for one in kept:
                    assert one is not None
                    await budgets.settle(one, 50, 50)  # 400 refunded
            await budgets.settle(held, 100, 0)  # 100 refunded, kept to add later
        finally:
            redis_server.resume()
        for _ in range(100):  # the tick's probe, until Redis answers again
            await budgets.probe()
            if budgets.redis_up:
                break
            await asyncio.sleep(0.1)
        assert budgets.redis_up and not budgets.unsynced and not budgets.uncertain
        meter = budgets.meters(alpha, None, datetime.now(UTC).timestamp())[0]
        counter = float(await store.client.get(meter.key) or 0)
        # caught up once: what was counted meanwhile is in Redis, nothing twice
        assert counter == (100 if mode == "closed" else 100 + 4 * 100)
        await store.close()

    asyncio.run(main())


# -- through real gateways ---------------------------------------------------------------

#: 25 characters: a prompt estimated at 7 tokens, which the demo engine counts as 4 words.
PROMPT = "alpha bravo charlie delta"
#: What each request reserves: its estimate, and `max_tokens`.
RESERVED = 7 + 8


def _stream_body() -> dict[str, Any]:
    return {
        "model": "furnace-slow",
        "prompt": PROMPT,
        "max_tokens": 8,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def _one_stream(client: httpx.AsyncClient, url: str, key: str, cut: bool) -> tuple[str, Any]:
    """('refused', the 429), ('cut', text tokens read), or ('whole', the usage)."""
    async with client.stream(
        "POST", url + "/v1/completions", json=_stream_body(), headers=bearer(key)
    ) as response:
        if response.status_code == 429:
            return "refused", (response.headers, orjson.loads(await response.aread()))
        assert response.status_code == 200, await response.aread()
        read, usage = 0, None
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = orjson.loads(line[6:])
            read += sum(1 for choice in chunk["choices"] if choice.get("text"))
            usage = chunk.get("usage") or usage
            if cut and read >= 2:
                return "cut", read
        return "whole", usage


def _usage_rows(admin_url: str, **params: str) -> list[dict[str, Any]]:
    """The ledger's rows. Its 503 `usage_store_unavailable` says "retry shortly": on a
    busy machine a Redis call can pass `redis_timeout` (0.25 s), and the route is asked
    again then, as a client would."""
    answers: list[httpx.Response] = []

    def answered() -> bool:
        answer = httpx.get(admin_url + "/admin/usage", params=params, timeout=HANG_GUARD)
        if answer.status_code == 503 and "usage_store_unavailable" in answer.text:
            return False
        answers.append(answer)
        return True

    wait_until(answered, "the usage ledger to answer")
    (answer,) = answers
    assert answer.status_code == 200, answer.text
    rows: list[dict[str, Any]] = answer.json()["data"]
    return rows


def test_a_budget_holds_across_two_gateways_sharing_redis_with_streams_cut(
    redis_server: RedisServer, gateway_with: Any
) -> None:
    """80 concurrent streams against a day budget that admits ~50 of them, over two
    gateways sharing Redis, every fourth cut by its client after two tokens: the window
    ends within its budget, the ledger's rows equal what the clients received (the cut
    ones: their prompts, and between what they read and their `max_tokens`), and the
    budget's counter equals the ledger."""
    whole, cutter = new_key("alpha"), new_key("alpha")
    budget = 50 * RESERVED
    overrides = keyed(
        {"alpha": {"budgets": [{"window": "day", "tokens": budget}]}},
        {whole: "alpha", cutter: "alpha"},
        redis_url=redis_server.url,
    )
    gateways = [gateway_with(**overrides, admin_port=0) for _ in range(2)]

    async def run() -> list[tuple[str, Any]]:
        async with httpx.AsyncClient(timeout=HANG_GUARD) as client:
            return await asyncio.gather(
                *(
                    _one_stream(
                        client, gateways[i % 2].url, cutter if i % 4 == 3 else whole, i % 4 == 3
                    )
                    for i in range(80)
                )
            )

    results = asyncio.run(run())
    refused = [r for kind, r in results if kind == "refused"]
    cut = [r for kind, r in results if kind == "cut"]
    served = [r for kind, r in results if kind == "whole"]
    assert refused and served and cut
    for headers, body in refused:
        assert body["error"]["code"] == "budget_exceeded"
        assert "day budget of team `alpha`" in body["error"]["message"]
        assert 1 <= int(headers["retry-after"]) <= 86_400
        assert "x-furnace-budget-remaining-tokens-day" in headers
    assert len(served) + len(cut) >= 50

    admin = gateways[0].admin_url
    assert admin is not None
    ids = {key_id_of(whole): "whole", key_id_of(cutter): "cut"}

    def settled() -> bool:
        rows = _usage_rows(admin, team="alpha")
        counts = {ids[r["key_id"]]: r["requests"] for r in rows}
        return counts == {"whole": len(served), "cut": len(cut)}

    wait_until(settled, "every admitted request settled in the ledger")
    rows = {ids[r["key_id"]]: r for r in _usage_rows(admin, team="alpha", format="json")}
    assert rows["whole"]["prompt_tokens"] == sum(u["prompt_tokens"] for u in served)
    assert rows["whole"]["completion_tokens"] == sum(u["completion_tokens"] for u in served)
    assert rows["whole"]["outcome_completed"] == len(served)
    assert rows["cut"]["prompt_tokens"] == 4 * len(cut)
    assert sum(cut) <= rows["cut"]["completion_tokens"] <= 8 * len(cut)
    total = sum(r["prompt_tokens"] + r["completion_tokens"] for r in rows.values())
    assert total <= budget
    counter = redis.Redis.from_url(redis_server.url)
    key = next(iter(counter.scan_iter("furnace:budget:{alpha}:tokens:day:*")))
    assert float(counter.get(key) or 0) == total
    counter.close()
    csv_text = httpx.get(
        admin + "/admin/usage", params={"team": "alpha", "format": "csv"}, timeout=HANG_GUARD
    ).text
    assert csv_text.count("\n") == 3  # a header and the two rows


def test_usage_query_refuses_bad_parameters_by_name(gateway_with: Any) -> None:
    gw = gateway_with(admin_port=0)
    for params, name in (
        ({"format": "xml"}, "format"),
        ({"from": "yesterday"}, "from"),
        ({"from": "2026-02-01", "to": "2026-01-01"}, "from"),
        ({"from": "2020-01-01", "to": "2026-01-01"}, "from"),
        ({"teams": "alpha"}, "teams"),
    ):
        answer = httpx.get(gw.admin_url + "/admin/usage", params=params, timeout=HANG_GUARD)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == name
    message = answer.json()["error"]["message"]  # an unknown one: the known ones listed
    assert message.endswith("known: team, model, from, to, format."), message


def test_budget_store_down_closed_refuses_with_503_and_open_serves(
    redis_server: RedisServer, gateway_with: Any
) -> None:
    key = new_key("alpha")
    gateways = {
        mode: gateway_with(
            **keyed(
                {"alpha": {"budgets": [{"window": "month", "tokens": 10**6}]}},
                {key: "alpha"},
                redis_url=redis_server.url,
                budget_store_failure=mode,
                redis_timeout=0.2,
            )
        )
        for mode in ("open", "closed")
    }
    redis_server.stop()
    with httpx.Client(timeout=HANG_GUARD) as client:
        for mode, gw in gateways.items():
            answer = client.post(
                gw.url + "/v1/completions", json={"prompt": "a b"}, headers=bearer(key)
            )
            if mode == "open":
                assert answer.status_code == 200, answer.text
            else:
                assert answer.status_code == 503, answer.text
                assert answer.json()["error"]["code"] == "server_busy"


def test_a_request_with_no_bound_is_granted_what_fits() -> None:
    """No `max_tokens`: the rest of the model's context is reserved, or half of it, and so
    on, and the first that fits is the request's bound (`granted`); a bounded request is
    refused as before; one token that does not fit is a refusal."""
    alpha = team([{"window": "day", "tokens": 1000}])
    budgets = Budgets(config(), None)

    async def main() -> None:
        held = await budgets.reserve(alpha, None, "m", 10, 4086, unbounded=True)
        assert held is not None and held.granted == 510  # 4086 → 2043 → 1021 → 510
        assert held.completion == 510 and budgets.used == {held.meters[0].key: 520}
        roomy = await budgets.reserve(alpha, None, "m", 10, 300, unbounded=True)
        assert roomy is not None and roomy.granted is None  # all it asked fits
        with pytest.raises(errors.BudgetExceeded):
            await budgets.reserve(alpha, None, "m", 10, 400)  # a bound of its own: no grant
        whole = await budgets.reserve(alpha, None, "m", 10, 100, unbounded=True)  # 170 left
        half = await budgets.reserve(alpha, None, "m", 10, 100, unbounded=True)  # 60 left
        assert whole is not None and whole.granted is None
        assert half is not None and half.granted == 50
        with pytest.raises(errors.BudgetExceeded):  # none left: not the prompt and one token
            await budgets.reserve(alpha, None, "m", 10, 100, unbounded=True)

    asyncio.run(main())


def test_an_answer_with_no_bound_stops_where_the_budget_does(gateway_with: Any) -> None:
    """A completion with no `max_tokens` that would write to the end of the context
    (`ignore_eos`) is cut at what its team's budget had room for (finish `length`), and
    the day's usage stays within the budget; a count reserves no answer at all."""
    key = new_key("alpha")
    gw = gateway_with(
        **keyed({"alpha": {"budgets": [{"window": "day", "tokens": 20}]}}, {key: "alpha"})
    )
    body = {"model": "furnace-demo", "prompt": PROMPT, "ignore_eos": True}
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        ask = {"model": "furnace-demo", "prompt": PROMPT}
        count = client.post("/tokenize", json=ask, headers=bearer(key))
        assert count.status_code == 200, count.text  # admitted: it reserves its prompt alone
        answer = client.post("/v1/completions", json=body, headers=bearer(key))
        assert answer.status_code == 200, answer.text
        choice, usage = answer.json()["choices"][0], answer.json()["usage"]
        # the estimate (7) and 4089 halved until it fits 20: 7 tokens granted
        assert choice["finish_reason"] == "length" and usage["completion_tokens"] == 7
    used = gw.state.teams.accounts.budgets.used
    assert list(used.values()) == [usage["prompt_tokens"] + 7] and usage["total_tokens"] <= 20


def test_what_a_request_with_no_bound_reserves() -> None:
    """The rest of its model's context, or what its team's minute granted a choice if
    that is less, for each choice; nothing where neither is known."""
    from gateway.protocol.types import GenerateRequest
    from gateway.teams.accounts import reservation_of

    one = GenerateRequest("m", prompt=PROMPT)  # estimated at 7 tokens
    assert reservation_of(one, 4096) == (7, 4089, True)
    assert reservation_of(one, 4096, granted=100) == (7, 100, True)
    assert reservation_of(one, None, granted=100) == (7, 100, True)
    assert reservation_of(one) == (7, 0, False)
    assert reservation_of(GenerateRequest("m", prompt=PROMPT, n=2), 4096) == (7, 2 * 4089, True)
    bounded = GenerateRequest("m", prompt=PROMPT, sampling=replace(one.sampling, max_tokens=5))
    assert reservation_of(bounded, 4096, granted=100) == (7, 5, False)
