"""The config: defaults, YAML, environment overrides, errors that name the field."""

import pytest

from gateway.config import Config, ConfigError, load_config, parse_config

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
