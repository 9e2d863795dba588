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
"""

from __future__ import annotations

from collections.abc import Mapping
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
        stack: list[tuple[Any, int]] = [(schema, 1)]
        while stack:
            node, depth = stack.pop()
            if not isinstance(node, Mapping):
                continue  # true/false schemas, or what the worker will refuse as not one
            self.subschemas += 1
            if self.subschemas > MAX_SUBSCHEMAS:
                self._refuse(param, f"more than {MAX_SUBSCHEMAS} subschemas")
            if depth > MAX_DEPTH:
                self._refuse(param, f"more than {MAX_DEPTH} levels of nesting")
            self._values(node, param)
            for key, nests in _ONE.items():
                if key in node:
                    stack.append((node[key], depth + nests))
            for key, nests in _LIST.items():
                items = node.get(key)
                if isinstance(items, list):
                    stack.extend((item, depth + nests) for item in items)
            for key, nests in _NAMED.items():
                named = node.get(key)
                if not isinstance(named, Mapping):
                    continue
                if key == "properties":
                    self.properties += len(named)
                    if self.properties > MAX_PROPERTIES:
                        self._refuse(param, f"more than {MAX_PROPERTIES} object properties")
                self._add_names(sum(len(str(name)) for name in named), param)
                stack.extend((item, depth + nests) for item in named.values())

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
