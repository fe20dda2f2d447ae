"""Anthropic request bodies -> the pipeline's typed request, and parser events -> content blocks.

No server: the mapping (app/api/anthropic/protocol.py) and the block writer
(app/api/anthropic/messages.py) on their own, where every rule is quick to pin down.
The end-to-end tests (test_anthropic_e2e.py) run the same code behind a real server.
"""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from app.api.anthropic.messages import BlockWriter, fold, stop_reason, thinking_signature
from app.api.anthropic.protocol import (
    CountTokensRequest,
    MessagesRequest,
    anthropic_tool_id,
    pipeline_tool_id,
)
from app.errors import InvalidRequestError
from app.families.named_calls.mistral import mistral_call_id
from app.parsers import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallError, ToolCallStart
from app.pipeline import request as typed

WEATHER = {"name": "get_weather", "description": "Weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def request(**body):
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, **body}).to_request()


def test_a_conversation_with_tools_maps_turn_by_turn():
    req = request(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Needs a lookup.", "signature": "c2ln"},
                {"type": "text", "text": "Looking."},
                {"type": "tool_use", "id": "toolu_a1b2c3d4e", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_a1b2c3d4e",
                 "content": [{"type": "text", "text": "18 C"}]},
                {"type": "text", "text": "And tomorrow?"}]},
        ],
        tools=[WEATHER], tool_choice={"type": "auto", "disable_parallel_tool_use": True},
        stop_sequences=["END"], temperature=0.5, top_k=40,
    )
    roles = [m.role for m in req.messages]
    assert roles == ["system", "user", "assistant", "tool", "user"]
    system, _, assistant, tool, user = req.messages
    assert system.text() == "Be brief."
    assert assistant.text() == "Looking." and assistant.reasoning == "Needs a lookup."
    assert assistant.tool_calls == (typed.ToolCall("a1b2c3d4e", "get_weather", '{"city": "Paris"}'),)
    assert tool.tool_call_id == "a1b2c3d4e" and tool.text() == "18 C"
    assert user.text() == "And tomorrow?"
    assert req.tools == (typed.Tool("get_weather", "Weather for a city", WEATHER["input_schema"]),)
    assert not req.parallel_tool_calls and req.tool_choice == typed.ToolChoice("auto")
    assert req.options.stop == ("END",) and req.options.max_tokens == 8
    assert (req.options.sampling.temperature, req.options.sampling.top_k) == (0.5, 40)


def test_a_failed_tool_result_says_so():
    req = request(messages=[
        {"role": "user", "content": "Run it."},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_a1b2c3d4e", "name": "sh", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_a1b2c3d4e", "is_error": True,
                                      "content": "command not found"}]}])
    assert req.messages[-1].role == "tool" and req.messages[-1].text() == "Error:\ncommand not found"


def test_consecutive_turns_combine_across_system_messages():
    """Anthropic combines consecutive same-role turns; Claude Code's system message after the
    user's turn must not leave two user turns in a row once the pipeline moves it first."""
    req = request(messages=[
        {"role": "user", "content": "One."},
        {"role": "system", "content": "Late system."},
        {"role": "user", "content": [{"type": "text", "text": "Two."}]},
        {"role": "assistant", "content": "A"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_x", "name": "f", "input": {}}]},
    ])
    assert [m.role for m in req.messages] == ["user", "system", "assistant"]
    assert req.messages[0].text() == "One.\nTwo."
    assert req.messages[2].text() == "A" and [c.name for c in req.messages[2].tool_calls] == ["f"]


@pytest.mark.parametrize(("choice", "typed_choice"), [
    ({"type": "auto"}, typed.ToolChoice("auto")),
    ({"type": "any"}, typed.ToolChoice("required")),
    ({"type": "tool", "name": "get_weather"}, typed.ToolChoice("named", "get_weather")),
    ({"type": "none"}, typed.ToolChoice("none")),
])
def test_tool_choice(choice, typed_choice):
    req = request(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER], tool_choice=choice)
    # Anthropic has no "parallel: yes", only disable_parallel_tool_use: unsaid, so None.
    assert req.tool_choice == typed_choice and req.parallel_tool_calls is None


@pytest.mark.parametrize(("thinking", "switch"), [
    (None, False),  # Anthropic's default: no thinking unless asked
    ({"type": "enabled", "budget_tokens": 1024}, True),
    ({"type": "adaptive"}, None),
    ({"type": "disabled"}, False),
])
def test_thinking(thinking, switch):
    body = {"messages": [{"role": "user", "content": "hi"}]}
    assert request(**body, **({"thinking": thinking} if thinking else {})).thinking is switch


def test_server_tools_are_left_out_and_unused_fields_accepted():
    req = request(
        messages=[{"role": "user", "content": "hi"}],
        tools=[{**WEATHER, "defer_loading": True, "input_schema": {**WEATHER["input_schema"],
                                                                   "$schema": "http://json-schema.org/draft-07/schema#"}},
               {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
               {"type": "tool_search_tool_regex_20251119", "name": "tool_search_tool_regex"}],
        output_config={"effort": "high", "format": {"type": "json_schema", "schema": {"type": "object"}}},
        context_management={"edits": []}, metadata={"user_id": "u"},
    )
    assert [t.name for t in req.tools] == ["get_weather"]
    assert req.output == typed.OutputFormat("json_schema", {"type": "object"}, param="output_config.format")


def test_images_take_the_vision_path_as_urls():
    req = request(messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg", "data": "BBBB"}}]},
    ]}])
    tool, user = req.messages
    assert [p.url for p in user.images()] == ["data:image/png;base64,AAAA", "https://example.com/a.png"]
    assert user.images()[0].param == "messages[0].content[0].source"
    assert [p.url for p in tool.images()] == ["data:image/jpeg;base64,BBBB"]


@pytest.mark.parametrize(("message", "where"), [
    ({"role": "user", "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}, "content[0]"),
    ({"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "toolu_1"}]}, "content[0]"),
    ({"role": "system", "content": [{"type": "text", "text": "a"},
                                    {"type": "image", "source": {"type": "url", "url": "x"}}]}, "content[1]"),
])
def test_blocks_in_the_wrong_role_are_refused(message, where):
    with pytest.raises(InvalidRequestError) as err:
        request(messages=[message])
    assert err.value.param == f"messages[0].{where}"


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "hi"}]},  # no max_tokens
    {"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]},
    {"max_tokens": 8, "messages": []},
    {"max_tokens": 8, "messages": [{"role": "tool", "content": "hi"}]},
    {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "temperature": 1.5},
    {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": ["x"] * 17},
    {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "sometimes"}},
    {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "f"}]},
    {"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "file", "file_id": "f1"}}]}]},
])
def test_bad_bodies_fail_validation(body):
    with pytest.raises(ValidationError):
        MessagesRequest.model_validate({"model": "m", **body})


def test_a_block_of_a_type_not_served_is_named():
    """A document (or video) block is parsed, then refused naming its type and where it is,
    rather than failing validation with the list of every block type expected."""
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Summarise"}, {"type": "document", "source": {}}]}]}
    with pytest.raises(InvalidRequestError) as err:
        MessagesRequest.model_validate(body).to_request()
    assert err.value.param == "messages[0].content[1]" and "'document'" in err.value.message


def test_count_tokens_needs_no_max_tokens():
    req = CountTokensRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert req.to_request().options.max_tokens is None


def test_call_ids_round_trip_to_what_the_parser_made():
    mistral = mistral_call_id()
    assert anthropic_tool_id(mistral) == f"toolu_{mistral}" and pipeline_tool_id(anthropic_tool_id(mistral)) == mistral
    assert anthropic_tool_id("call_" + "x" * 24) == "toolu_" + "x" * 24


CALL = [ToolCallStart(0, "abcdefghi", "get_weather"), ToolCallArgsDelta(0, '{"city": '),
        ToolCallArgsDelta(0, '"Paris"}'), ToolCallEnd(0)]


def test_blocks_open_and_close_in_order_and_fold_into_content():
    events = [ReasoningDelta("Hmm."), ReasoningDelta(" Paris."), ContentDelta("Let me look."), *CALL]
    writer = BlockWriter()
    out = writer.feed(events[:2]) + writer.feed(events[2:]) + writer.finish()
    assert [(e["type"], e.get("delta", {}).get("type")) for e in out] == [
        ("content_block_start", None), ("content_block_delta", "thinking_delta"),
        ("content_block_delta", "thinking_delta"), ("content_block_delta", "signature_delta"),
        ("content_block_stop", None),
        ("content_block_start", None), ("content_block_delta", "text_delta"), ("content_block_stop", None),
        ("content_block_start", None), ("content_block_delta", "input_json_delta"), ("content_block_stop", None),
    ]
    assert [e["index"] for e in out if e["type"] == "content_block_start"] == [0, 1, 2]
    assert fold(out) == [
        {"type": "thinking", "thinking": "Hmm. Paris.", "signature": thinking_signature("Hmm. Paris.")},
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_abcdefghi", "name": "get_weather", "input": {"city": "Paris"}},
    ]
    assert writer.tool_uses == 1


def test_a_call_the_parser_gives_up_on_never_goes_out():
    raw = '<tool_call>{"name": "get_weather", "arguments": {"city": Paris}}</tool_call>'
    events = [ToolCallStart(0, "call_x", "get_weather"), ToolCallArgsDelta(0, '{"city": Paris}'),
              ToolCallError("bad JSON", raw, 0), ContentDelta(raw)]
    writer = BlockWriter()
    out = writer.feed(events) + writer.finish()
    assert fold(out) == [{"type": "text", "text": raw}] and writer.tool_uses == 0
    assert all(json.dumps(e) for e in out)


def test_omitted_thinking_keeps_the_block_and_its_signature():
    writer = BlockWriter(show_thinking=False)
    out = writer.feed([ReasoningDelta("secret"), ContentDelta("Hi")]) + writer.finish()
    assert fold(out) == [{"type": "thinking", "thinking": "", "signature": thinking_signature("secret")},
                         {"type": "text", "text": "Hi"}]


@pytest.mark.parametrize(("finish", "stop", "calls", "reason"), [
    ("stop", None, 0, "end_turn"), ("length", None, 1, "max_tokens"), ("stop", "END", 0, "stop_sequence"),
    ("stop", None, 2, "tool_use"),
])
def test_stop_reason(finish, stop, calls, reason):
    assert stop_reason(finish, stop, calls) == reason
