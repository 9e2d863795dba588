"""Limits that hold under load and failure ('Hold the line'): tokens per minute
reserve a request's whole possible cost (prompt and `max_tokens`) and refund
what it did not use; a Redis that stalls past `redis_timeout` leaves no lease
behind; `keys` and `keys_file` never silently disagree, and a deleted
`keys_file` takes its keys with it."""

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import redis

from gateway.config import ConfigError
from tests.support.keys import ask, assert_rate_limited, bearer, keyed, new_key, sha256
from tests.support.requests import opened
from tests.support.scripted_worker import SCRIPTED_MODEL, script
from tests.support.servers import Gateway
from tests.support.waiting import HANG_GUARD, wait_until

HOLD = script(texts=1, hang="after")  # one token, then a stream that waits


def short(client: httpx.Client, key: str, max_tokens: int) -> httpx.Response:
    """A request that may write `max_tokens` and writes one."""
    return ask(client, key, script(texts=1), model=SCRIPTED_MODEL, max_tokens=max_tokens)


@contextmanager
def held(gw: Gateway, key: str, **body: object) -> Iterator[None]:
    """A request of `key` in flight on `gw` (a scripted stream that hangs) for
    the body of the `with`; its tokens are settled after."""
    hold = {"model": SCRIPTED_MODEL, "prompt": HOLD, "stream": True, **body}
    with (
        httpx.Client(timeout=HANG_GUARD) as client,
        client.stream("POST", gw.url + "/v1/completions", json=hold, headers=bearer(key)) as one,
    ):
        assert one.status_code == 200, one.read()
        lines = opened(one)
        yield
        del lines
    wait_until(lambda: gw.state.teams.limiter.idle, "the held request to be settled")


@pytest.mark.parametrize("shared", [False, True], ids=["local", "redis"])
def test_tokens_per_minute_reserve_max_tokens_and_refund_the_rest(gateway_with, request, shared):
    key = new_key("search")
    extra = {"redis_url": request.getfixturevalue("redis_server").url} if shared else {}
    # (the scripted model's context is 100 tokens: a larger max_tokens is a 400)
    settings = keyed({"search": {"tokens_per_minute": 80}}, {key: "search"}, **extra)
    one = gateway_with(**settings)
    other = gateway_with(**settings) if shared else one  # the same limit, seen from another
    with httpx.Client(base_url=other.url, timeout=HANG_GUARD) as client:
        # more than the whole minute is never admitted
        assert_rate_limited(short(client, key, 90), "tokens per minute")
        with held(one, key, max_tokens=50):
            # 50 are reserved while it runs: 50 more do not fit, 10 do
            assert_rate_limited(short(client, key, 50), "tokens per minute")
            assert short(client, key, 10).status_code == 200
        # it wrote one token: the rest of its 50 came back
        assert short(client, key, 50).status_code == 200


def test_a_request_with_no_bound_reserves_what_is_left_of_the_minute(gateway_with):
    key = new_key("search")
    gw = gateway_with(**keyed({"search": {"tokens_per_minute": 1000}}, {key: "search"}))
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        with held(gw, key):  # no max_tokens, and the model has no cap
            assert_rate_limited(short(client, key, 5), "tokens per minute")
        assert short(client, key, 60).status_code == 200


def test_a_redis_that_stalls_past_the_timeout_leaves_no_lease_behind(
    gateway_with, redis_server, caplog
):
    caplog.set_level(logging.INFO, logger="furnace.limits")
    key = new_key("search")
    settings = keyed(
        {"search": {"max_concurrent_requests": 1}},
        {key: "search"},
        redis_url=redis_server.url,
        redis_timeout=0.3,
    )
    gw = gateway_with(**settings)
    limiter = gw.state.teams.limiter
    assert limiter.redis_up
    with (
        httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client,
        redis.Redis(host="127.0.0.1", port=redis_server.port) as direct,
    ):
        prefix = gw.state.config.redis_key_prefix
        inflight = f"{prefix}:limits:{{search}}:inflight"
        assert ask(client, key).status_code == 200  # Redis knows the admit script
        redis_server.stall()
        try:
            # the admit script times out (and will run late): served locally
            assert ask(client, key).status_code == 200
            # this admit, and the first request's release if it was still on its way
            assert 1 <= len(limiter.uncertain) <= 2
        finally:
            redis_server.resume()
        wait_until(lambda: limiter.redis_up and not limiter.uncertain, "the lease to be swept")
        assert direct.zcard(inflight) == 0
        for _ in range(3):  # nothing runs: never a 429
            assert ask(client, key).status_code == 200
    assert "serving with this gateway's local limits" in caplog.text


def test_a_key_in_keys_and_keys_file_with_two_teams_is_refused(gateway_with, tmp_path, caplog):
    caplog.set_level(logging.ERROR, logger="furnace.keys")
    both, filed, added = new_key("search"), new_key("search"), new_key("ads")
    path = tmp_path / "keys.yaml"
    teams = {"search": {}, "ads": {}}
    path.write_text(f"- sha256: {sha256(both)}\n  team: ads\n")
    with pytest.raises(ConfigError, match="listed in `keys` with another team"):
        keyed(teams, {both: "search"}, keys_file=str(path))

    path.write_text(f"- sha256: {sha256(filed)}\n  team: search\n")
    gw = gateway_with(**keyed(teams, {both: "search"}, keys_file=str(path)))
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        # the new file gives `both` another team: refused, the keys known stay
        path.write_text(
            f"- sha256: {sha256(both)}\n  team: ads\n- sha256: {sha256(added)}\n  team: ads\n"
        )
        gw.state.teams.keys.reload_if_changed()
        assert "keys file not reloaded" in caplog.text
        assert client.get("/v1/models", headers=bearer(filed)).status_code == 200
        assert client.get("/v1/models", headers=bearer(added)).status_code == 401
        assert gw.state.teams.authenticate(bearer_headers(both)).name == "search"


def test_a_deleted_keys_file_takes_its_keys_with_it(gateway_with, tmp_path: Path, caplog):
    caplog.set_level(logging.ERROR, logger="furnace.keys")
    inline, filed = new_key("search"), new_key("search")
    path = tmp_path / "keys.yaml"
    path.write_text(f"- sha256: {sha256(filed)}\n  team: search\n")
    gw = gateway_with(**keyed({"search": {}}, {inline: "search"}, keys_file=str(path)))
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        assert client.get("/v1/models", headers=bearer(filed)).status_code == 200
        path.unlink()
        gw.state.teams.keys.reload_if_changed()
        assert "keys file dropped" in caplog.text
        assert client.get("/v1/models", headers=bearer(filed)).status_code == 401
        assert client.get("/v1/models", headers=bearer(inline)).status_code == 200
        # back again: read again
        path.write_text(f"- sha256: {sha256(filed)}\n  team: search\n")
        gw.state.teams.keys.reload_if_changed()
        assert client.get("/v1/models", headers=bearer(filed)).status_code == 200


def bearer_headers(key: str) -> list[tuple[bytes, bytes]]:
    """`key`'s Authorization header as ASGI carries it."""
    return [(b"authorization", f"Bearer {key}".encode())]
