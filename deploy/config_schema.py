"""Writes the gateway's config fields, declared once in gateway/config.py (`setting`, nested
sections too), where the chart and the docs repeat them: the JSON schema of `gateway.config`,
`gateway.teams` and the config fields of `models[]` in the chart's values.schema.json, and
the configuration table of the docs (docs/reference/configuration.md), a row per field by
its path (`models[].routing.policy`).

    .venv/bin/python deploy/config_schema.py          # rewrites both files
    .venv/bin/python deploy/config_schema.py --check  # exits 1 when either is stale

(A script, not a module of the `gateway` package: it writes files of the repository, which
the installed package does not ship.)
"""

from __future__ import annotations

import json
import sys
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any, get_args, get_origin

from gateway.config import (
    SPECS,
    TYPES,
    Config,
    ModelConfig,
    Spec,
    hints,
    is_section,
    item_of,
    optional,
    spec_of,
)

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "helm" / "furnace-gateway" / "values.schema.json"
PAGE = ROOT / "docs" / "reference" / "configuration.md"
#: The line above the page's table; the table under it is generated, every row.
TABLE_MARKER = (
    "<!-- The table is generated from the declarations in gateway/config.py: "
    "python deploy/config_schema.py -->"
)
#: Top-level fields the chart's `gateway.config` may not hold: the chart writes them from
#: its own values (`gateway.port`, `gateway.adminPort` and its `admin_host`, the same as
#: `host`, `gateway.drainTimeout`, `models`, `gateway.teams`, the
#: Secrets of `gateway.keys` and `gateway.workerTLS`), or passes them outside the ConfigMap
#: (`redis_url`, from a Secret as FURNACE_REDIS_URL; `keys`, only through `keys_file`).
SET_BY_THE_CHART = (
    "host",
    "port",
    "admin_port",
    "admin_host",
    "drain_timeout",
    "models",
    "teams",
    "keys",
    "keys_file",
    "redis_url",
    "worker_tls",
)
#: The chart's own `models[]` values (definitions/model) that it copies into a model's
#: entry unchanged but for their names: their schema is the entry field's.
CHART_MODEL_FIELDS = {
    "name": "name",
    "kind": "kind",
    "workers": "workers",
    "prefillWorkers": "prefill_workers",
    "maxModelLen": "max_model_len",
    "balance": "balance",
    "upstream": "upstream",
    "maxTokensLimit": "max_tokens_limit",
    "scoring": "scoring",
    "weights": "weights",
    "fallbacks": "fallbacks",
    "prices": "prices",
    "toolCallParser": "tool_call_parser",
    "reasoningParser": "reasoning_parser",
    "plainTextContents": "plain_text_contents",
    "queue": "queue",
    "routing": "routing",
    "prefillRouting": "prefill_routing",
    "dataParallelSize": "data_parallel_size",
    "adapterOf": "adapter_of",
    "adapterPath": "adapter_path",
}
#: The other fields of a model's entry, by the chart's value that sets each in a shape of
#: its own: files the chart mounts in the gateway's pods (`tokenizer`, `ca`) and a Secret
#: it passes as an environment variable (`apiKey`).
CHART_MODEL_WIRED = {"tokenizer": "tokenizer", "api_key_env": "apiKey", "ca_file": "ca"}
#: `models[]` sections whose fields go over the top-level section's (`queue`): in the
#: chart's values none is required, since `gateway.config` may hold them.
CHART_MODEL_OVERRIDES = ("queue",)
_JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string", bytes: "string"}


def _described(schema: dict[str, Any], spec: Spec) -> dict[str, Any]:
    schema["description"] = spec.help[0].upper() + spec.help[1:] + "."
    return schema


def _scalar_schema(hint: Any, spec: Spec) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": _JSON_TYPES[hint]}
    if spec.choices:
        schema["enum"] = list(spec.choices)
    if spec.min_length and hint is str:
        schema["minLength"] = spec.min_length
    if spec.pattern is not None:
        schema["pattern"] = f"^{spec.pattern[0]}$"
    if spec.minimum is not None and hint in (int, float):
        schema["minimum"] = spec.minimum
    if spec.maximum is not None and hint in (int, float):
        schema["maximum"] = spec.maximum
    return schema


def section_schema(section: type) -> dict[str, Any]:
    """The JSON schema of a section: each declared field's, the required ones required."""
    types = hints(section)
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {f.name: field_schema(types[f.name], spec_of(f)) for f in fields(section)},
    }
    required = [f.name for f in fields(section) if f.default is MISSING]
    if required:
        schema["required"] = required
    schema["additionalProperties"] = False
    return schema


def _keyed_schema(section: type) -> dict[str, Any]:
    """A mapping keyed by the section's first field, as the loader reads it."""
    key, *rest = fields(section)
    types = hints(section)
    names = _scalar_schema(types[key.name], spec_of(key))
    schema: dict[str, Any] = {"type": "object"}
    if "pattern" in names:
        schema["propertyNames"] = {"pattern": names["pattern"]}
    if len(rest) == 1:  # the value is the only other field
        value = field_schema(types[rest[0].name], spec_of(rest[0]))
        value.pop("description")
    else:
        value = section_schema(section)
        del value["properties"][key.name]
        value["required"] = [name for name in value.get("required", ()) if name != key.name]
        if not value["required"]:
            del value["required"]
        value["type"] = ["object", "null"]  # `NAME:` alone: every field its default
    schema["additionalProperties"] = value
    return schema


def _value_schema(hint: Any, spec: Spec) -> dict[str, Any]:
    item = item_of(hint)
    if spec.shape is not None:
        shaped = section_schema(spec.shape)
        if item is None:
            return shaped
        return {"type": "array", "items": shaped, "minItems": spec.min_length}
    if is_section(hint):
        return section_schema(hint)
    if item is None:
        return _scalar_schema(hint, spec)
    if is_section(item):
        if spec.keyed:
            return _keyed_schema(item)
        return {"type": "array", "items": section_schema(item)}
    if get_origin(item) is tuple:  # `{name: value}`
        return {"type": "object", "additionalProperties": _scalar_schema(get_args(item)[1], spec)}
    return {"type": "array", "items": _scalar_schema(item, spec)}


def field_schema(hint: Any, spec: Spec) -> dict[str, Any]:
    """The JSON schema of a field of type `hint`, from its declaration."""
    inner, nullable = optional(hint)
    schema = _value_schema(inner, spec)
    if nullable:
        schema["type"] = [schema["type"], "null"]
        if "enum" in schema:
            schema["enum"].append(None)
    if schema.get("minItems") == 0:
        del schema["minItems"]
    return _described(schema, spec)


def chart_config_schema() -> dict[str, Any]:
    """`properties` of `gateway.config` in the values schema: every field the chart leaves to
    its values, in declaration order."""
    return {
        name: field_schema(TYPES[name], spec)
        for name, spec in SPECS.items()
        if name not in SET_BY_THE_CHART
    }


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _default(name: str, value: Any) -> str:
    if value is MISSING:
        return "required"
    if isinstance(value, bool):
        return str(value).lower()
    if value is None or value == ():
        return "none"
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, int) and name.endswith("_bytes"):
        for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value >= size and value % size == 0:
                return f"{value // size} {unit}"
    return _number(value)


def _bounds(spec: Spec) -> str:
    if spec.choices:
        return "one of " + ", ".join(f"`{choice}`" for choice in spec.choices)
    if spec.minimum is not None and spec.maximum is not None:
        return f"from {_number(spec.minimum)} to {_number(spec.maximum)}"
    if spec.minimum is not None:
        return f"at least {_number(spec.minimum)}"
    if spec.pattern is not None:
        return spec.pattern[1]
    if spec.min_length:
        return "not empty"
    return ""


def _rows(prefix: str, section: type, seen: set[type]) -> list[str]:
    """A row for each field of `section`, then the rows of the sections it holds, each
    section once, where it is nearest the top (a model's `queue` is shaped as the top-level
    one), their paths after `prefix`."""
    rows = []
    held = []
    types = hints(section)
    for declared in fields(section):
        spec = spec_of(declared)
        path = f"{prefix}{declared.name}"
        inner, _ = optional(types[declared.name])
        item = item_of(inner)
        bounds = _bounds(spec)
        if item is str and bounds == "not empty":
            bounds = "each not empty"
        meaning = f"{spec.help} ({bounds})" if bounds else spec.help
        default = _default(declared.name, declared.default)
        rows.append(f"| `{path}` | {default} | {meaning.replace('|', chr(92) + '|')} |")
        below = spec.shape or (inner if is_section(inner) else item)
        if is_section(below) and below not in seen:
            seen.add(below)
            held.append((path, below, spec, item is not None))
    for path, below, spec, listed in held:
        if not spec.keyed:
            rows += _rows(f"{path}[]." if listed else f"{path}.", below, seen)
            continue
        key, *rest = fields(below)
        if len(rest) == 1:  # `NAME: [...]`: the list of the only other field
            shape = spec_of(rest[0]).shape or below
            rows += _rows(f"{path}.{key.name.upper()}[].", shape, seen)
        else:
            rows += _rows(f"{path}.{key.name.upper()}.", below, seen)[1:]
    return rows


def table_rows() -> list[str]:
    """The table's header and a row for each field, nested ones by their path."""
    return ["| field | default | meaning |", "| --- | --- | --- |", *_rows("", Config, set())]


def render_schema(text: str) -> str:
    """The values schema `text` with what it holds of the config regenerated: the
    properties of `gateway.config`, `gateway.teams` (the config's `teams`, as they are),
    and the fields of `models[]` the chart copies into the config's models."""
    schema = json.loads(text)
    gateway = schema["properties"]["gateway"]["properties"]
    gateway["config"]["properties"] = chart_config_schema()
    teams = field_schema(TYPES["teams"], SPECS["teams"])
    gateway["teams"] = {**teams, "description": gateway["teams"]["description"]}
    model = schema["definitions"]["model"]["properties"]
    types = hints(ModelConfig)
    specs = {f.name: spec_of(f) for f in fields(ModelConfig)}
    for chart_name, name in CHART_MODEL_FIELDS.items():
        model[chart_name] = field_schema(types[name], specs[name])
        if name in CHART_MODEL_OVERRIDES:
            model[chart_name].pop("required")
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def render_page(text: str) -> str:
    """The configuration page's `text` with its table regenerated."""
    lines = text.split("\n")
    start = lines.index(TABLE_MARKER) + 1
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    if end == start:
        raise ValueError(f"{PAGE.name}: no table under {TABLE_MARKER!r}")
    return "\n".join([*lines[:start], *table_rows(), *lines[end:]])


def main(argv: list[str]) -> int:
    check = argv == ["--check"]
    if argv and not check:
        print(__doc__, file=sys.stderr)
        return 2
    stale = []
    for path, render in ((SCHEMA, render_schema), (PAGE, render_page)):
        text = path.read_text()
        fresh = render(text)
        if fresh != text:
            stale.append(path.relative_to(ROOT))
            if not check:
                path.write_text(fresh)
    for path in stale:
        print(f"{path}: {'stale' if check else 'regenerated'}")
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
