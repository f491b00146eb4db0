"""A request's JSON schema → the schema its output is decoded under.

OpenAI's strict mode and xgrammar's default read an object schema that lists its properties as
closed: no key beyond the declared ones unless the schema allows more with `additionalProperties`.
Plain JSON Schema leaves such an object open, and a small model decoding under an open schema
invents keys until the length limit cuts it (LangChain's tools send schemas without
`additionalProperties`). So every schema is closed that way unless its
request says `strict: false`; the output's whitespace is compact either way (grammar.JSON_DEFAULTS).
"""

from __future__ import annotations

from typing import Any

# Keywords whose value is one subschema, a map of them, or a list of them.
_ONE = ("items", "additionalProperties", "unevaluatedItems", "contains", "not", "if", "then", "else", "propertyNames")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LIST = ("anyOf", "oneOf", "prefixItems")
# An object schema combined with others is left as written: closing one part of an intersection
# would refuse the keys its other parts declare.
_COMBINED = ("allOf", "anyOf", "oneOf", "$ref", "additionalProperties")


def decoded_schema(schema: Any, strict: bool | None) -> Any:
    """The schema the output must match: `schema` closed as strict mode reads it, or as written
    when the request asks for plain JSON Schema (`strict: false`)."""
    return schema if strict is False else closed(schema)


def closed(schema: Any, close_here: bool = True) -> Any:
    """`schema` with `"additionalProperties": false` on every object schema that lists `properties`
    and says nothing of further keys, at any depth (branches of an `allOf` excepted)."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _ONE:
            out[key] = closed(value)
        elif key in _MAP and isinstance(value, dict):
            out[key] = {name: closed(sub) for name, sub in value.items()}
        elif key in _LIST and isinstance(value, list):
            out[key] = [closed(sub) for sub in value]
        elif key == "allOf" and isinstance(value, list):
            out[key] = [closed(sub, close_here=False) for sub in value]
        else:
            out[key] = value
    if close_here and isinstance(schema.get("properties"), dict) and not any(key in schema for key in _COMBINED):
        out["additionalProperties"] = False
    return out
