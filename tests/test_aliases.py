"""Model aliases, traffic splits and fallbacks (gateway.fleet.aliases): the draw
within statistical bounds, sessions that stay put, fallbacks in order, and a
config that refuses, naming the field, what cannot be served."""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Any

import pytest

from gateway.config import AliasConfig, ConfigError, parse_config
from gateway.fleet.aliases import Aliases, draw

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
