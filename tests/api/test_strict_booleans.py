"""Booleans in request bodies are JSON's true and false, nothing else (issue 30): pydantic's lax
mode read `"pinned": "yes"` as true and `prompt_lookup: "no"` as false. Each is now a 400 that
names the field, on every wire format, in its own error shape."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError

import app.api
from tests.api.serving import Served, assert_openai_error, serving, tiny_yaml

NOT_BOOLEANS = ["yes", "no", "true", "false", 1, 0, "1", "on"]


def request_models() -> Iterator[type[BaseModel]]:
    """Every pydantic model defined under app/api: the request bodies and their parts."""
    for info in pkgutil.walk_packages(app.api.__path__, "app.api."):
        module = importlib.import_module(info.name)
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BaseModel) and cls.__module__ == module.__name__:
                yield cls


def holds_bool(annotation: Any) -> bool:
    return annotation is bool or any(holds_bool(a) for a in typing.get_args(annotation))


BOOL_FIELDS = sorted({(cls.__module__, cls.__name__, name): field for cls in request_models()
                      for name, field in cls.model_fields.items() if holds_bool(field.annotation)}.items())


def test_the_known_fields_are_found() -> None:
    found = {f"{cls}.{name}" for (_, cls, name), _ in BOOL_FIELDS}
    assert {"PinAction.pinned", "SpeculativeSwitches.prompt_lookup", "ChatCompletionRequest.stream",
            "MessagesRequest.stream", "RerankRequest.truncate", "EmbeddingRequest.truncate"} <= found, found


@pytest.mark.parametrize("field", [f for _, f in BOOL_FIELDS], ids=[".".join(k[1:]) for k, _ in BOOL_FIELDS])
def test_every_boolean_field_takes_true_and_false_only(field: Any) -> None:
    adapter = TypeAdapter(field.rebuild_annotation())
    assert adapter.validate_python(True) is True and adapter.validate_python(False) is False
    for value in NOT_BOOLEANS:
        # strict=False: Litestar validates so, and it overrode StrictBool. A field that also takes
        # strings or numbers (a decision's choice value: "true" and true are different choices)
        # keeps the value as sent; none turns it into a boolean.
        try:
            kept = adapter.validate_python(value, strict=False)
        except ValidationError:
            continue
        assert not isinstance(kept, bool) and kept == value and type(kept) is type(value), (value, kept)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Served]:
    with serving(tmp_path_factory.mktemp("booleans"), tiny_yaml(tiny_model_dir)) as served:
        yield served


HI = [{"role": "user", "content": "Hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CHAT = {"model": "tiny", "messages": HI, "max_tokens": 1}
AGUI = {"threadId": "t", "runId": "r", "state": {}, "tools": [], "context": [],
        "messages": [{"id": "1", "role": "user", "content": "Hi"}]}
# (path, body, the param the 400 names)
CASES = [
    ("/v1/admin/models/pin", {"model": "tiny", "pinned": "yes"}, "pinned"),
    ("/v1/chat/completions", {**CHAT, "speculative": {"prompt_lookup": "no"}}, "speculative.prompt_lookup"),
    ("/v1/chat/completions", {**CHAT, "stream": "true"}, "stream"),
    ("/v1/chat/completions", {**CHAT, "logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "extensions": "yes"}, "extensions"),
    ("/v1/chat/completions", {**CHAT, "thinking": "no"}, "thinking"),
    ("/v1/chat/completions", {**CHAT, "parallel_tool_calls": "false", "tools": [TOOL]}, "parallel_tool_calls"),
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"enable_thinking": "false"}},
     "chat_template_kwargs.enable_thinking"),
    ("/v1/chat/completions", {**CHAT, "tools": [{**TOOL, "function": {**TOOL["function"], "strict": "yes"}}]},
     "tools[0].function.strict"),
    ("/v1/completions", {"model": "tiny", "prompt": "Hi", "echo": "yes"}, "echo"),
    ("/v1/responses", {"model": "tiny", "input": "Hi", "store": "no"}, "store"),
    ("/v1/responses", {"model": "tiny", "input": "Hi", "stream": "yes"}, "stream"),
    ("/v1/embeddings", {"model": "tiny", "input": "Hi", "truncate": "yes"}, "truncate"),
    ("/v1/rerank", {"model": "tiny", "query": "q", "documents": ["d"], "return_documents": "no"}, "return_documents"),
    ("/v1/agui", {**AGUI, "forwardedProps": {"thinking": "no"}}, "forwardedProps.thinking"),
]


@pytest.mark.parametrize("path, body, param", CASES, ids=[f"{p} {param}" for p, _, param in CASES])
def test_a_non_boolean_is_a_400_naming_the_field(srv: Served, path: str, body: dict, param: str) -> None:
    err = assert_openai_error(srv.post(path, body), 400)
    assert err["param"] == param and "bool" in err["message"], err
    assert srv.state.registry.spec("tiny").pin is False


@pytest.mark.parametrize("body, param", [
    ({"stream": "yes"}, "stream"),
    ({"tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}}, "tool_choice.disable_parallel_tool_use"),
])
def test_anthropic_messages_refuse_them_in_anthropics_shape(srv: Served, body: dict, param: str) -> None:
    r = srv.post("/v1/messages", {"model": "tiny", "max_tokens": 1, "messages": HI, **body})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert param in err["error"]["message"] and "bool" in err["error"]["message"], err


def test_true_and_false_still_work(srv: Served) -> None:
    r = srv.post("/v1/chat/completions", {**CHAT, "stream": False, "extensions": True,
                                          "speculative": {"prompt_lookup": False}})
    assert r.status_code == 200, r.text
    for pinned in (True, False):
        assert srv.post("/v1/admin/models/pin", {"model": "tiny", "pinned": pinned}).json()["pinned"] is pinned
