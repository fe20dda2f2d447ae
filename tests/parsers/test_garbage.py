"""Malformed model output never raises, and chunking never changes the result.

The text is random garbage built from marker fragments, JSON punctuation and
words, the pieces most likely to confuse a state machine.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.families import FAMILIES
from app.parsers import PARSERS
from tests.families.writers import write
from tests.parsers.streams import run, summary
from tests.parsers.test_fixtures import assert_well_formed

_FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool_", "</tool", "[TOOL_CALLS]", "[TOOL_", "[ARGS]", "[AR", "[CALL_ID]",
    "<function=", "</function>", "<func", ">", "<think>", "</think>", "<thi", "</th", "[THINK]", "[/THINK]",
    "<reasoning>", "</reasoning>", "<thought>", "</thought>",
    "{", "}", "[", "]", '"', "\\", ":", ",", '"name"', '"arguments"', '"parameters"', '"function"', '"get_weather"',
    '{"name": "f", "arguments": ', '{"city": "Paris"}', "null", "42", " ", "\n", "f", "get_weather", "Paris", "é☀",
    # The shapes of the other families: XML parameters, sections, Python calls, Gemma 4, Harmony.
    "<parameter=", "</parameter>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", '<invoke name="',
    "</invoke>", "<|tool_call_start|>", "<|tool_call_end|>", "f(x=1)", "<|tool_call>call:f{", "<tool_call|>", '<|"|>',
    "<|channel|>analysis", "<|message|>", "<|end|>", "<|start|>assistant", " to=functions.f", "<|channel>thought",
    "<channel|>", "]<]minimax[>[", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<|tool_call_begin|>functions.f:0",
    "<|tool_call_argument_begin|>", ">>>", "<![CDATA[", "]]>", "<seed:think>", "<|START_ACTION|>",
]
TEXT = st.lists(st.one_of(st.sampled_from(_FRAGMENTS), st.text(max_size=3)), max_size=25).map("".join)
_SYNTAXES = sorted({s for f in FAMILIES.values() for s in f.reads}, key=repr)
_ARGS = st.dictionaries(st.sampled_from(["city", "q", "n", "x y"]), st.one_of(
    st.integers(), st.text(max_size=6), st.lists(st.booleans(), max_size=2)), max_size=3).map(json.dumps)
_NAME = st.sampled_from(["get_weather", "f", "search.web"])
_SEGMENT = st.one_of(
    st.text(max_size=8),
    st.builds("{}{}{}".format, st.sampled_from(["<think>", "[THINK]", "<reasoning>"]), st.text(max_size=8),
              st.sampled_from(["</think>", "[/THINK]", "</reasoning>", ""])),
    st.builds('<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'.format, _NAME, _ARGS),
    st.builds("[TOOL_CALLS]{}[ARGS]{}".format, _NAME, _ARGS),
    st.builds('[TOOL_CALLS][{{"name": "{}", "arguments": {}}}]'.format, _NAME, _ARGS),
    st.builds("<function={}>{}</function>".format, _NAME, _ARGS),
    st.builds('{{"name": "{}", "arguments": {}}}'.format, _NAME, _ARGS),
    st.builds(lambda syntax, name, args: write(syntax, [(name, json.loads(args))]), st.sampled_from(_SYNTAXES),
              _NAME, _ARGS),
)


@st.composite
def _damaged_output(draw: st.DrawFn) -> str:
    """Well-formed pieces in any order, then a few characters cut or doubled."""
    text = "".join(draw(st.lists(_SEGMENT, max_size=5)))
    for _ in range(draw(st.integers(0, 2))):
        if not text:
            break
        at = draw(st.integers(0, len(text) - 1))
        text = text[:at] + (text[at] * 2 if draw(st.booleans()) else "") + text[at + 1 :]
    return text


OPTIONS = st.fixed_dictionaries(
    {"reasoning": st.booleans(), "starts_in_reasoning": st.booleans(), "tools_offered": st.booleans()}
)


def _check_splits(parser: str, options: dict, text: str, cuts: list[int]) -> None:
    whole = run(parser, options, [text])
    assert_well_formed(whole)
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    split = run(parser, options, chunks)
    assert_well_formed(split)
    assert summary(split) == summary(whole)
    assert summary(run(parser, options, list(text))) == summary(whole)


_CUTS = st.lists(st.integers(0, 200), max_size=12).map(sorted)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parser=st.sampled_from(sorted(PARSERS)), options=OPTIONS, text=TEXT, cuts=_CUTS)
def test_garbage_never_raises_and_splits_agree(parser: str, options: dict, text: str, cuts: list[int]) -> None:
    _check_splits(parser, options, text, [min(c, len(text)) for c in cuts])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(parser=st.sampled_from(sorted(PARSERS)), options=OPTIONS, text=_damaged_output(), cuts=_CUTS)
def test_damaged_outputs_never_raise_and_splits_agree(parser: str, options: dict, text: str, cuts: list[int]) -> None:
    _check_splits(parser, options, text, [min(c, len(text)) for c in cuts])


@settings(max_examples=100, deadline=None)
@given(parser=st.sampled_from(sorted(PARSERS)), options=OPTIONS, text=st.text(max_size=60))
def test_arbitrary_text_never_raises(parser: str, options: dict, text: str) -> None:
    assert_well_formed(run(parser, options, list(text)))
