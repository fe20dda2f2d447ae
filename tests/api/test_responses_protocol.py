"""The Responses API's request mapping and its response store, without a server."""

from __future__ import annotations

import gc
import json
import tracemalloc
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.api.openai.response_store import ResponseStore
from app.api.openai.responses_protocol import ResponsesRequest, encode_reasoning
from app.errors import InvalidRequestError, NotFoundError
from app.pipeline import request as typed
from app.request_context import CLIENT

CODEX_REQUEST = Path(__file__).resolve().parent.parent / "fixtures" / "codex" / "responses_request.json"


def request(**body) -> typed.ChatRequest:
    return ResponsesRequest.model_validate({"model": "m", **body}).to_request([])


def test_items_fold_into_turns():
    """Reasoning, assistant text and calls make one assistant turn; Codex's encrypted reasoning reads back."""
    req = request(instructions="Be brief.", input=[
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox."}]},
        {"role": "user", "content": "Read a.txt"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": encode_reasoning("Use the tool.")},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Reading."}]},
        {"type": "function_call", "call_id": "c1", "name": "read", "namespace": "mcp__files__",
         "arguments": {"path": "a.txt"}},
        {"type": "function_call_output", "call_id": "c1", "output": "hello"},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "A summary."}],
         "encrypted_content": "gAAAA-an-openai-blob"},
    ])
    roles = [m.role for m in req.messages]
    assert roles == ["system", "system", "user", "assistant", "tool", "assistant"]
    assert req.messages[0].text() == "Be brief." and req.messages[0].param == "instructions"
    turn = req.messages[3]
    assert turn.reasoning == "Use the tool." and turn.text() == "Reading." and turn.param == "input[2]"
    assert turn.tool_calls == (typed.ToolCall("c1", "mcp__files__read", '{"path": "a.txt"}'),)
    assert req.messages[4].tool_call_id == "c1" and req.messages[4].text() == "hello"
    assert req.messages[5].reasoning == "A summary."  # a blob that is not ours: its summary
    assert req.messages_param == "input"


def test_string_input_is_one_user_message():
    (m,) = request(input="Hi").messages
    assert (m.role, m.text()) == ("user", "Hi")


def test_tools_served_and_ignored():
    req = request(input="Hi", tools=[
        {"type": "function", "name": "shell", "parameters": {"type": "object", "properties": {}}},
        {"type": "namespace", "name": "crm", "description": "CRM", "tools": [
            {"type": "function", "name": "lookup"}, {"type": "custom", "name": "free"}]},
        {"type": "web_search"}, {"type": "custom", "name": "apply_patch"}, {"type": "local_shell"},
    ])
    assert [t.name for t in req.tools] == ["shell", "crm__lookup"]
    assert req.tools[1].parameters == {"type": "object", "properties": {}}


@pytest.mark.parametrize("choice, mode, name, offered", [
    (None, "auto", None, ["a", "b"]),
    ("required", "required", None, ["a", "b"]),
    ("none", "none", None, ["a", "b"]),
    ({"type": "function", "name": "b"}, "named", "b", ["a", "b"]),
    ({"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "b"}]},
     "required", None, ["b"]),
])
def test_tool_choice(choice, mode, name, offered):
    tools = [{"type": "function", "name": n} for n in ("a", "b")]
    req = request(input="Hi", tools=tools, tool_choice=choice, parallel_tool_calls=False)
    assert (req.tool_choice.mode, req.tool_choice.name) == (mode, name)
    assert [t.name for t in req.tools] == offered and req.parallel_tool_calls is False


@pytest.mark.parametrize("reasoning, thinking", [
    (None, None), ({"summary": "auto"}, None), ({"effort": "none"}, False), ({"effort": "minimal"}, True),
    ({"effort": "xhigh"}, True),
])
def test_reasoning_effort_switches_thinking(reasoning, thinking):
    assert request(input="Hi", reasoning=reasoning).thinking is thinking


def test_text_format_and_options():
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    req = request(input="Hi", max_output_tokens=7, temperature=0.5, top_p=0.9,
                  text={"format": {"type": "json_schema", "name": "out", "schema": schema, "strict": True}})
    assert req.output == typed.OutputFormat("json_schema", schema, "out", True, param="text.format")
    assert (req.options.max_tokens, req.options.max_tokens_param) == (7, "max_output_tokens")
    assert (req.options.sampling.temperature, req.options.sampling.top_p) == (0.5, 0.9)
    assert request(input="Hi", text={"format": {"type": "json_object"}}).output.kind == "json_object"
    assert request(input="Hi", text={"verbosity": "low"}).output == typed.OutputFormat()


def test_history_comes_first():
    history = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "First"}]},
               {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Answer"}]}]
    req = ResponsesRequest.model_validate({"model": "m", "input": "Second"}).to_request(history)
    assert [(m.role, m.text(), m.param) for m in req.messages] == [
        ("user", "First", "previous_response_id"), ("assistant", "Answer", "previous_response_id"),
        ("user", "Second", "input[0]")]


def response(rid: str, size: int = 0) -> dict:
    return {"id": rid, "object": "response", "pad": "x" * size}


def test_store_evicts_least_recently_used_by_count():
    store = ResponseStore(max_entries=2, max_bytes=10_000)
    for rid in ("a", "b"):
        assert store.put(response(rid), [])
    store.get("a")  # now b is the least recently used
    store.put(response("c"), [])
    assert len(store) == 2 and store.get("a") and store.get("c")
    with pytest.raises(NotFoundError):
        store.get("b")


def test_store_bounds_bytes_and_refuses_what_cannot_fit():
    store = ResponseStore(max_entries=100, max_bytes=1000)
    assert store.put(response("a", 300), [])
    assert store.put(response("b", 300), [])
    assert store.put(response("c", 300), [])  # a goes
    assert store.nbytes <= 1000 and len(store) == 2
    assert not store.put(response("huge", 2000), [])
    assert len(store) == 2
    store.delete("b")
    assert len(store) == 1 and store.nbytes == store.get("c").nbytes
    assert not ResponseStore(0, 1000).put(response("x"), [])


def test_the_store_bound_counts_the_memory_held():
    """Two responses with 24 MB of `{}` each held ~880 MB in a "64 MB" store: the bound counted
    JSON characters and the store held Python objects. Now it holds the JSON text it counts."""
    store = ResponseStore(max_entries=10, max_bytes=64 * 2**20)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for rid in ("a", "b"):
            # As a decoded body holds them: a million distinct objects, 3 MB as JSON.
            body = {**response(rid), "metadata": {"x": [{} for _ in range(1_000_000)]}}
            assert store.put(body, [{"type": "message", "role": "user", "content": [{} for _ in range(100_000)]}])
            del body
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(store) == 2 and held <= 1.1 * store.nbytes, (held, store.nbytes)
    assert store.get("a").response["metadata"]["x"][:2] == [{}, {}]
    assert store.get("b").items[0]["content"][-1] == {}


@pytest.mark.parametrize("metadata, message", [
    ({f"k{i}": "v" for i in range(17)}, "at most 16 keys"),
    ({"k" * 65: "v"}, "keys are at most 64 characters"),
    ({"k": "v" * 513}, "values are at most 512 characters"),
    ({"k": [{}] * 1000}, "string"),
    ({"k": 1}, "string"),
])
def test_metadata_is_bounded_as_at_openai(metadata, message):
    with pytest.raises(ValidationError, match=message) as refused:
        ResponsesRequest.model_validate({"model": "m", "input": "Hi", "metadata": metadata})
    assert refused.value.errors()[0]["loc"][0] == "metadata"
    fits = {f"{i:064d}": "v" * 512 for i in range(16)}
    assert ResponsesRequest.model_validate({"model": "m", "input": "Hi", "metadata": fits}).metadata == fits


def test_store_keeps_each_api_key_apart():
    store = ResponseStore(max_entries=10, max_bytes=10_000)
    token = CLIENT.set("alice")
    try:
        store.put(response("r"), [{"role": "user"}])
    finally:
        CLIENT.reset(token)
    with pytest.raises(NotFoundError) as err:
        store.get("r", "previous_response_id")
    assert err.value.code == "previous_response_not_found" and err.value.param == "previous_response_id"
    token = CLIENT.set("alice")
    try:
        (item,) = store.get("r").items
        assert item["role"] == "user" and item["id"].startswith("item_")  # every stored item gets an id
    finally:
        CLIENT.reset(token)


def test_input_items_page_as_openai_lists_do():
    from app.api.openai.responses import input_items_page

    items = [{"id": f"i{n}"} for n in range(6)]

    def ids(**kw):
        page = input_items_page(items, **{"after": None, "before": None, "limit": 20, "order": "desc", **kw})
        return [i["id"] for i in page["data"]], page["has_more"], page["first_id"], page["last_id"]

    assert ids() == (["i5", "i4", "i3", "i2", "i1", "i0"], False, "i5", "i0")  # the latest first
    assert ids(order="asc", limit=2) == (["i0", "i1"], True, "i0", "i1")
    assert ids(order="asc", after="i1", limit=2) == (["i2", "i3"], True, "i2", "i3")
    assert ids(order="asc", after="i3", limit=2) == (["i4", "i5"], False, "i4", "i5")
    assert ids(after="i4", before="i1") == (["i3", "i2"], False, "i3", "i2")  # in the order asked for
    assert ids(after="i4", before="i1", limit=1) == (["i3"], True, "i3", "i3")
    assert ids(after="i1", before="i4") == ([], False, None, None)  # before comes first: nothing between
    assert ids(after="i0") == ([], False, None, None)
    with pytest.raises(InvalidRequestError) as err:
        ids(before="nope")
    assert err.value.param == "before"


def test_a_recorded_codex_request_maps():
    """Codex CLI 0.169's first request of ``codex exec "say hi"`` (default config), as it sent it."""
    body = json.loads(CODEX_REQUEST.read_text())
    data = ResponsesRequest.model_validate(body)
    assert data.stores is False and data.encrypted_reasoning and data.stream
    req = data.to_request([])
    assert [m.role for m in req.messages] == ["system", "system", "user", "user"]  # developer turns are system
    assert req.messages[-1].text() == "say hi"
    names = [t.name for t in req.tools]
    assert "exec_command" in names and "multi_agent_v1__spawn_agent" in names  # a namespace, flattened
    assert len(names) == 12  # 7 functions + 5 in the namespace; web_search is not served here
    assert data.namespaces()["multi_agent_v1__spawn_agent"] == ("multi_agent_v1", "spawn_agent")
    assert req.thinking is None  # reasoning: {"summary": "auto"} names no effort: the model's default
