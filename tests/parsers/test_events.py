"""``collect``: the non-streaming fold of parser events."""

from __future__ import annotations

from app.parsers import (
    ContentDelta,
    Event,
    ParsedToolCall,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallError,
    ToolCallStart,
    collect,
    make_parser,
)
from tests.parsers.streams import counting_ids


def test_collect_folds_a_stream_into_a_message_with_extensions() -> None:
    events: list[Event] = [
        ReasoningDelta("Let me think. "),
        ReasoningDelta("6 times 7."),
        ContentDelta("The answer "),
        ToolCallStart(0, "call_a", "calculate"),
        ToolCallArgsDelta(0, '{"expression": '),
        ToolCallArgsDelta(0, '"6*7"}'),
        ToolCallEnd(0),
        ContentDelta("is 42."),
    ]
    out = collect(events)
    assert out.content == "The answer is 42."
    assert out.reasoning == "Let me think. 6 times 7."
    assert out.tool_calls == [ParsedToolCall("call_a", "calculate", '{"expression": "6*7"}')]
    assert out.errors == []
    assert out.reasoning_chunks == ["Let me think. ", "6 times 7."]
    assert out.tool_call_chunks == [
        {"type": "start", "tool_call_id": "call_a", "tool_name": "calculate"},
        {"type": "args", "tool_call_id": "call_a", "delta": '{"expression": '},
        {"type": "args", "tool_call_id": "call_a", "delta": '"6*7"}'},
        {"type": "end", "tool_call_id": "call_a"},
    ]


def test_a_call_that_failed_after_starting_is_left_out() -> None:
    events: list[Event] = [
        ToolCallStart(0, "call_a", "f"),
        ToolCallArgsDelta(0, "{bad"),
        ToolCallError("invalid JSON in tool call", "<tool_call>{bad", 0),
        ContentDelta("<tool_call>{bad"),
        ToolCallStart(1, "call_b", "g"),
        ToolCallArgsDelta(1, "{}"),
        ToolCallEnd(1),
    ]
    out = collect(events)
    assert out.content == "<tool_call>{bad"
    assert [c.name for c in out.tool_calls] == ["g"]
    assert out.errors == ["invalid JSON in tool call"]
    assert [c["tool_call_id"] for c in out.tool_call_chunks] == ["call_b"] * 3


def test_collect_of_nothing() -> None:
    out = collect([])
    assert (out.content, out.reasoning, out.tool_calls, out.errors) == ("", "", [], [])


def test_mistral_arguments_stream_before_the_call_ends() -> None:
    """[ARGS]{...} streams: the first deltas come while the JSON is still open."""
    parser = make_parser("mistral", reasoning=False, tools_offered=True, id_factory=counting_ids())
    events = parser.feed('[TOOL_CALLS]get_weather[ARGS]{"city": ')
    assert events[0] == ToolCallStart(0, "call_" + "0" * 24, "get_weather")
    assert events[1:] == [ToolCallArgsDelta(0, '{"city": ')]
    assert parser.feed('"Paris"}') == [ToolCallArgsDelta(0, '"Paris"}'), ToolCallEnd(0)]
    assert parser.finish() == []


def test_qwen_arguments_stream_once_the_name_is_known() -> None:
    parser = make_parser("qwen", reasoning=True, tools_offered=True, id_factory=counting_ids())
    assert parser.feed('<tool_call>\n{"name": "get_wea') == []
    events = parser.feed('ther", "arguments": {"city"')
    assert events == [ToolCallStart(0, "call_" + "0" * 24, "get_weather"), ToolCallArgsDelta(0, '{"city"')]


def test_error_keeps_raw_text_as_content() -> None:
    parser = make_parser("llama", reasoning=False, tools_offered=True, id_factory=counting_ids())
    events = parser.feed("<function=f>{oops}</function>") + parser.finish()
    error = next(e for e in events if isinstance(e, ToolCallError))
    assert error.raw == "<function=f>{oops}</function>" and error.index == 0
    assert collect(events).content == error.raw


def test_held_back_marker_prefix_is_released_when_it_is_not_one() -> None:
    parser = make_parser("qwen", reasoning=True, tools_offered=True)
    assert parser.feed("a <tool") == [ContentDelta("a")]
    assert parser.feed("box") == [ContentDelta(" <toolbox")]


def test_nothing_after_finish() -> None:
    parser = make_parser("generic", reasoning=True, tools_offered=True)
    parser.feed("hi")
    parser.finish()
    assert parser.feed("more") == [] and parser.finish() == []


def test_foreign_call_ids_fit_mistral_templates() -> None:
    from app.families.named_calls.mistral import fit_mistral_call_id

    assert fit_mistral_call_id("aB3dE6gH9") == "aB3dE6gH9"  # already Mistral's: kept
    for foreign in ("call_abcdefghijklmnopqrstuvwx", "toolu_01A09q90qw90lq917835lq9", "x", ""):
        fitted = fit_mistral_call_id(foreign)
        assert len(fitted) == 9 and fitted.isalnum() and fitted.isascii()
        assert fitted == fit_mistral_call_id(foreign)  # a call and its result stay paired
    assert fit_mistral_call_id("call_a") != fit_mistral_call_id("call_b")
