"""Writes the gateway's config fields, declared once in gateway/config.py (`setting`), where
the chart and the docs repeat them: the JSON schema of `gateway.config` in the chart's
values.schema.json, and the rows of top-level fields in the configuration table of the docs
(docs/reference/configuration.md).

    .venv/bin/python deploy/config_schema.py          # rewrites both files
    .venv/bin/python deploy/config_schema.py --check  # exits 1 when either is stale

(A script, not a module of the `gateway` package: it writes files of the repository, which
the installed package does not ship.)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from gateway.config import SPECS, TYPES, AliasConfig, Config, QueueConfig, Spec

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = ROOT / "helm" / "furnace-gateway" / "values.schema.json"
PAGE = ROOT / "docs" / "reference" / "configuration.md"
#: The line above the page's table; the rows below it, up to the first `models[]` row
#: (written by hand), are generated.
TABLE_MARKER = (
    "<!-- The table's header and its rows of top-level fields are generated from "
    "gateway/config.py: python deploy/config_schema.py -->"
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
_JSON_TYPES = {int: "integer", float: "number", bool: "boolean", str: "string"}


def field_schema(name: str) -> dict[str, Any]:
    """The JSON schema of one top-level scalar field, from its declaration."""
    spec = SPECS[name]
    if TYPES[name] == tuple[str, ...]:
        schema: dict[str, Any] = {"type": "array", "items": {"type": "string"}}
    elif TYPES[name] == QueueConfig | None:
        schema = {
            "type": ["object", "null"],
            "properties": {
                "max_wait": {"type": "number", "exclusiveMinimum": 0},
                "max_depth": {"type": "integer", "minimum": 1},
                "max_starvation": {"type": "number", "exclusiveMinimum": 0},
            },
            "required": ["max_wait"],
            "additionalProperties": False,
        }
    elif TYPES[name] == tuple[AliasConfig, ...]:
        target = {
            "type": "object",
            "properties": {
                "model": {"type": "string", "minLength": 1},
                "weight": {"type": "number", "minimum": 0},
            },
            "required": ["model"],
            "additionalProperties": False,
        }
        schema = {
            "type": "object",
            "additionalProperties": {"type": "array", "items": target, "minItems": 1},
        }
    else:
        schema = {"type": _JSON_TYPES[TYPES[name]]}
    if spec.choices:
        schema["enum"] = list(spec.choices)
    if spec.min_length:
        schema["minLength"] = spec.min_length
    if spec.minimum is not None:
        schema["minimum"] = spec.minimum
    if spec.maximum is not None:
        schema["maximum"] = spec.maximum
    schema["description"] = spec.help[0].upper() + spec.help[1:] + "."
    return schema


def chart_config_schema() -> dict[str, Any]:
    """`properties` of `gateway.config` in the values schema: every field the chart leaves to
    its values, in declaration order."""
    return {name: field_schema(name) for name in SPECS if name not in SET_BY_THE_CHART}


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


def _default(name: str, value: Any) -> str:
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
    if spec.min_length:
        return "not empty"
    return ""


def table_rows() -> list[str]:
    """The table's header and a row for each top-level field."""
    defaults = Config()
    rows = ["| field | default | meaning |", "| --- | --- | --- |"]
    for name, spec in SPECS.items():
        bounds = _bounds(spec)
        meaning = f"{spec.help} ({bounds})" if bounds else spec.help
        rows.append(f"| `{name}` | {_default(name, getattr(defaults, name))} | {meaning} |")
    return rows


def render_schema(text: str) -> str:
    """The values schema `text` with its `gateway.config` properties regenerated."""
    schema = json.loads(text)
    config = schema["properties"]["gateway"]["properties"]["config"]
    config["properties"] = chart_config_schema()
    return json.dumps(schema, indent=2, ensure_ascii=False) + "\n"


def render_page(text: str) -> str:
    """The configuration page's `text` with its table's generated rows regenerated."""
    lines = text.split("\n")
    start = lines.index(TABLE_MARKER) + 1
    end = start
    while (
        end < len(lines) and lines[end].startswith("|") and not lines[end].startswith("| `models[")
    ):
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
