"""Bounds on the JSON Schemas of one request (`response_format`'s and the tools'
parameters), at the edge, before any worker compiles a grammar from them.

A worker compiles a grammar from each schema, and its cost grows with the schema's
structure: a 430 KB schema with `n` 32 held a transformers worker's one engine thread
for 9.2 s. So a request's schemas, together, are held to OpenAI's documented limits for
Structured Outputs (its guide's "Supported schemas"): at most 5,000 object properties
and 10 levels of nesting, 1,000 enum values, 120,000 characters of property names,
definition names, enum and const values, and 15,000 characters of values in one string
enum of more than 250. Past those, ours: at most `MAX_SUBSCHEMAS` schemas in all (a
chain of `anyOf` nests no data, but each is a state to compile). Each is a 400 naming
the parameter that holds the schema. The walk is iterative (a stack), one pass over
what the body already parsed: about a microsecond per subschema.

The same walk checks that each schema is one: every subschema an object or a boolean,
and the keywords a grammar is built from of the types the JSON Schema metaschema gives
them (`required` a list of names, `minLength` a count, `minimum` a number, `type` a
JSON type...), a 400 saying where, as OpenAI's "Invalid schema for response_format".
A worker handed `"required": 5` failed on it, a 500 that counted toward its ejection:
three such requests took a model's only worker out for every client. (jsonschema's own
metaschema check would say the same, at 2.9 ms for a three-property schema and 2.8 s
for one at the property limit, on the loop.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from gateway.edge.errors import invalid

#: OpenAI's limits (developers' guide, Structured Outputs, "Supported schemas").
MAX_PROPERTIES = 5_000
MAX_DEPTH = 10
MAX_ENUM_VALUES = 1_000
MAX_NAME_CHARS = 120_000
LARGE_ENUM = 250
MAX_LARGE_ENUM_CHARS = 15_000
#: Ours: subschemas of one request in all.
MAX_SUBSCHEMAS = 10_000

#: Keywords whose value is one subschema (a level deeper when it nests data).
_ONE = {"items": True, "additionalProperties": True, "not": False, "contains": True}
_ONE |= {"if": False, "then": False, "else": False, "propertyNames": False}
#: Keywords whose value is a list of subschemas.
_LIST = {"prefixItems": True, "anyOf": False, "allOf": False, "oneOf": False}
#: Keywords whose value maps names to subschemas (names count toward the characters).
_NAMED = {"properties": True, "patternProperties": True, "$defs": False, "definitions": False}

#: The JSON types `type` may name.
_TYPE_NAMES = frozenset({"null", "boolean", "object", "array", "number", "string", "integer"})


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_count(value: Any) -> bool:
    """A non-negative integer, as JSON Schema counts them (2.0 is one)."""
    if isinstance(value, float):
        return value >= 0 and value.is_integer()
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_type(value: Any) -> bool:
    if isinstance(value, str):
        return value in _TYPE_NAMES
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(v, str) and v in _TYPE_NAMES for v in value)
        and len(set(value)) == len(value)
    )


def _is_schema(value: Any) -> bool:
    return isinstance(value, Mapping | bool)


#: Keyword -> (whether its value is of the metaschema's type, what that type is).
_KEYWORDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "type": (_is_type, "a JSON type's name, or a list of distinct ones"),
    "required": (
        lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v),
        "a list of property names",
    ),
    "enum": (lambda v: isinstance(v, list), "a list"),
    "uniqueItems": (lambda v: isinstance(v, bool), "a boolean"),
    "multipleOf": (lambda v: _is_number(v) and v > 0, "a number above 0"),
    **dict.fromkeys(
        ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"), (_is_number, "a number")
    ),
    **dict.fromkeys(
        ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"),
        (_is_count, "a non-negative integer"),
    ),
    **dict.fromkeys(("minContains", "maxContains"), (_is_count, "a non-negative integer")),
    **dict.fromkeys(
        ("pattern", "format", "$ref", "$id", "$anchor", "$schema", "title", "description"),
        (lambda v: isinstance(v, str), "a string"),
    ),
    **dict.fromkeys(_ONE, (_is_schema, "a schema (an object or a boolean)")),
    # draft 7's tuples: a list of schemas
    "items": (lambda v: _is_schema(v) or isinstance(v, list), "a schema, or a list of schemas"),
    **dict.fromkeys(
        _LIST,
        (lambda v: isinstance(v, list) and bool(v), "a non-empty list of schemas"),
    ),
    **dict.fromkeys(_NAMED, (lambda v: isinstance(v, Mapping), "an object of schemas")),
}


class SchemaBudget:
    """What the schemas of one request have used of the limits so far."""

    __slots__ = ("enum_values", "names", "properties", "subschemas")

    def __init__(self) -> None:
        self.properties = 0
        self.enum_values = 0
        self.names = 0
        self.subschemas = 0

    def check(self, schema: Any, param: str) -> None:
        """Adds `schema` (parsed JSON) to the request's use; a 400 naming `param` when
        the request's schemas together pass a limit."""
        stack: list[tuple[Any, int, tuple[str, ...]]] = [(schema, 1, ())]
        while stack:
            node, depth, path = stack.pop()
            if not isinstance(node, Mapping):
                if not isinstance(node, bool):  # true/false are schemas
                    _not_a_schema(param, path, "a schema must be an object or a boolean")
                continue
            for key, value in node.items():
                check = _KEYWORDS.get(key)
                if check is not None and not check[0](value):
                    _not_a_schema(param, (*path, key), f"'{key}' must be {check[1]}")
            self.subschemas += 1
            if self.subschemas > MAX_SUBSCHEMAS:
                self._refuse(param, f"more than {MAX_SUBSCHEMAS} subschemas")
            if depth > MAX_DEPTH:
                self._refuse(param, f"more than {MAX_DEPTH} levels of nesting")
            self._values(node, param)
            for key, nests in _ONE.items():
                if key in node:
                    one = node[key]
                    if isinstance(one, list):  # draft 7's tuple `items`
                        stack.extend(
                            (v, depth + nests, (*path, key, str(i))) for i, v in enumerate(one)
                        )
                    else:
                        stack.append((one, depth + nests, (*path, key)))
            for key, nests in _LIST.items():
                items = node.get(key)
                if isinstance(items, list):
                    stack.extend(
                        (item, depth + nests, (*path, key, str(i))) for i, item in enumerate(items)
                    )
            for key, nests in _NAMED.items():
                named = node.get(key)
                if not isinstance(named, Mapping):
                    continue
                if key == "properties":
                    self.properties += len(named)
                    if self.properties > MAX_PROPERTIES:
                        self._refuse(param, f"more than {MAX_PROPERTIES} object properties")
                self._add_names(sum(len(str(name)) for name in named), param)
                stack.extend(
                    (item, depth + nests, (*path, key, str(name))) for name, item in named.items()
                )

    def _values(self, node: Mapping[str, Any], param: str) -> None:
        """The node's enum and const values, against the counts and characters."""
        enum = node.get("enum")
        if isinstance(enum, list):
            self.enum_values += len(enum)
            if self.enum_values > MAX_ENUM_VALUES:
                self._refuse(param, f"more than {MAX_ENUM_VALUES} enum values")
            chars = sum(len(v) if isinstance(v, str) else len(str(v)) for v in enum)
            strings = len(enum) > LARGE_ENUM and all(isinstance(v, str) for v in enum)
            if strings and chars > MAX_LARGE_ENUM_CHARS:
                self._refuse(
                    param,
                    f"an enum of more than {LARGE_ENUM} strings longer than "
                    f"{MAX_LARGE_ENUM_CHARS} characters in all",
                )
            self._add_names(chars, param)
        if "const" in node:
            const = node["const"]
            self._add_names(len(const) if isinstance(const, str) else len(str(const)), param)

    def _add_names(self, chars: int, param: str) -> None:
        self.names += chars
        if self.names > MAX_NAME_CHARS:
            self._refuse(
                param,
                f"more than {MAX_NAME_CHARS} characters of property and definition names, "
                "enum and const values",
            )

    @staticmethod
    def _refuse(param: str, what: str) -> None:
        raise invalid(param, f"Invalid schema for '{param}': the request's schemas hold {what}.")


def _not_a_schema(param: str, path: tuple[str, ...], what: str) -> None:
    """A 400: the value at `path` of the schema in `param` is not what JSON Schema says."""
    where = f" (at {'/'.join(path)})" if path else ""
    raise invalid(param, f"Invalid schema for '{param}'{where}: {what}.")
