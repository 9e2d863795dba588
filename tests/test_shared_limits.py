"""Teams' limits in a real Redis, shared by gateway replicas (real `serve`
processes), and what happens when Redis goes away and comes back."""

import logging
import signal
import time
from pathlib import Path

import httpx
import redis
import yaml

from tests.support.keys import ask, assert_rate_limited, bearer, keyed, new_key, sha256
from tests.support.processes import free_port, running, wait_ready
from tests.support.requests import opened
from tests.support.scripted_worker import SCRIPTED_MODEL, script
from tests.support.waiting import HANG_GUARD, wait_until


def store_up(admin_url: str) -> float | None:
    for line in httpx.get(admin_url + "/metrics", timeout=HANG_GUARD).text.splitlines():
        if line.startswith('furnace_gateway_limits_store_up{store="redis"}'):
            return float(line.split()[-1])
    return None


def replicas(tmp_path: Path, config: dict) -> tuple[list[str], list[str], list[Path]]:
    """Two gateways' config files on `config`, each with its ports: their URLs, their
    admin URLs and the files."""
    urls, admins, paths = [], [], []
    for name in ("one", "two"):
        port, admin_port = free_port(), free_port()
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({**config, "port": port, "admin_port": admin_port}))
        urls.append(f"http://127.0.0.1:{port}")
        admins.append(f"http://127.0.0.1:{admin_port}")
        paths.append(path)
    return urls, admins, paths


def test_two_gateway_processes_enforce_one_limit_through_redis(
    redis_server, workers, tmp_path: Path
):
    shared, other = new_key("shared"), new_key("other")
    teams = {"shared": {"requests_per_minute": 4}, "other": {}}
    config = {
        "host": "127.0.0.1",
        "log_level": "warning",
        "redis_url": redis_server.url,
        "models": [{"name": "furnace-demo", "workers": [workers.demo.address]}],
        "teams": teams,
        "keys": [
            {"sha256": sha256(shared), "team": "shared"},
            {"sha256": sha256(other), "team": "other"},
        ],
    }
    urls, admins, paths = replicas(tmp_path, config)
    with (
        running("serve", "--config", str(paths[0])) as one,
        running("serve", "--config", str(paths[1])) as two,
        httpx.Client(timeout=HANG_GUARD) as client,
    ):
        wait_ready(urls[0], one)
        wait_ready(urls[1], two)
        assert [store_up(admin) for admin in admins] == [1.0, 1.0]

        def ask_at(url: str, key: str) -> httpx.Response:
            return client.post(url + "/v1/completions", json={"prompt": "a b"}, headers=bearer(key))

        # one limit of 4 for both: each gateway sees the other's requests
        remaining = []
        for url in (*urls, *urls):
            response = ask_at(url, shared)
            assert response.status_code == 200
            remaining.append(response.headers["x-ratelimit-remaining-requests"])
        assert remaining == ["3", "2", "1", "0"]
        for url in urls:
            assert_rate_limited(ask_at(url, shared), "requests per minute")
            assert ask_at(url, other).status_code == 200

        # Redis goes away: both keep serving on their local limits, and say so
        redis_server.stop()
        for url in urls:
            assert ask_at(url, other).status_code == 200
            assert ask_at(url, shared).status_code == 429  # the last shared usage, kept
        for admin in admins:
            wait_until(lambda a=admin: store_up(a) == 0.0, "the metric to say Redis is down")

        # Redis comes back (empty): the gateways go back to it, and share again
        redis_server.start()
        for admin in admins:
            wait_until(lambda a=admin: store_up(a) == 1.0, "the metric to say Redis is back")
        statuses = [ask_at(url, shared).status_code for url in (*urls, *urls, *urls)]
        assert statuses == [200, 200, 200, 200, 429, 429]


def test_a_killed_replica_s_requests_stop_counting_once_their_leases_expire(
    redis_server, workers, tmp_path: Path
):
    # one concurrent request for the team, on either gateway; a lease lives 2 s
    key = new_key("search")
    config = {
        "host": "127.0.0.1",
        "log_level": "warning",
        "redis_url": redis_server.url,
        "redis_lease_ttl": 2,
        "models": [{"name": SCRIPTED_MODEL, "workers": [workers.scripted.address]}],
        "teams": {"search": {"max_concurrent_requests": 1}},
        "keys": [{"sha256": sha256(key), "team": "search"}],
    }
    urls, _, paths = replicas(tmp_path, config)
    hold = {"model": SCRIPTED_MODEL, "prompt": script(texts=1, hang="after"), "stream": True}
    quick = {"model": SCRIPTED_MODEL, "prompt": script(texts=1)}
    with (
        running("serve", "--config", str(paths[0]), returncode=-signal.SIGKILL) as one,
        running("serve", "--config", str(paths[1])) as two,
        httpx.Client(timeout=HANG_GUARD) as client,
        httpx.Client(base_url=urls[1], timeout=HANG_GUARD) as other,
    ):
        wait_ready(urls[0], one)
        wait_ready(urls[1], two)
        with client.stream(
            "POST", urls[0] + "/v1/completions", json=hold, headers=bearer(key)
        ) as held_stream:
            held = opened(held_stream)
            time.sleep(2.5)  # past a lease's first life: it is held by its renewals
            assert_rate_limited(ask(other, key, **quick), "concurrent requests")
            one.kill()  # no drain: its lease stays in Redis, unrenewed
            one.wait(timeout=HANG_GUARD)
            assert_rate_limited(ask(other, key, **quick), "concurrent requests")
            # the lease's 2 s, not the 30 s leases lived before they could be set
            wait_until(
                lambda: ask(other, key, **quick).status_code == 200,
                "the lease to expire",
                timeout=10,
            )
            del held


def test_tokens_and_concurrency_are_shared_and_a_lost_redis_is_logged(
    gateway_with, redis_server, caplog
):
    caplog.set_level(logging.INFO, logger="furnace.limits")
    key = new_key("search")
    teams = {"search": {"tokens_per_minute": 60}}
    settings = keyed(teams, {key: "search"}, redis_url=redis_server.url, redis_timeout=0.5)
    one, two = gateway_with(**settings), gateway_with(**settings)
    ten_words = "alpha beta gamma delta epsilon zeta theta iota kappa lambda"  # 20 tokens
    with httpx.Client(timeout=HANG_GUARD) as client:
        for gw in (one, two, one):
            response = client.post(
                gw.url + "/v1/completions", json={"prompt": ten_words}, headers=bearer(key)
            )
            assert response.status_code == 200
            wait_until(lambda gw=gw: gw.state.teams.limiter.idle, "tokens settled")
        refused = client.post(
            two.url + "/v1/completions", json={"prompt": ten_words}, headers=bearer(key)
        )
        assert_rate_limited(refused, "tokens per minute")
        assert refused.headers["x-ratelimit-limit-tokens"] == "60"

    # one concurrent request for the team, on either gateway
    wide = keyed(
        {"search": {"max_concurrent_requests": 1}}, {key: "search"}, redis_url=redis_server.url
    )
    three, four = gateway_with(**wide), gateway_with(**wide)
    hold = {"model": SCRIPTED_MODEL, "prompt": script(texts=1, hang="after"), "stream": True}
    with (
        httpx.Client(timeout=HANG_GUARD) as client,
        client.stream(
            "POST", three.url + "/v1/completions", json=hold, headers=bearer(key)
        ) as held_stream,
    ):
        held = opened(held_stream)
        with httpx.Client(base_url=four.url, timeout=HANG_GUARD) as other:
            assert_rate_limited(ask(other, key), "concurrent requests")
        del held
    wait_until(lambda: three.state.slots.in_use == 0, "the slot to come back")
    with httpx.Client(base_url=four.url, timeout=HANG_GUARD) as client:
        wait_until(
            lambda: ask(client, key).status_code == 200, "the lease to be released", timeout=5
        )

        redis_server.stop()
        assert ask(client, key).status_code == 200
        assert "serving with this gateway's local limits" in caplog.text
        assert four.state.teams.limiter.redis_up is False
        redis_server.start()
        wait_until(lambda: four.state.teams.limiter.redis_up, "Redis to be back")
        assert "limits are shared by every replica" in caplog.text


def test_limits_and_budgets_without_redis_are_said_per_process_at_start(
    gateway_with, redis_server, caplog
):
    """Without Redis each replica enforces a team's limits in full and a restart forgets
    its budgets, silently until now: the gateway says so at start, naming the teams."""
    caplog.set_level(logging.WARNING, logger="furnace.teams")
    teams = {
        "search": {"requests_per_minute": 60},
        "ads": {"budgets": [{"window": "day", "tokens": 5000}]},
        "free": {"weight": 2},  # nothing to share
    }
    keys = {new_key(team): team for team in teams}
    said = "teams' limits and budgets"
    gateway_with(**keyed(teams, keys))
    (line,) = [r.getMessage() for r in caplog.records if said in r.getMessage()]
    assert "(search, ads)" in line and "set redis_url" in line
    caplog.clear()
    gateway_with(**keyed(teams, keys, redis_url=redis_server.url))
    gateway_with(**keyed({"free": {}}, {new_key("free"): "free"}))
    assert said not in caplog.text


def test_every_script_is_in_redis_from_the_start_and_after_a_restart(gateway_with, redis_server):
    """The gateway loads its Lua scripts (limits, budgets, ledger, responses, events,
    conversations, batches) when it starts and at the probe after Redis comes back
    empty, so no request pays the round trips of loading one."""
    gw = gateway_with(redis_url=redis_server.url, redis_timeout=0.5)
    store = gw.state.teams.limiter.redis
    assert store is not None and len(store.scripts) >= 10
    shas = [script.sha for script in store.scripts]
    with redis.Redis.from_url(redis_server.url) as client:
        assert all(client.script_exists(*shas))
    redis_server.stop()
    wait_until(lambda: gw.state.teams.limiter.redis_up is False, "the probe to see Redis gone")
    redis_server.start()
    wait_until(lambda: gw.state.teams.limiter.redis_up, "Redis to be back")
    with redis.Redis.from_url(redis_server.url) as client:
        assert all(client.script_exists(*shas))
