"""Per-team limits in one gateway's memory (requests and tokens per minute,
concurrency) with OpenAI's 429 and headers, fair share of the slots between
teams, and the bounds on one request's input."""

from contextlib import ExitStack

import httpx
import pytest

from gateway.teams.headers import duration
from gateway.worker.demo import DEMO_MODEL
from tests.support.keys import ask, assert_rate_limited, bearer, keyed, new_key
from tests.support.requests import opened, user
from tests.support.scripted_worker import SCRIPTED_MODEL, script
from tests.support.waiting import HANG_GUARD, wait_until

RATE_HEADERS = ("limit", "remaining", "reset")


def test_requests_per_minute_429_with_openai_headers_while_another_team_is_served(
    gateway_with,
):
    search, ads = new_key("search"), new_key("ads")
    teams = {"search": {"requests_per_minute": 3}, "ads": {"requests_per_minute": 1000}}
    gw = gateway_with(**keyed(teams, {search: "search", ads: "ads"}), admin_port=0)
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        remaining = []
        first = ask(client, search)
        remaining.append(first.headers["x-ratelimit-remaining-requests"])
        assert first.headers["x-ratelimit-limit-requests"] == "3"
        # a stream carries them too, with its status
        with client.stream(
            "POST", "/v1/completions", json={"prompt": "a", "stream": True}, headers=bearer(search)
        ) as stream:
            assert stream.status_code == 200
            remaining.append(stream.headers["x-ratelimit-remaining-requests"])
            stream.read()
        third = ask(client, search)
        remaining.append(third.headers["x-ratelimit-remaining-requests"])
        assert remaining == ["2", "1", "0"]
        refused = ask(client, search)
        assert_rate_limited(refused, "requests per minute")
        # one request drains every 20 s
        assert 1 <= int(refused.headers["retry-after"]) <= 20
        assert refused.headers["x-ratelimit-limit-requests"] == "3"
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
        assert refused.headers["x-ratelimit-reset-requests"].endswith("s")
        assert "x-ratelimit-limit-tokens" not in refused.headers  # no token limit set
        # the models list answers, with the headers, and takes nothing
        listed = client.get("/v1/models", headers=bearer(search))
        assert listed.status_code == 200
        assert listed.headers["x-ratelimit-remaining-requests"] == "0"
        # the other team is served all along
        for _ in range(5):
            served = ask(client, ads)
            assert served.status_code == 200
        assert served.headers["x-ratelimit-limit-requests"] == "1000"
        assert int(served.headers["x-ratelimit-remaining-requests"]) >= 994
    samples = httpx.get(f"{gw.admin_url}/metrics", timeout=HANG_GUARD).text
    assert 'furnace_gateway_team_refusals_total{limit="requests",team="search"} 1.0' in samples
    # refused before its body was read (issue 25): no model is known yet
    assert 'furnace_gateway_rejections_total{model="",reason="team_requests"}' in samples


def test_tokens_per_minute_count_prompt_and_completion(gateway_with):
    search, ads = new_key("search"), new_key("ads")
    teams = {"search": {"tokens_per_minute": 60}, "ads": {"tokens_per_minute": 10_000}}
    gw = gateway_with(**keyed(teams, {search: "search", ads: "ads"}))
    limiter = gw.state.teams.limiter
    # 10 prompt + 10 completion tokens on the demo engine, the prompt estimated at 15 up
    # front; a request with no max_tokens is granted what is left of the minute as its
    # bound (issue 25): the third, with 60 - 40 - 15 = 5 left, is cut at 5 tokens, and a
    # fourth fits again only once 15 tokens have drained (15 s)
    ten_words = "alpha beta gamma delta epsilon zeta theta iota kappa lambda"
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        for completion in (10, 10, 5):
            response = ask(client, search, ten_words)
            assert response.status_code == 200
            assert response.json()["usage"]["completion_tokens"] == completion
            assert response.json()["choices"][0]["finish_reason"] == (
                "length" if completion == 5 else "stop"
            )
            wait_until(lambda: limiter.idle, "the request's tokens to be settled")
        refused = ask(client, search, ten_words)
        assert_rate_limited(refused, "tokens per minute")
        assert refused.headers["x-ratelimit-limit-tokens"] == "60"
        assert int(refused.headers["x-ratelimit-remaining-tokens"]) <= 5
        assert "x-ratelimit-limit-requests" not in refused.headers
        served = ask(client, ads, ten_words)
        assert served.status_code == 200
        assert served.headers["x-ratelimit-limit-tokens"] == "10000"
    team = gw.state.teams.by_name["search"]
    assert team.tokens_charged == 55


def test_tokens_per_minute_reserve_max_tokens_for_each_of_n_choices(gateway_with):
    search = new_key("search")
    gw = gateway_with(**keyed({"search": {"tokens_per_minute": 100}}, {search: "search"}))
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        # 4 choices of up to 30 tokens could cost 120: more than the minute holds
        refused = ask(client, search, "a b", n=4, max_tokens=30)
        assert_rate_limited(refused, "tokens per minute")
        served = ask(client, search, "a b", n=2, max_tokens=30)
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["completion_tokens"] == 4  # two echoes of "a b"


def test_streamed_tokens_are_charged_as_they_stream(gateway_with):
    key = new_key("search")
    gw = gateway_with(**keyed({"search": {"tokens_per_minute": 100_000}}, {key: "search"}))
    team = gw.state.teams.by_name["search"]
    words = " ".join(["w"] * 60)  # 60 tokens, 50 ms apart on the slow engine: 3 s
    body = {"model": "furnace-slow", "prompt": words, "stream": True}
    with (
        httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client,
        client.stream("POST", "/v1/completions", json=body, headers=bearer(key)) as stream,
    ):
        lines = opened(stream)
        # the prompt's real count replaced the estimate, and completion tokens
        # are charged while the stream is still going
        wait_until(lambda: team.tokens_charged > 60 + 10, "tokens to be charged mid-stream")
        assert team.tokens_charged < 120
        for _ in lines:
            pass
    wait_until(lambda: team.tokens_charged == 120, "the stream's tokens to be settled")


def test_concurrent_requests_per_team(gateway_with):
    search, ads = new_key("search"), new_key("ads")
    teams = {"search": {"max_concurrent_requests": 1}, "ads": {}}
    gw = gateway_with(**keyed(teams, {search: "search", ads: "ads"}))
    hold = {"model": SCRIPTED_MODEL, "prompt": script(texts=1, hang="after"), "stream": True}
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        with client.stream("POST", "/v1/completions", json=hold, headers=bearer(search)) as one:
            held = opened(one)
            assert_rate_limited(ask(client, search), "concurrent requests")
            assert ask(client, ads).status_code == 200
            del held
        wait_until(lambda: gw.state.slots.in_use == 0, "the slot to come back")
        assert ask(client, search).status_code == 200


def test_a_team_alone_uses_every_slot(gateway_with):
    search = new_key("search")
    teams = {"search": {"weight": 1}, "ads": {"weight": 3}}
    gw = gateway_with(max_concurrent_requests=4, **keyed(teams, {search: "search"}))
    hold = {"model": SCRIPTED_MODEL, "prompt": script(texts=1, hang="after"), "stream": True}
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client, ExitStack() as streams:
        held = [
            opened(
                streams.enter_context(
                    client.stream("POST", "/v1/completions", json=hold, headers=bearer(search))
                )
            )
            for _ in range(4)
        ]
        assert gw.state.slots.in_use == 4
        busy = ask(client, search)
        assert busy.status_code == 503
        assert busy.json()["error"]["code"] == "server_busy"
        del held
    wait_until(lambda: gw.state.slots.in_use == 0, "the slots to come back")


def test_fair_share_holds_with_two_teams_flooding(gateway_with):
    """Counted, not timed: each team keeps opening held streams until refused."""
    big, small = new_key("big"), new_key("small")
    teams = {"big": {"weight": 3}, "small": {"weight": 1}}
    gw = gateway_with(max_concurrent_requests=8, **keyed(teams, {big: "big", small: "small"}))
    hold = {"model": SCRIPTED_MODEL, "prompt": script(texts=1, hang="after"), "stream": True}
    held: dict[str, list] = {big: [], small: []}
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client, ExitStack() as streams:

        def try_open(key: str) -> bool:
            """Opens a held stream for `key`; False when refused."""
            stream = streams.enter_context(
                client.stream("POST", "/v1/completions", json=hold, headers=bearer(key))
            )
            if stream.status_code != 200:
                assert stream.status_code == 503
                stream.read()
                assert stream.json()["error"]["code"] == "server_busy"
                stream.close()
                return False
            lines = stream.iter_lines()
            next(lines)
            held[key].append((stream, lines))
            return True

        def close_one(key: str) -> None:
            stream, _ = held[key].pop()
            stream.close()
            count = len(held[big]) + len(held[small])
            wait_until(lambda: gw.state.slots.in_use == count, "a slot to come back")

        # the big team alone takes every slot; the small one is refused, once
        while try_open(big):
            pass
        assert len(held[big]) == 8
        assert not try_open(small)
        # as the big team's requests end, both flood: the freed slots go to the
        # small team until it holds its share (2 of 8), then to whoever is under its own
        for _ in range(8):
            close_one(big)
            for _ in range(3):
                try_open(big)
                try_open(small)
        assert (len(held[big]), len(held[small])) == (6, 2)
        # both keep flooding as requests end: the shares hold
        for key in (small, big, big, small, big):
            close_one(key)
            for _ in range(3):
                try_open(big)
                try_open(small)
            assert (len(held[big]), len(held[small])) == (6, 2)
        counts = gw.state.teams.by_name["big"].refused["fair_share"]
        assert counts > 0  # refused for its share, not only for full slots
    wait_until(lambda: gw.state.slots.in_use == 0, "the slots to come back")


def test_a_request_refused_for_want_of_a_slot_is_not_counted(gateway_with):
    search, ads = new_key("search"), new_key("ads")
    teams = {"search": {"requests_per_minute": 2}, "ads": {}}
    gw = gateway_with(max_concurrent_requests=1, **keyed(teams, {search: "search", ads: "ads"}))
    hold = {"model": SCRIPTED_MODEL, "prompt": script(texts=1, hang="after"), "stream": True}
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        with client.stream("POST", "/v1/completions", json=hold, headers=bearer(ads)) as one:
            held = opened(one)
            for _ in range(3):
                assert ask(client, search).status_code == 503
            del held
        wait_until(lambda: gw.state.slots.in_use == 0, "the slot to come back")
        assert ask(client, search).status_code == 200
        assert ask(client, search).status_code == 200
        assert ask(client, search).status_code == 429


def test_input_limits(gateway_with):
    from gateway.config import ModelConfig

    gw = gateway_with(max_messages=3, max_header_bytes=4096)
    workers_of = {m.name: m for m in gw.state.config.models}
    capped = ModelConfig(DEMO_MODEL, workers=workers_of[DEMO_MODEL].workers, max_tokens_limit=2)
    limited = gateway_with(models=(capped,))
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        too_many = client.post("/v1/chat/completions", json={"messages": user("x") * 4})
        assert too_many.status_code == 400
        assert too_many.json()["error"]["param"] == "messages"
        assert client.post("/v1/chat/completions", json={"messages": user("x") * 3}).is_success
        big = client.get("/health", headers={"x-padding": "p" * 5000})
        assert big.status_code == 431
        assert big.json()["error"]["code"] == "request_headers_too_large"
        assert client.get("/health", headers={"x-padding": "p" * 3000}).status_code == 200
    with httpx.Client(base_url=limited.url, timeout=HANG_GUARD) as client:
        over = client.post("/v1/completions", json={"prompt": "a b c", "max_tokens": 3})
        assert over.status_code == 400
        assert over.json()["error"]["param"] == "max_tokens"
        # no max_tokens: the cap is the default
        capped_answer = client.post("/v1/completions", json={"prompt": "a b c d"}).json()
        assert capped_answer["choices"][0]["text"] == "a b"
        assert capped_answer["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0, "0ms"),
        (0.02, "20ms"),
        (1, "1s"),
        (1.5, "1.5s"),
        (20, "20s"),
        (60, "1m0s"),
        (361, "6m1s"),
    ],
)
def test_reset_durations_read_as_openai_writes_them(seconds, text):
    assert duration(seconds) == text
