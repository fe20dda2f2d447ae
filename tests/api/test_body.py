"""The JSON value count that bounds a request body before it is decoded (app/api/body.py)."""

from __future__ import annotations

import json
import random
import time
from typing import Any

import pytest

from app.api.body import check_json_values, count_json_values, decode_body
from app.errors import PayloadTooLargeError


def values_in(doc: Any) -> int:
    """The count by walking the decoded document: what the byte count must equal."""
    if isinstance(doc, dict):
        return 1 + sum(values_in(v) for v in doc.values())
    if isinstance(doc, list):
        return 1 + sum(values_in(v) for v in doc)
    return 1


DOCS = [
    "1", '"a,b[c{d"', "[]", "{}", "[[]]", "[{}, {}, []]", '{"a": {}, "b": [[], [1, 2]]}',
    '{"k,[{": "v\\",[{]}", "e": "\\\\", "f": ["\\\\\\"", ","]}',
    ' [ 1 , { "a" : [ ] , "b" : { } } , "x" ] ',
    '{"messages": [{"role": "user", "content": "Hi, [all] {of} you"}], "x": [{}, {}, {}]}',
]


@pytest.mark.parametrize("doc", DOCS)
def test_the_count_is_exact(doc):
    assert count_json_values(doc.encode()) == values_in(json.loads(doc))


def test_the_count_is_exact_on_random_documents():
    rng = random.Random(7)
    alphabet = ',[]{}":\\ ab\n\u00e9\u4e2d'

    def make(depth: int) -> Any:
        kind = rng.randrange(5 if depth < 4 else 3)
        if kind == 0:
            return rng.choice([0, -1.5, True, None])
        if kind in (1, 2):
            return "".join(rng.choice(alphabet) for _ in range(rng.randrange(6)))
        if kind == 3:
            return [make(depth + 1) for _ in range(rng.randrange(4))]
        return {"".join(rng.choice(alphabet) for _ in range(rng.randrange(4))): make(depth + 1)
                for _ in range(rng.randrange(4))}

    for _ in range(500):
        doc = make(0)
        for text in (json.dumps(doc), json.dumps(doc, ensure_ascii=False), json.dumps(doc, indent=1)):
            assert count_json_values(text.encode()) == values_in(doc), text


def test_the_limit_refuses_past_it_and_fast():
    body = json.dumps({"x": [{}] * 3_000_000}).encode()  # the red team's 17 MB body
    started = time.monotonic()
    with pytest.raises(PayloadTooLargeError, match="3000002 JSON values"):
        check_json_values(body, 1_000_000)
    assert time.monotonic() - started < 1.5
    check_json_values(body, 3_000_002)
    # A 30 MB string of separators is one value, counted without decoding it.
    check_json_values(json.dumps({"s": "[{}]," * 6_000_000}).encode(), 1000)


def test_a_top_level_member_the_model_ignores_is_never_decoded():
    """0.9 MB of `{}` in an ignored field was a quarter of a million objects a request, and their
    pymalloc arenas stayed pinned after them: RSS crept (issue 30). They are skipped now."""
    from ag_ui.core import RunAgentInput
    from litestar.exceptions import SerializationException

    from app.api.openai.protocol import ChatCompletionRequest
    from app.api.ui.dashboard import ModelAction

    hi = [{"role": "user", "content": "Hi", "x": [{}]}]
    body = json.dumps({"model": "m", "messages": hi, "x": [{}] * 1000, "stream": True}).encode()
    assert decode_body(body, ChatCompletionRequest) == {"model": "m", "messages": hi, "stream": True}
    # Aliases are read (AG-UI's camelCase), and a model that refuses unknown keys still sees them.
    assert decode_body(b'{"threadId": "t", "thread_id": "u", "y": 2}', RunAgentInput) == {"threadId": "t",
                                                                                          "thread_id": "u"}
    assert decode_body(b'{"model": "m", "x": 1}', ModelAction) == {"model": "m", "x": 1}
    # A skipped member is still checked: JSON's syntax, and UTF-8.
    with pytest.raises(SerializationException):
        decode_body(b'{"model": "m", "x": [1,, 2]}', ChatCompletionRequest)
    with pytest.raises(UnicodeDecodeError):
        decode_body(b'{"model": "m", "x": "\xff"}', ChatCompletionRequest)
    # Not an object: decoded whole, for the model to refuse.
    assert decode_body(b"[1]", ChatCompletionRequest) == [1]
