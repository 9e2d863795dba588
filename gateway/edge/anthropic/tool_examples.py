"""A custom tool's `input_examples` (Anthropic's tool use examples): inputs that show the
model how to call the tool, beyond what its schema says.

Each example is checked against the tool's `input_schema`, as Anthropic's API checks it (an
example the schema refuses is a 400 naming it), then shown to the model after the tool's
description, one JSON object a line under a heading (`render`): how Anthropic lays them out
for Claude is not public, and a template sees a tool's description and schema alone.

Bounds, since both the schema and the instances are the client's: at most `MAX_EXAMPLES` a
tool, `MAX_EXAMPLE_BYTES` of JSON each. The check leaves out what could cost the gateway
more than the example's size: `pattern` and `patternProperties` (a client's regular
expression run by Python's `re` can backtrack for hours on a short string; where a schema
has `patternProperties`, its `additionalProperties` is not checked either, since which
properties are additional depends on them) and `uniqueItems` (quadratic on lists of
objects). Those keywords still reach the model with the schema. jsonschema is imported on
first use: a gateway whose clients send no examples never loads it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from gateway.edge.errors import invalid

#: The most examples a tool takes.
MAX_EXAMPLES = 20
#: The most bytes of one example, as JSON.
MAX_EXAMPLE_BYTES = 16 * 1024
#: What comes between a tool's description and its examples.
HEADING = "\n\nExamples of this tool's input:\n"

#: Keywords whose value is one subschema or a list of them.
_SUBSCHEMAS = frozenset(
    {
        "items",
        "prefixItems",
        "additionalItems",
        "unevaluatedItems",
        "contains",
        "additionalProperties",
        "unevaluatedProperties",
        "propertyNames",
        "allOf",
        "anyOf",
        "oneOf",
        "not",
        "if",
        "then",
        "else",
    }
)
#: Keywords whose value maps names to subschemas.
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "dependentSchemas"})
#: Keywords not checked (see the module's docstring).
_UNCHECKED = frozenset({"pattern", "patternProperties", "uniqueItems"})


def _checkable(schema: Any) -> Any:
    """`schema` without the keywords the check leaves out (`_UNCHECKED`), at every level."""
    if isinstance(schema, list):
        return [_checkable(item) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    patterned = "patternProperties" in schema
    kept: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _UNCHECKED or (
            patterned and key in ("additionalProperties", "unevaluatedProperties")
        ):
            continue
        if key in _SUBSCHEMAS:
            kept[key] = _checkable(value)
        elif key in _SCHEMA_MAPS and isinstance(value, Mapping):
            kept[key] = {name: _checkable(sub) for name, sub in value.items()}
        else:
            kept[key] = value
    return kept


def render(tool: Mapping[str, Any], schema: Mapping[str, Any], where: str) -> str:
    """The text the tool's examples add to its description ("" for none), each checked
    against `schema`, or a 400 naming the example at fault."""
    examples = tool.get("input_examples")
    if examples is None or examples == []:
        return ""
    param = f"{where}.input_examples"
    if not isinstance(examples, list) or len(examples) > MAX_EXAMPLES:
        raise invalid(param, f"{param}: a list of at most {MAX_EXAMPLES} input objects.")
    import jsonschema  # first use: see the module's docstring
    from referencing.exceptions import Unresolvable  # jsonschema's own

    try:
        validator = jsonschema.validators.validator_for(schema)(_checkable(schema))
    except jsonschema.SchemaError as error:  # not an error `SchemaBudget` looks for
        raise invalid(param, f"{param}: cannot be checked: {error.message[:256]}") from None
    lines = []
    for i, example in enumerate(examples):
        at = f"{param}[{i}]"
        if not isinstance(example, Mapping):
            raise invalid(at, f"{at}: an input is an object.")
        text = orjson.dumps(example)
        if len(text) > MAX_EXAMPLE_BYTES:
            raise invalid(at, f"{at}: at most {MAX_EXAMPLE_BYTES} bytes of JSON.")
        try:
            mismatch = jsonschema.exceptions.best_match(validator.iter_errors(example))
        except Unresolvable as unresolvable:
            raise invalid(at, f"{at}: cannot be checked: {unresolvable}"[:512]) from None
        if mismatch is not None:
            place = "".join(f"[{p!r}]" for p in mismatch.absolute_path)
            raise invalid(
                at,
                f"{at} does not match the tool's input_schema{place and ' at ' + place}: "
                f"{mismatch.message[:256]}",
            )
        lines.append(text.decode())
    return HEADING + "\n".join(lines)
