"""The config: defaults, YAML, environment overrides, errors that name the field."""

from dataclasses import MISSING, fields
from typing import Any

import pytest

from gateway.config import (
    Config,
    ConfigError,
    hints,
    is_section,
    item_of,
    load_config,
    optional,
    parse_config,
    spec_of,
)

EXAMPLE = """
host: 0.0.0.0
port: 8000
max_concurrent_requests: 256
request_timeout: 600          # seconds
models:
  - name: llama-3-8b
    workers: ["10.0.0.7:50051"]
  - name: resnet-50
    kind: tensor
"""


def test_the_issue_example_loads(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(EXAMPLE)
    config = load_config(path, env={})
    assert config.max_concurrent_requests == 256
    assert config.request_timeout == 600.0
    assert [(m.name, m.kind, m.workers) for m in config.models] == [
        ("llama-3-8b", "llm", ("10.0.0.7:50051",)),
        ("resnet-50", "tensor", ()),
    ]


def test_defaults_are_finite():
    config = parse_config({}, env={})
    assert config == Config()
    assert 0 < config.request_timeout < float("inf")
    assert 0 < config.stream_timeout < float("inf")
    assert config.max_body_bytes > 0


def test_environment_overrides():
    env = {
        "FURNACE_PORT": "9001",
        "FURNACE_REQUEST_TIMEOUT": "2.5",
        "FURNACE_MODELS": "[{name: m, workers: ['h:1']}]",
        "FURNACE_LOG_LEVEL": "DEBUG",
    }
    config = parse_config({"port": 8000}, env=env)
    assert config.port == 9001
    assert config.request_timeout == 2.5
    assert config.models[0].workers == ("h:1",)
    assert config.log_level == "debug"


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"port": "eighty"}, "port"),
        ({"port": True}, "port"),
        ({"max_concurrent_requests": 0}, "max_concurrent_requests"),
        ({"max_concurrent_requests": 2.5}, "max_concurrent_requests"),
        ({"request_timeout": -1}, "request_timeout"),
        ({"log_level": "loud"}, "log_level"),
        ({"colour": "blue"}, "colour"),
        ({"models": {"name": "x"}}, "models"),
        ({"models": [{"workers": ["a:1"]}]}, "models[0].name"),
        ({"models": [{"name": "x"}]}, "models[0].workers"),
        ({"models": [{"name": "x", "workers": "a:1"}]}, "models[0].workers"),
        ({"models": [{"name": "x", "kind": "vision", "workers": ["a:1"]}]}, "models[0].kind"),
        ({"models": [{"name": "x", "workers": ["a:1"], "gpu": 1}]}, "models[0].gpu"),
        ({"models": [{"name": "x", "workers": ["a:1"], "max_model_len": 0}]}, "max_model_len"),
        (
            {"models": [{"name": "x", "workers": ["a:1"], "plain_text_contents": "yes"}]},
            "models[0].plain_text_contents",
        ),
        (
            {"models": [{"name": "x", "workers": ["a:1"]}, {"name": "x", "workers": ["b:1"]}]},
            "models[1].name",
        ),
        # prefill workers: OpenAI-compatible servers (vLLM's), of an `openai` model
        (
            {"models": [{"name": "x", "workers": ["a:1"], "prefill_workers": ["b:1"]}]},
            "models[0].prefill_workers[0]",
        ),
        (
            {
                "models": [
                    {
                        "name": "x",
                        "upstream": "openai",
                        "workers": ["http://a/v1"],
                        "prefill_workers": ["b:1"],
                    }
                ]
            },
            "models[0].prefill_workers[0]",
        ),
        (
            {
                "models": [
                    {"name": "x", "upstream": "openai", "workers": ["http://a/v1"]},
                    {"name": "y", "adapter_of": "x", "prefill_workers": ["http://b/v1"]},
                ]
            },
            "models[1].prefill_workers",
        ),
    ],
)
def test_errors_name_the_field(raw, field):
    with pytest.raises(ConfigError, match=field.replace("[", r"\[").replace("]", r"\]")):
        parse_config(raw, env={})


def test_unreadable_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml", env={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, env={})


def _sections(section: type, path: str = "") -> list[tuple[str, type]]:
    """Every section the config holds, by path, the top level first."""
    found = [(path, section)]
    types = hints(section)
    for declared in fields(section):
        kind, _ = optional(types[declared.name])
        held = spec_of(declared).shape or (kind if is_section(kind) else item_of(kind))
        if is_section(held):
            found += _sections(held, f"{path}.{declared.name}".lstrip("."))
    return found


@pytest.mark.parametrize(("path", "section"), _sections(Config), ids=lambda v: str(v))
def test_every_nested_field_is_declared_with_a_meaning_and_numbers_with_bounds(path, section):
    types = hints(section)
    for declared in fields(section):
        spec = spec_of(declared)  # raises for a field declared without setting()
        assert spec.help, f"{path}.{declared.name}"
        kind, _ = optional(types[declared.name])
        kind = item_of(kind) or kind
        if kind in (int, float) and not spec.shape:
            assert spec.minimum is not None, f"{path}.{declared.name}: a number needs a minimum"
            if declared.default not in (None, MISSING):
                assert declared.default >= spec.minimum, f"{path}.{declared.name}"


MODEL = {"name": "m", "workers": ["h:1"]}


@pytest.mark.parametrize(
    ("raw", "error"),
    [
        (
            {"models": [MODEL, {**MODEL, "name": "n"}, {**MODEL, "name": "o", "routing": {}}]},
            None,
        ),
        (
            {"models": [MODEL, {**MODEL, "name": "n", "routing": {"policy": "best"}}]},
            "models[1].routing.policy: expected one of kv_aware, prefix, least_load, round_robin",
        ),
        (
            {"models": [{**MODEL, "routing": {"max_sessions": 0}}]},
            "models[0].routing.max_sessions: must be at least 1, got 0",
        ),
        (
            {"models": [{**MODEL, "routing": {"prefill_weight": ".nan"}}]},
            "models[0].routing.prefill_weight: expected a number, got '.nan'",
        ),
        (
            {"models": [{**MODEL, "routing": {"usage_cost": float("nan")}}]},
            "models[0].routing.usage_cost: expected a number, got nan",
        ),
        (
            {"models": [{**MODEL, "routing": {"max_sessions": float("inf")}}]},
            "models[0].routing.max_sessions: expected a number, got inf",
        ),
        (
            {"models": [{**MODEL, "queue": {"max_depth": 0}}], "queue": {"max_wait": 1}},
            "models[0].queue.max_depth: must be at least 1, got 0",
        ),
        ({"models": [{**MODEL, "queue": {"max_depth": 2}}]}, "models[0].queue.max_wait: required"),
        (
            {"models": [{**MODEL, "prices": {"completion": -1}}]},
            "models[0].prices.completion: must be at least 0, got -1",
        ),
        (
            {"models": [{**MODEL, "prices": [1, 2]}]},
            "models[0].prices: expected a mapping {prompt, completion}",
        ),
        (
            {"models": [{**MODEL, "weights": {"h:1": "heavy"}}]},
            "models[0].weights.h:1: expected a number, got 'heavy'",
        ),
        (
            {"models": [{**MODEL, "scoring": "cross-encoder"}]},
            "models[0].scoring: cross-encoder with upstream: openai",
        ),
        (
            {"models": [{**MODEL, "scoring": "cosine"}]},
            "models[0].scoring: expected one of embeddings, cross-encoder",
        ),
        (
            {"teams": {"t": {"budgets": [{"window": "day", "tokens": 1, "start_hour": 24}]}}},
            "teams.t.budgets[0].start_hour: must be at most 23, got 24",
        ),
        (
            {"teams": {"t": {"budgets": [{"window": "day", "tokens": 1, "key": "KEY"}]}}},
            "teams.t.budgets[0].key: expected a key id (8 or more lowercase hex digits)",
        ),
        (
            {"teams": {"t": {"aliases": {"x": [{"model": "m", "weight": "w"}]}}}},
            "teams.t.aliases.x[0].weight: expected a number, got 'w'",
        ),
        ({"teams": {"t": {"name": "u"}}}, "teams.t.name: unknown field"),
        ({"teams": {"t": [1]}}, "teams.t: expected a mapping {name, weight,"),
        ({"keys": [{"sha256": "ab", "team": "t"}]}, "keys[0].sha256: expected the 64 hex"),
        ({"keys": {"sha256": "ab"}}, "keys: expected a list of {sha256, team}"),
        ({"worker_tls": {"server_name": ""}}, "worker_tls.server_name: expected a non-empty"),
    ],
)
def test_nested_errors_name_the_whole_path(raw: dict[str, Any], error: str | None):
    raw = {"models": [MODEL], **raw}
    if error is None:
        config = parse_config(raw, env={})
        assert config.models[2].routing is not None
        assert config.models[2].routing.policy == "kv_aware"
        return
    with pytest.raises(ConfigError) as raised:
        parse_config(raw, env={})
    assert str(raised.value).startswith(error), str(raised.value)


def test_nested_values_are_read_as_declared():
    config = parse_config(
        {
            "queue": {"max_wait": 2},
            "models": [
                {
                    **MODEL,
                    "weights": {"h:1": 2},
                    "prices": {"prompt": 1},
                    "queue": {"max_depth": 3},
                },
                {"name": "r", "kind": "tensor", "workers": ["h:2"]},
            ],
            "teams": {"t": None, "u": {"aliases": {"a": [{"model": "m"}]}}},
            "aliases": {"b": [{"model": "m", "weight": 2}], "c": [{"model": "b"}]},
        },
        env={},
    )
    model, tensor = config.models
    assert model.weights == (("h:1", 2.0),)
    assert model.prices == (1.0, 0.0)
    assert model.queue is not None and (model.queue.max_wait, model.queue.max_depth) == (2.0, 3)
    assert tensor.upstream == "kserve-grpc"
    assert [(t.name, t.weight) for t in config.teams] == [("t", 1.0), ("u", 1.0)]
    assert config.teams[1].aliases[0].targets == (("m", 1.0),)
    assert [(a.name, a.targets) for a in config.aliases] == [
        ("b", (("m", 2.0),)),
        ("c", (("b", 1.0),)),
    ]
