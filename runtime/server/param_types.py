"""XML tool-call parameter values -> JSON values, typed by the tool's JSON schema (checkpoint-formats §9.3).

| schema type                          | conversion                                              |
|--------------------------------------|---------------------------------------------------------|
| string / enum                        | kept as is                                              |
| integer                              | int()                                                   |
| number                               | float(), an int when integral                           |
| boolean                              | "true" / "false" (any case)                             |
| object / array                       | JSON, else a Python literal                             |
| nullable, text "null" / "None"       | null                                                    |
| not in the schema, or not convertible| the raw string                                          |
"""

from __future__ import annotations

import ast
import json
from typing import Any


def schema_types(schema: dict | None) -> set[str]:
    """The JSON-schema types a parameter allows (`type` as a string or list, or inside anyOf/oneOf)."""
    if not isinstance(schema, dict):
        return set()
    types: set[str] = set()
    t = schema.get("type")
    if isinstance(t, str):
        types.add(t)
    elif isinstance(t, list):
        types.update(x for x in t if isinstance(x, str))
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            types |= schema_types(sub)
    if not types and "enum" in schema:
        types.add("string")
    if schema.get("nullable") is True:
        types.add("null")
    return types


def convert_param(text: str, schema: dict | None) -> Any:
    """Raw parameter text -> a JSON value, typed by the parameter's schema; text that does not fit stays a string."""
    types = schema_types(schema)
    stripped = text.strip()
    if "null" in types and stripped in ("null", "None"):
        return None
    if not types or "string" in types:
        return text
    if "integer" in types:
        try:
            return int(stripped)
        except ValueError:
            pass
    if "number" in types:
        try:
            value = float(stripped)
            return int(value) if value.is_integer() and abs(value) < 2**53 else value
        except ValueError:
            pass
    if "boolean" in types and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    if types & {"object", "array"}:
        try:
            return json.loads(stripped)
        except ValueError:
            try:
                return ast.literal_eval(stripped)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                pass
    return text
