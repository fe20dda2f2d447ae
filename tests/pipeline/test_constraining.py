"""How a request's schema is read before it becomes a grammar."""

from __future__ import annotations

from app.pipeline.constraining import closed_objects


def test_objects_that_list_properties_get_no_others() -> None:
    schema = {"type": "object", "properties": {
        "where": {"type": "object", "properties": {"city": {"type": "string"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "any": {"type": "object"},
    }}
    out = closed_objects(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["where"]["additionalProperties"] is False
    assert out["properties"]["tags"]["items"]["additionalProperties"] is False
    assert "additionalProperties" not in out["properties"]["any"]  # lists no properties: stays open


def test_what_the_schema_says_is_kept() -> None:
    schema = {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"},
              "$defs": {"P": {"type": "object", "properties": {"x": {}}, "patternProperties": {"^y": {}}}}}
    out = closed_objects(schema)
    assert out["additionalProperties"] == {"type": "integer"}
    assert "additionalProperties" not in out["$defs"]["P"]


def test_a_property_named_like_a_keyword_is_a_name() -> None:
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"x": {}}}},
              "default": {"properties": {"x": 1}}}
    out = closed_objects(schema)
    assert set(out["properties"]) == {"properties"}
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert out["default"] == {"properties": {"x": 1}}  # data, untouched
    assert schema["properties"]["properties"].get("additionalProperties") is None  # input not changed
