"""Every recorded output, over every chunking, gives the one-shot result."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.parsers import (
    ContentDelta,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallError,
    ToolCallStart,
    collect,
)
from tests.parsers.streams import Case, chunkings, load_cases, run, summary

CASES = load_cases()
RAW_MARKERS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]", "<function=", "</function>",
               "<think>", "</think>", "[THINK]", "[/THINK]", "<reasoning>", "</reasoning>", "<thought>", "</thought>")


def _ids(case: Case) -> str:
    return case.id


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_one_shot_matches_expected(case: Case) -> None:
    got = summary(run(case.parser, case.options, [case.output]))
    want = case.expected
    assert got["content"] == want["content"]
    assert got["reasoning"] == want["reasoning"]
    assert [(name, args) for _, name, args in got["tool_calls"]] == [
        (call["name"], call["arguments"]) for call in want["tool_calls"]
    ]
    assert len(got["errors"]) == want["errors"]


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_every_chunking_gives_the_one_shot_result(case: Case) -> None:
    expected = summary(run(case.parser, case.options, [case.output]))
    for way, chunks in chunkings(case.output).items():
        assert summary(run(case.parser, case.options, chunks)) == expected, way


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(CASES), data=st.data())
def test_random_splits_give_the_one_shot_result(case: Case, data: st.DataObject) -> None:
    text = case.output
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10).map(sorted))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert summary(run(case.parser, case.options, chunks)) == summary(run(case.parser, case.options, [text]))


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_events_are_well_formed(case: Case) -> None:
    events = run(case.parser, case.options, list(case.output))
    assert_well_formed(events)
    if not case.expected["errors"] and case.options["reasoning"] and case.options["tools_offered"]:
        content = collect(events).content
        assert not [m for m in RAW_MARKERS if m in content]


def assert_well_formed(events: list) -> None:
    """Deltas are non-empty; each call starts once, then args, then one end or error;
    the args of a completed call concatenate to a JSON object."""
    open_calls: dict[int, list[str]] = {}
    seen: set[int] = set()
    for ev in events:
        if isinstance(ev, (ContentDelta, ReasoningDelta, ToolCallArgsDelta)):
            assert ev.text
        if isinstance(ev, ToolCallStart):
            assert ev.index not in seen and ev.index == len(seen)
            seen.add(ev.index)
            open_calls[ev.index] = []
        elif isinstance(ev, ToolCallArgsDelta):
            open_calls[ev.index].append(ev.text)
        elif isinstance(ev, ToolCallEnd):
            assert isinstance(json.loads("".join(open_calls.pop(ev.index))), dict)
        elif isinstance(ev, ToolCallError) and ev.index is not None:
            open_calls.pop(ev.index)
    assert not open_calls
