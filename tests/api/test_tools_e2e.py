"""Tool calls and reasoning end to end on the real demo model.

SmolLM2-135M does not call tools on its own, but it copies a pattern it has
seen: a few earlier turns whose answers are tool calls (or reasoning) make it
emit the format, and the real parser path runs on real generated text.
"""

from __future__ import annotations

import json

import pytest
from ag_ui.core import EventType
from pydantic import TypeAdapter

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
FEW_SHOT = [
    {"role": "system", "content": "You call tools."},
    {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": CALL},
    {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": CALL},
    {"role": "user", "content": "Weather in Paris?"},
]
MARKERS = ("<tool_call>", "</tool_call>", "<think>", "</think>", "[TOOL_CALLS]")


def test_tool_call_non_stream_and_stream_agree(client):
    kw = dict(model="demo", messages=FEW_SHOT, tools=TOOLS, max_tokens=40, temperature=0)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert not any(m in (choice.message.content or "") for m in MARKERS)
    assert "extensions" not in r.model_extra  # Tandem's own object only when asked for
    asked = client.chat.completions.create(**kw, extra_body={"extensions": True})
    assert asked.model_extra["extensions"]["tool_call_chunks"][0]["type"] == "start"

    chunks = list(client.chat.completions.create(**kw, stream=True))
    starts = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or []) if tc.id]
    assert len(starts) == 1 and starts[0].function.name == "get_weather" and starts[0].function.arguments == ""
    args = "".join(tc.function.arguments or "" for c in chunks if c.choices
                   for tc in (c.choices[0].delta.tool_calls or []) if not tc.id)
    assert json.loads(args) == {"city": "Paris"}
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == (choice.message.content or "")
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_tool_round_trip_is_accepted(client):
    r = client.chat.completions.create(model="demo", messages=FEW_SHOT, tools=TOOLS, max_tokens=40, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    history = FEW_SHOT + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18})},
    ]
    again = client.chat.completions.create(model="demo", messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # Arguments given as an object (not a JSON string) are accepted too.
    history[-2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    client.chat.completions.create(model="demo", messages=history, tools=TOOLS, max_tokens=2, temperature=0)


def test_tool_choice_none_offers_no_tools(client):
    r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], tools=TOOLS,
                                       tool_choice="none", max_tokens=2, temperature=0, extra_body={"extensions": True})
    assert "get_weather" not in r.model_extra["extensions"]["prompt"]
    r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], tools=TOOLS,
                                       max_tokens=2, temperature=0, extra_body={"extensions": True})
    assert "get_weather" in r.model_extra["extensions"]["prompt"]


THINK = "<think>The user wants the capital.</think>The capital is Paris."
THINK_SHOT = [
    {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": THINK},
    {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": THINK},
    {"role": "user", "content": "Capital of France?"},
]


def test_reasoning_streams_as_its_own_delta(client):
    kw = dict(model="demo", messages=THINK_SHOT, max_tokens=30, temperature=0)
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning_content"] == msg.model_extra["reasoning"] == "The user wants the capital."
    assert msg.content == "The capital is Paris."
    chunks = list(client.chat.completions.create(**kw, stream=True))
    reasoning = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content", "") for c in chunks if c.choices
    )
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert reasoning == msg.model_extra["reasoning_content"] and content == msg.content
    asked = client.chat.completions.create(**kw, extra_body={"extensions": True})
    assert asked.model_extra["extensions"]["reasoning_chunks"]


@pytest.mark.slow  # a sibling in the default suite covers the path
def test_agui_run_events_validate_in_legal_order(demo_server):
    import httpx
    from ag_ui.core import Event

    adapter = TypeAdapter(Event)
    body = {"threadId": "t1", "runId": "r1", "state": None, "context": [],
            "forwardedProps": {"max_tokens": 40, "temperature": 0},
            "tools": [{"name": "get_weather", "description": "Weather for a city",
                       "parameters": TOOLS[0]["function"]["parameters"]}],
            "messages": [{"id": f"m{i}", **m} for i, m in enumerate(FEW_SHOT)]}
    events = []
    with httpx.stream("POST", demo_server.base_url + "/v1/agui", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(adapter.validate_python(json.loads(line[5:])))
    types = [e.type for e in events]
    assert types[0] == EventType.RUN_STARTED and events[0].protocol_version == "1.0"
    assert types[-1] == EventType.RUN_FINISHED
    assert EventType.TOOL_CALL_START in types
    i = types.index(EventType.TOOL_CALL_START)
    assert types[i + 1] == EventType.TOOL_CALL_ARGS and EventType.TOOL_CALL_END in types[i:]
    args = "".join(e.delta for e in events if e.type == EventType.TOOL_CALL_ARGS)
    assert json.loads(args) == {"city": "Paris"}
    # Every started block is closed, in order.
    depth = 0
    for t in types:
        depth += t in (EventType.TEXT_MESSAGE_START, EventType.REASONING_START, EventType.TOOL_CALL_START)
        depth -= t in (EventType.TEXT_MESSAGE_END, EventType.REASONING_END, EventType.TOOL_CALL_END)
        assert depth in (0, 1)
    assert depth == 0


BROKEN = '<tool_call>{"name": "get_weather", "arguments": {"city": Paris}}</tool_call>'
BROKEN_SHOT = [m if m["content"] != CALL else {**m, "content": BROKEN} for m in FEW_SHOT]


def test_unparseable_tool_call_ends_stream_with_error_chunk_and_keeps_text(demo_server):
    import httpx

    body = {"model": "demo", "messages": BROKEN_SHOT, "tools": TOOLS, "max_tokens": 40, "temperature": 0}
    chunks = []
    with httpx.stream(
        "POST", demo_server.base_url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and not line.endswith("[DONE]"):
                chunks.append(json.loads(line[5:]))
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "error"
    assert last["error"]["type"] == "tool_call_parse_error"
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert "get_weather" in content  # the unparseable text is not lost
    full = httpx.post(demo_server.base_url + "/v1/chat/completions", json={**body, "extensions": True},
                      timeout=120).json()
    assert full["choices"][0]["message"]["content"] == content
    assert full["extensions"]["errors"][0]["type"] == "tool_call_parse_error"
