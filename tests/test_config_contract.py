"""The config is declared once (gateway/config.py); the chart and the docs repeat it, so
these tests fail on drift: the generated schema and the docs' table are fresh, every config
field the chart names exists, and the loader and the chart's schema refuse the same
values (a value the schema accepts is one the gateway starts with)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.config import (
    SPECS,
    TYPES,
    BudgetConfig,
    Config,
    ConfigError,
    ModelConfig,
    Prices,
    QueueConfig,
    RoutingConfig,
    TeamConfig,
    WorkerTLS,
    hints,
    optional,
    parse_config,
)

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "furnace-gateway"
FIELDS = {f.name for f in fields(Config)}


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location(
        "config_schema", ROOT / "deploy" / "config_schema.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GENERATOR = _generator()
SCHEMA = json.loads((CHART / "values.schema.json").read_text())
CONFIG_SCHEMA = SCHEMA["properties"]["gateway"]["properties"]["config"]
VALUES_TEXT = (CHART / "values.yaml").read_text()
VALUES = yaml.safe_load(VALUES_TEXT)
HELPERS = (CHART / "templates" / "_helpers.tpl").read_text()
#: Numeric fields the chart's `gateway.config` may hold.
CHART_NUMBERS = [
    name for name, schema in CONFIG_SCHEMA["properties"].items() if "minimum" in schema
]


def _problems(schema: dict[str, Any], value: Any) -> list[str]:
    """Why `value` fails a field's schema: jsonschema's verdict when it is installed, else
    the keywords the generated field schemas use."""
    try:
        import jsonschema
    except ImportError:
        pass
    else:
        validator = jsonschema.Draft7Validator(schema)
        return [error.message for error in validator.iter_errors(value)]
    kinds = {
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "string": lambda v: isinstance(v, str),
    }
    if not kinds[schema["type"]](value):
        return [f"{value!r} is not of type {schema['type']}"]
    problems = []
    if "enum" in schema and value not in schema["enum"]:
        problems.append(f"{value!r} is not one of {schema['enum']}")
    if "minLength" in schema and len(value) < schema["minLength"]:
        problems.append(f"{value!r} is too short")
    if "minimum" in schema and value < schema["minimum"]:
        problems.append(f"{value!r} is less than the minimum of {schema['minimum']}")
    if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
        problems.append(f"{value!r} is not above {schema['exclusiveMinimum']}")
    if "maximum" in schema and value > schema["maximum"]:
        problems.append(f"{value!r} is more than the maximum of {schema['maximum']}")
    return problems


def _just_under(name: str, minimum: float) -> float:
    if TYPES[name] is int:
        return minimum - 1
    return minimum - min(minimum / 2, 0.001) if minimum > 0 else minimum - 0.001


def _helm(*args: str) -> subprocess.CompletedProcess[str]:
    helm = ROOT / ".tools" / "bin" / "helm"
    if not os.access(helm, os.X_OK):
        pytest.fail(".tools/bin/helm is missing: run `bash deploy/install-tools.sh` first")
    return subprocess.run(
        [str(helm), "template", "contract", str(CHART), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )


def test_the_values_schema_is_generated_from_the_declarations():
    text = (CHART / "values.schema.json").read_text()
    assert GENERATOR.render_schema(text) == text, "run: python deploy/config_schema.py"


def test_the_docs_table_is_generated_from_the_declarations():
    text = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    assert GENERATOR.render_page(text) == text, "run: python deploy/config_schema.py"


def test_the_check_mode_finds_the_committed_files_fresh():
    result = subprocess.run(
        [sys.executable, str(ROOT / "deploy" / "config_schema.py"), "--check"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_field_is_declared_with_a_meaning_and_numbers_with_a_minimum():
    assert set(SPECS) == FIELDS
    for name, spec in SPECS.items():
        assert spec.help, name
        if TYPES[name] in (int, float):
            assert spec.minimum is not None, f"{name}: a number needs a minimum"
            assert getattr(Config(), name) >= spec.minimum, name


def test_the_chart_leaves_out_exactly_the_fields_it_sets():
    allowed = set(CONFIG_SCHEMA["properties"])
    set_by_chart = set(re.findall(r'set \$config "(\w+)"', HELPERS))
    assert set_by_chart <= set(GENERATOR.SET_BY_THE_CHART)
    assert allowed | set(GENERATOR.SET_BY_THE_CHART) == FIELDS
    assert not allowed & set_by_chart


def test_every_config_field_the_chart_names_exists():
    # _helpers.tpl: the top-level fields, a model's and worker_tls's
    assert set(re.findall(r'set \$config "(\w+)"', HELPERS)) <= FIELDS
    assert set(re.findall(r'set \$entry "(\w+)"', HELPERS)) <= {f.name for f in fields(ModelConfig)}
    tls_line = next(line for line in HELPERS.splitlines() if "$tls := dict" in line)
    tls = set(re.findall(r'"(\w+)" \(', tls_line)) | set(re.findall(r'set \$tls "(\w+)"', HELPERS))
    assert tls
    assert tls <= {f.name for f in fields(WorkerTLS)}
    # values.yaml: the keys of gateway.config, the fields its comment lists, and every
    # "the config's `field`" (or `field.subfield`) in a comment
    config = VALUES["gateway"]["config"]
    assert set(config) <= FIELDS
    comment = VALUES_TEXT.split("  # The gateway's config file", 1)[1].split("  config:\n", 1)[0]
    listed = set(re.findall(r"`(\w+)`", comment))
    assert listed <= FIELDS, sorted(listed - FIELDS)
    prose = " ".join(line.strip().lstrip("#").strip() for line in comment.splitlines())
    may_be_added = prose.split("These fields may be added", 1)[1].split(". The", 1)[0]
    assert set(re.findall(r"`(\w+)`", may_be_added)) | set(config) == set(
        CONFIG_SCHEMA["properties"]
    )
    named = re.findall(r"config(?:'s| as) `(\w+)", VALUES_TEXT)
    named += re.findall(r"`(worker_tls)\.\w+`", VALUES_TEXT)
    assert named
    assert set(named) <= FIELDS, sorted(set(named) - FIELDS)


def test_the_chart_sets_every_field_of_a_model():
    # each field of a model's entry from one value of the chart's `models[]`, copied or
    # wired (a file it mounts, a Secret it passes), and values.yaml names each value
    copied, wired = GENERATOR.CHART_MODEL_FIELDS, GENERATOR.CHART_MODEL_WIRED
    assert set(copied.values()) | set(wired) == {f.name for f in fields(ModelConfig)}
    assert not set(copied.values()) & set(wired)
    values = set(SCHEMA["definitions"]["model"]["properties"])
    assert values == set(copied) | set(wired.values()) | {"pools", "prefillPools"}
    comment = VALUES_TEXT.split("# -- The models the gateway serves", 1)[1].split("\nmodels:")[0]
    assert values <= set(re.findall(r"`(\w+)`", comment)), sorted(values)


def test_the_charts_defaults_pass_the_schema_and_the_loader():
    config = VALUES["gateway"]["config"]
    for name, value in config.items():
        assert _problems(CONFIG_SCHEMA["properties"][name], value) == [], name
    parse_config(config, env={})
    # chart values the chart writes into the config stay within the loader's bounds
    gateway = SCHEMA["properties"]["gateway"]["properties"]
    for value_name, field_name in (("port", "port"), ("drainTimeout", "drain_timeout")):
        spec = SPECS[field_name]
        assert spec.minimum is not None
        assert gateway[value_name]["minimum"] >= spec.minimum, value_name
        if spec.maximum is not None:
            assert gateway[value_name]["maximum"] <= spec.maximum, value_name
        parse_config({field_name: VALUES["gateway"][value_name]}, env={})


@pytest.mark.parametrize("name", CHART_NUMBERS)
def test_the_loader_and_the_schema_refuse_the_same_numbers(name: str):
    schema = CONFIG_SCHEMA["properties"][name]
    minimum = SPECS[name].minimum
    assert minimum is not None
    under = _just_under(name, minimum)
    with pytest.raises(ConfigError, match=f"^{name}: must be at least {minimum}, got "):
        parse_config({name: under}, env={})
    assert _problems(schema, under)
    parse_config({name: minimum}, env={})
    assert _problems(schema, minimum) == []


def _nested_numbers() -> list[tuple[str, str, Any, dict[str, Any]]]:
    """(path, field, its type, its schema) of each number of a section the chart's values
    hold as the config does: the queue, a team, a team's budget, and a model's weights,
    prices, queue and routing (as `models[]` in the chart)."""
    gateway = SCHEMA["properties"]["gateway"]["properties"]
    team = gateway["teams"]["additionalProperties"]["properties"]
    model = SCHEMA["definitions"]["model"]["properties"]
    found = []
    for path, section, properties in (
        ("queue", QueueConfig, CONFIG_SCHEMA["properties"]["queue"]["properties"]),
        ("teams.t", TeamConfig, team),
        ("teams.t.budgets[0]", BudgetConfig, team["budgets"]["items"]["properties"]),
        ("models[0].prices", Prices, model["prices"]["properties"]),
        ("models[0].queue", QueueConfig, model["queue"]["properties"]),
        ("models[0].routing", RoutingConfig, model["routing"]["properties"]),
    ):
        types = hints(section)
        for declared in fields(section):
            kind, _ = optional(types[declared.name])
            if kind in (int, float):
                found.append((path, declared.name, kind, properties[declared.name]))
    found.append(("models[0].weights", "h:1", float, model["weights"]["additionalProperties"]))
    return found


def _placed(path: str, name: str, value: Any) -> dict[str, Any]:
    """A config with `value` at `path.name`, all else the least that loads."""
    model: dict[str, Any] = {"name": "m", "workers": ["h:1"]}
    budget: dict[str, Any] = {"window": "day", "tokens": 1}
    raw: dict[str, Any] = {"models": [model], "queue": {"max_wait": 1}, "teams": {"t": {}}}
    if path == "queue":
        raw["queue"][name] = value
    elif path == "teams.t":
        raw["teams"]["t"][name] = value
    elif path == "teams.t.budgets[0]":
        raw["teams"]["t"]["budgets"] = [{**budget, name: value}]
    else:
        model[path.rsplit(".", 1)[1]] = {name: value}
    return raw


@pytest.mark.parametrize(
    ("path", "name", "kind", "schema"),
    _nested_numbers(),
    ids=[f"{path}.{name}" for path, name, _, _ in _nested_numbers()],
)
def test_the_loader_and_the_schema_refuse_the_same_nested_numbers(
    path: str, name: str, kind: type, schema: dict[str, Any]
):
    minimum, maximum = schema["minimum"], schema.get("maximum")
    assert "exclusiveMinimum" not in schema
    step = 1 if kind is int else min(abs(minimum) / 2, 0.001) if minimum else 0.001
    where = re.escape(f"{path}.{name}: must be at ")
    for bound, beyond in (
        (minimum, minimum - step),
        (maximum, None if maximum is None else maximum + step),
    ):
        if beyond is None:
            continue
        with pytest.raises(ConfigError, match=f"^{where}"):
            parse_config(_placed(path, name, beyond), env={})
        assert _problems(schema, beyond), (path, name, beyond)
        parse_config(_placed(path, name, bound), env={})
        assert _problems(schema, bound) == []


def test_a_number_over_its_maximum_is_refused():
    with pytest.raises(ConfigError, match=r"^port: must be at most 65535, got 65536$"):
        parse_config({"port": 65536}, env={})
    assert parse_config({"port": 65535}, env={}).port == 65535


@pytest.mark.parametrize(
    "name", ["request_timeout", "discovery_interval", "redis_timeout", "max_header_bytes"]
)
def test_helm_refuses_what_the_gateway_would_refuse(name: str):
    minimum = SPECS[name].minimum
    assert minimum is not None
    under = _just_under(name, minimum)
    refused = _helm("--set-json", f"gateway.config.{name}={json.dumps(under)}")
    assert refused.returncode != 0
    assert "values don't meet the specifications of the schema" in refused.stderr
    accepted = _helm("--set-json", f"gateway.config.{name}={json.dumps(minimum)}")
    assert accepted.returncode == 0, accepted.stderr


@pytest.mark.parametrize(
    ("value", "field", "refused", "accepted"),
    [
        ("gateway.config.queue", "queue.max_wait", {"max_wait": 0.0005}, {"max_wait": 0.001}),
        ("gateway.teams", "teams.t.weight", {"t": {"weight": 0.0005}}, {"t": {"weight": 0.001}}),
        ("gateway.teams", "teams.t.priority", {"t": {"priority": 1001}}, {"t": {"priority": 1000}}),
    ],
)
def test_helm_refuses_the_nested_values_the_gateway_would_refuse(
    value: str, field: str, refused: Any, accepted: Any
):
    top = field.split(".", 1)[0]
    with pytest.raises(ConfigError, match=f"^{re.escape(field)}: must be at "):
        parse_config({top: refused}, env={})
    parse_config({top: accepted}, env={})
    open_ = ("--set", "gateway.allowUnauthenticated=true")  # teams without keys
    result = _helm(*open_, "--set-json", f"{value}={json.dumps(refused)}")
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    result = _helm(*open_, "--set-json", f"{value}={json.dumps(accepted)}")
    assert result.returncode == 0, result.stderr
