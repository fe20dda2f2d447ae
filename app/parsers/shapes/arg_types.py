"""Argument values written as text, read by the offered tool's JSON schema.

XML parameters, GLM's ``<arg_value>`` and the like carry every value as text;
the model's template documents that the tool's schema says what the text
means (Qwen3-Coder's and GLM's templates render non-string arguments with
``tojson``). So ``"5"`` for an integer parameter is ``5``, a string parameter
keeps its text as it is (``"123 Main St"``, ``"null"`` included), ``"null"``
for a nullable one is ``null``, and objects and arrays are parsed. Text the
schema's types cannot read stays a string, as llama.cpp and vLLM keep it,
rather than failing the call.

    value_of("42", {"type": "integer"})                -> 42
    value_of("42", {"type": "string"})                 -> "42"
    value_of("{not json", {"type": ["object", "string"]}) -> "{not json"
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

_JSON_TYPES = ("string", "integer", "number", "boolean", "object", "array", "null")


def types_of(schema: Any) -> frozenset[str]:
    """The JSON types a schema admits (``type``, ``anyOf``/``oneOf``, ``enum``, ``const``);
    empty when it does not say."""
    if not isinstance(schema, Mapping):
        return frozenset()
    kind = schema.get("type")
    out: set[str] = set()
    if isinstance(kind, str):
        out.add(kind)
    elif isinstance(kind, list):
        out.update(k for k in kind if isinstance(k, str))
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or ():
            out |= types_of(sub)
    for value in [*(schema.get("enum") or ()), *([schema["const"]] if "const" in schema else [])]:
        out.add(_type_name(value))
    if not out and isinstance(schema.get("properties"), Mapping):
        out.add("object")
    return frozenset(out)


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _fits(value: Any, types: frozenset[str]) -> bool:
    name = _type_name(value)
    return name in types or (name == "integer" and "number" in types)


def is_text(schema: Any) -> bool:
    """Whether a value of ``schema`` is always its text: a string and nothing else, so it can
    stream as a JSON string while it is written."""
    types = types_of(schema)
    return types == {"string"}


def value_of(text: str, schema: Any, *, json_hint: bool | None = None) -> Any:
    """The argument ``text`` means under ``schema`` (a property's schema, or None).

    ``json_hint``: the model said whether the text is JSON (DeepSeek's ``string="false"``);
    it wins where the schema says nothing.
    """
    types = types_of(schema)
    if json_hint is not None and not types:
        return _decoded(text, text) if json_hint else text
    if types == {"string"}:
        return text
    if not types:
        # No schema: JSON scalars and structures read as such (what the templates write
        # with tojson), other text as a string.
        return _decoded(text, text)
    stripped = text.strip()
    decoded = _decoded(stripped, _MISSING)
    if decoded is not _MISSING and _fits(decoded, types):
        return decoded
    if "string" in types:
        return text
    if decoded is not _MISSING:
        return decoded
    lowered = stripped.lower()
    if "boolean" in types and lowered in ("true", "false"):
        return lowered == "true"
    if "null" in types and lowered in ("null", "none"):
        return None
    return text


_MISSING = object()


def _decoded(text: str, default: Any) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return default


def property_schema(parameters: Any, key: str) -> Any:
    """The schema of argument ``key`` in a tool's ``parameters`` (None when it names none)."""
    if not isinstance(parameters, Mapping):
        return None
    props = parameters.get("properties")
    return props.get(key) if isinstance(props, Mapping) else None


def type_names(schema: Any) -> frozenset[str]:
    """``types_of`` limited to JSON's type names (for writing a ``type`` attribute)."""
    return frozenset(t for t in types_of(schema) if t in _JSON_TYPES)
