"""Model aliases, traffic splits and fallbacks (gateway.fleet.aliases): the draw
within statistical bounds, sessions that stay put, fallbacks in order, and a
config that refuses, naming the field, what cannot be served."""

from __future__ import annotations

import logging
import math
import random
import secrets
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from gateway.config import AliasConfig, ConfigError, ModelConfig, QueueConfig, parse_config
from gateway.fleet.aliases import Aliases, draw
from gateway.worker.demo import DemoEngine
from tests.support.certs import CertificateAuthority
from tests.support.keys import bearer, keyed, new_key
from tests.support.metrics import access_lines, scrape, value
from tests.support.openai_server import OpenAIServer
from tests.support.scripted_worker import SCRIPTED_MODEL
from tests.support.waiting import HANG_GUARD, wait_until

SPLIT = (("llama-70b-v2", 90.0), ("llama-70b-v3", 10.0))


def models(*names: str, **extra: Any) -> list[dict[str, Any]]:
    return [{"name": name, "workers": ["127.0.0.1:1"], **extra.get(name, {})} for name in names]


def test_a_split_of_90_10_over_2000_requests_lands_within_bounds() -> None:
    random.seed(28)
    counts = Counter(draw(SPLIT, None) for _ in range(2000))
    # binomial: mean 1800, standard deviation sqrt(2000 * 0.9 * 0.1) = 13.4; 5 of them
    sigma = math.sqrt(2000 * 0.9 * 0.1)
    assert abs(counts["llama-70b-v2"] - 1800) < 5 * sigma
    assert counts["llama-70b-v2"] + counts["llama-70b-v3"] == 2000


def test_sessions_stay_put_and_split_by_weight_together() -> None:
    sessions = [f"session-{i}" for i in range(2000)]
    first = [draw(SPLIT, s, "chat") for s in sessions]
    assert first == [draw(SPLIT, s, "chat") for s in sessions]  # each stays put
    sigma = math.sqrt(2000 * 0.9 * 0.1)
    assert abs(first.count("llama-70b-v2") - 1800) < 5 * sigma


def test_a_zero_weight_target_is_never_drawn() -> None:
    targets = (("a", 0.0), ("b", 1.0))
    assert {draw(targets, None) for _ in range(200)} == {"b"}
    assert {draw(targets, f"s{i}") for i in range(200)} == {"b"}


def test_aliases_resolve_through_aliases_and_a_teams_own_win() -> None:
    config = parse_config(
        {
            "models": models("a", "b", "c", a={"fallbacks": ["fast"]}),
            "aliases": {
                "chat": [{"model": "smart"}],
                "smart": [{"model": "a"}],
                "fast": [{"model": "b"}],
            },
            "teams": {"alpha": {"aliases": {"smart": [{"model": "c"}]}}},
        },
        env={},
    )
    aliases = Aliases(config)
    assert aliases.resolve("chat", None) == "a"
    assert aliases.resolve("chat", None, config.teams[0].aliases) == "c"
    assert aliases.resolve("b", None) == "b"
    assert list(aliases.chain("a", None)) == ["b"]
    assert aliases.targets("chat") == ["a"]
    assert aliases.names() == ["chat", "smart", "fast"]


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"aliases": {"x": [{"model": "y"}], "y": [{"model": "x"}]}}, "aliases.x: an alias cycle"),
        ({"aliases": {"x": [{"model": "nope"}]}}, "aliases.x[0].model: unknown model"),
        ({"aliases": {"x": [{"model": "a", "weight": 0}]}}, "aliases.x: the weights sum to 0"),
        ({"aliases": {"a": [{"model": "b"}]}}, "aliases.a: a model has this name"),
        ({"aliases": {"x": [{"model": "a", "weight": -1}]}}, "aliases.x[0].weight"),
        ({"models": models("a", "b", a={"prices": {"prompt": -1}})}, "models[0].prices.prompt"),
        ({"models": models("a", "b", a={"fallbacks": ["zz"]})}, "models[0].fallbacks[0]"),
        ({"models": models("a", "b", a={"fallbacks": ["a"]})}, "models[0].fallbacks[0]"),
        (
            {"models": [*models("a"), {"name": "t", "kind": "tensor", "fallbacks": ["a"]}]},
            "models[1].fallbacks: a tensor model has no fallbacks",
        ),
        (
            {"teams": {"t": {"aliases": {"x": [{"model": "x"}]}}}},
            "teams.t.aliases.x: an alias cycle",
        ),
        ({"teams": {"t": {"budgets": [{"window": "week", "tokens": 1}]}}}, "budgets[0].window"),
        ({"teams": {"t": {"budgets": [{"window": "day"}]}}}, "budgets[0].tokens"),
        ({"teams": {"t": {"budgets": [{"window": "day", "spend": -1}]}}}, "budgets[0].spend"),
    ],
)
def test_bad_routing_config_is_refused_naming_the_field(raw: dict[str, Any], field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_config({"models": models("a", "b"), **raw}, env={})


def test_the_contract_config_loads() -> None:
    config = parse_config(
        {
            "models": models(
                "llama-70b",
                "llama-8b",
                "llama-70b-v2",
                "llama-70b-v3",
                **{"llama-70b": {"fallbacks": ["llama-8b"]}},
            ),
            "teams": {
                "alpha": {
                    "budgets": [
                        {"window": "day", "tokens": 50000},
                        {"window": "month", "tokens": 1000000},
                    ]
                }
            },
            "aliases": {
                "chat": [
                    {"model": "llama-70b-v2", "weight": 90},
                    {"model": "llama-70b-v3", "weight": 10},
                ]
            },
        },
        env={},
    )
    assert config.aliases == (AliasConfig("chat", SPLIT),)
    assert config.models[0].fallbacks == ("llama-8b",)
    assert [b.tokens for b in config.teams[0].budgets] == [50000, 1000000]


# -- through a real gateway ----------------------------------------------------------------


def test_an_alias_is_listed_served_by_its_targets_and_sticky_per_session(
    gateway_with, caplog
) -> None:
    caplog.set_level(logging.INFO, logger="furnace.access")
    split = AliasConfig("chat", (("furnace-demo", 50.0), ("furnace-slow", 50.0)))
    gw = gateway_with(aliases=(split,))
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        listed = [m["id"] for m in client.get("/v1/models").json()["data"]]
        assert "chat" in listed
        assert client.get("/v1/models/chat").status_code == 200
        body = {"model": "chat", "messages": [{"role": "user", "content": "a b"}], "max_tokens": 2}
        served = set()
        for _ in range(40):
            answer = client.post("/v1/chat/completions", json=body)
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == answer.headers["x-furnace-model"]
            served.add(answer.headers["x-furnace-model"])
        assert served == {"furnace-demo", "furnace-slow"}  # 2**-39 to fail by chance
        for session in ("s-1", "s-2", "s-3", "s-4"):
            headers = {"x-session-id": session}
            models = {
                client.post("/v1/chat/completions", json=body, headers=headers).headers[
                    "x-furnace-model"
                ]
                for _ in range(5)
            }
            assert len(models) == 1
        # the body's `user` is the session key without the header
        models = {
            client.post("/v1/chat/completions", json={**body, "user": "u-9"}).json()["model"]
            for _ in range(5)
        }
        assert len(models) == 1
        streamed = client.post("/v1/chat/completions", json={**body, "stream": True})
        assert streamed.headers["x-furnace-model"] in served
        assert f'"model":"{streamed.headers["x-furnace-model"]}"' in streamed.text

    def logged() -> list[dict[str, str]]:
        lines = access_lines(caplog)
        return [{"asked": line.get("asked_model"), "model": line["model"]} for line in lines]

    wait_until(lambda: len(logged()) >= 66, "every request's access-log line")
    assert {line["asked"] for line in logged()} == {"chat"}  # both names, on every line
    assert {line["model"] for line in logged()} == served
    # and in the metrics, with a configured name alone as `asked`
    httpx.post(f"{gw.url}/v1/completions", json={"model": "nope", "prompt": "a"})
    samples = scrape(gw.url)
    routed = {
        labels: count
        for (name, labels), count in samples.items()
        if name == "furnace_gateway_routed_requests_total"
    }
    assert sum(routed.values()) == 66
    assert {dict(labels)["asked"] for labels in routed} == {"chat"}
    assert {dict(labels)["model"] for labels in routed} == served


def test_a_team_sees_an_alias_only_through_models_it_may_use(gateway_with) -> None:
    key = new_key("alpha")
    split = AliasConfig("chat", (("furnace-slow", 1.0),))
    gw = gateway_with(
        **keyed({"alpha": {"models": ["furnace-demo"]}}, {key: "alpha"}), aliases=(split,)
    )
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD, headers=bearer(key)) as client:
        assert "chat" not in [m["id"] for m in client.get("/v1/models").json()["data"]]
        body = {"model": "chat", "prompt": "a b", "max_tokens": 1}
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 404, answer.text
        assert answer.json()["error"]["code"] == "model_not_found"


def test_a_team_is_served_by_the_targets_of_an_alias_it_may_use_and_never_refused(
    gateway_with,
) -> None:
    """An alias with targets a team may use and one it may not: the team's requests are
    drawn among the first (it was refused at random, whenever the draw fell on the other)."""
    key = new_key("alpha")
    split = AliasConfig("chat", (("furnace-demo", 1.0), ("furnace-slow", 1.0)))
    gw = gateway_with(
        **keyed({"alpha": {"models": ["furnace-demo"]}}, {key: "alpha"}), aliases=(split,)
    )
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD, headers=bearer(key)) as client:
        assert "chat" in [m["id"] for m in client.get("/v1/models").json()["data"]]
        body = {"model": "chat", "prompt": "a b", "max_tokens": 1}
        served = set()
        for _ in range(12):
            answer = client.post("/v1/completions", json=body)
            assert answer.status_code == 200, answer.text
            served.add(answer.headers["x-furnace-model"])
        assert served == {"furnace-demo"}


def test_a_fallback_serves_only_within_its_own_max_tokens_limit(gateway_with, workers) -> None:
    """A fallback with a `max_tokens_limit` is passed over for a request that asks more,
    or sets no bound (it was served past the cap); within it, the fallback serves."""
    models = (
        ModelConfig("furnace-primary", workers=("127.0.0.1:1",), fallbacks=("furnace-demo",)),
        ModelConfig("furnace-demo", workers=(workers.demo.address,), max_tokens_limit=3),
    )
    gw = gateway_with(models=models)
    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        for asked in (10, None):
            body = {"model": "furnace-primary", "prompt": "a b c d e f", "max_tokens": asked}
            answer = client.post("/v1/completions", json=body)
            assert answer.status_code == 503, answer.text
        body = {"model": "furnace-primary", "prompt": "a b c d e f", "max_tokens": 2}
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-furnace-model"] == "furnace-demo"
        assert answer.json()["usage"]["completion_tokens"] == 2


def test_a_fallback_that_cannot_serve_per_chunk_usage_refuses_it_naming_it(
    gateway_with, server_loop, tmp_path, monkeypatch
) -> None:
    """An OpenAI-compatible fallback says the prompt's tokens only at its end: a request
    for usage in every chunk that lands there is refused, naming the option, and
    nothing is left running."""
    ca = CertificateAuthority(tmp_path, "hosted-ca")
    server = OpenAIServer("hosted", "sk-" + secrets.token_hex(8), ca.issue("h", ips=("127.0.0.1",)))
    server_loop.call(server.start())
    monkeypatch.setenv("FURNACE_TEST_HOSTED_KEY", server.key)
    try:
        hosted = ModelConfig(
            "hosted",
            workers=(server.url,),
            upstream="openai",
            api_key_env="FURNACE_TEST_HOSTED_KEY",
            ca_file=ca.ca_file,
        )
        models = (
            ModelConfig("furnace-primary", workers=("127.0.0.1:1",), fallbacks=("hosted",)),
            hosted,
        )
        gw = gateway_with(models=models)
        body = {
            "model": "furnace-primary",
            "messages": [{"role": "user", "content": "a b"}],
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
            refused = client.post("/v1/chat/completions", json=body)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == "stream_options.continuous_usage_stats"
            del body["stream_options"]["continuous_usage_stats"]
            served = client.post("/v1/chat/completions", json=body)
            assert served.status_code == 200, served.text
            assert served.headers["x-furnace-model"] == "hosted"
    finally:
        server_loop.call(server.stop())


def test_fallback_serves_every_request_when_the_first_models_workers_die(
    gateway_with, serve_engines, workers, server_loop
) -> None:
    (primary,) = serve_engines(DemoEngine("furnace-primary", max_context=64))
    models = (
        ModelConfig("furnace-primary", workers=(primary.address,), fallbacks=("furnace-demo",)),
        ModelConfig("furnace-demo", workers=(workers.demo.address,)),
    )
    gw = gateway_with(models=models, health_check_interval=0.1, retry_attempts=2)
    body = {"model": "furnace-primary", "prompt": "a b c", "max_tokens": 3, "stream": True}

    def ask(client: httpx.Client) -> str:
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        assert "error" not in answer.text  # nothing failed after the first token
        model = answer.headers["x-furnace-model"]
        assert f'"model":"{model}"' in answer.text
        return model

    with httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client:
        before = [ask(client) for _ in range(5)]
        assert set(before) == {"furnace-primary"}
        server_loop.call(primary.stop(0))  # mid-run: the gateway has not noticed yet
        after = [ask(client) for _ in range(10)]
        assert set(after) == {"furnace-demo"}
    routed = value(
        scrape(gw.url),
        "furnace_gateway_routed_requests_total",
        asked="furnace-primary",
        model="furnace-demo",
    )
    assert routed == 10


def test_a_queue_refusal_sends_the_request_to_the_fallback_charged_at_its_prices(
    gateway_with, workers
) -> None:
    alpha, beta = new_key("alpha"), new_key("beta")
    models = (
        ModelConfig(
            "furnace-demo",
            workers=(workers.demo.address,),
            queue=QueueConfig(max_wait=0.2),
            fallbacks=("furnace-slow",),
            prices=(1.0, 1.0),
        ),
        ModelConfig(
            "furnace-slow",
            workers=(workers.slow.address,),
            queue=QueueConfig(max_wait=30),
            prices=(2.0, 3.0),
        ),
    )
    teams = {
        "alpha": {"budgets": [{"window": "day", "spend": 1.0}]},
        "beta": {"models": ["furnace-demo", SCRIPTED_MODEL]},
    }
    gw = gateway_with(
        **keyed(teams, {alpha: "alpha", beta: "beta"}), models=models, max_concurrent_requests=1
    )
    # the slow model echoes its prompt, a word each 0.05 s
    hold = {"model": "furnace-slow", "prompt": "w " * 30, "max_tokens": 30, "stream": True}
    body = {"model": "furnace-demo", "prompt": "a b c", "max_tokens": 3}
    with (
        httpx.Client(base_url=gw.url, timeout=HANG_GUARD) as client,
        ThreadPoolExecutor(2) as pool,
    ):
        # the one slot held by a stream of ~1.5 s: furnace-demo's queue gives up at 0.2 s
        holding = pool.submit(client.post, "/v1/completions", json=hold, headers=bearer(alpha))
        wait_until(lambda: gw.state.slots.in_use == 1, "the slot held")
        moved = client.post("/v1/completions", json=body, headers=bearer(alpha))
        assert moved.status_code == 200, moved.text
        assert moved.headers["x-furnace-model"] == moved.json()["model"] == "furnace-slow"
        assert holding.result().status_code == 200
        # a team that may not use the fallback gets the first queue's refusal
        holding = pool.submit(client.post, "/v1/completions", json=hold, headers=bearer(alpha))
        wait_until(lambda: gw.state.slots.in_use == 1, "the slot held again")
        refused = client.post("/v1/completions", json=body, headers=bearer(beta))
        assert refused.status_code == 503, refused.text
        assert holding.result().status_code == 200
    accounts = gw.state.teams.accounts
    wait_until(lambda: not gw.state.inflight.running, "every request ended")
    totals = accounts.ledger.totals
    assert ("alpha", "furnace-demo") not in totals  # charged where it was served
    usage = moved.json()["usage"]
    moved_spend = (usage["prompt_tokens"] * 2.0 + usage["completion_tokens"] * 3.0) / 1e6
    served = totals[("alpha", "furnace-slow")]
    assert served["requests"] == 3
    assert served["spend"] >= moved_spend
    (level,) = [used for _, used in gw.state.teams.by_name["alpha"].budget.values()]
    assert level == pytest.approx(served["spend"])  # the budget settled to the ledger
