"""A model's family, reasoning markers and template switches, read off its own chat template.

The template is rendered with probes, and what it writes is matched, never the
model's name (llama.cpp's autoparser, ``common/chat-auto-parser*``, reads a
template the same way):

    a probe call       [user, assistant calling probe_fn(pkey="PVAL", pnum=7), its result]
                       -> the text the template writes for the call; the first family in
                          ``app.families.FAMILIES`` whose parser reads exactly that call back
    a probe thought    [user, assistant with reasoning "PROBE_T" and content "PROBE_A"]
                       -> the markers around the thought, when they are a family's
    a plain answer     [user, assistant "PROBE_A"] -> the text that ends an assistant turn
    each switch        enable_thinking, thinking, reasoning, reasoning_effort, thinking_effort,
                       thinking_budget: the ones that change the generation prompt

A template that renders no call falls back on the family hints (markers it
mentions, then the model's name), and the report says so. ``tool_parser:`` in
models.yaml overrides all of it. ``Detection.why`` is what ``/health`` and the
load log show.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from app.families import FAMILIES, CallSyntax, Family, Syntax
from app.parsers import collect, parser_for, template_opens_reasoning
from app.parsers.detect import detect_parser

# Renders messages through the template: ``(messages, tools, generation_prompt, kwargs)``, None when it refuses.
Renderer = Callable[[list[dict[str, Any]], "list[dict[str, Any]] | None", bool, Mapping[str, Any]], "str | None"]

_PROBE_PARAMETERS: dict[str, Any] = {
    "type": "object", "properties": {"pkey": {"type": "string"}, "pnum": {"type": "integer"}},
    "required": ["pkey", "pnum"]}
PROBE_TOOL = {"type": "function", "function": {"name": "probe_fn", "description": "A probe.",
                                               "parameters": _PROBE_PARAMETERS}}
PROBE_ARGS = {"pkey": "PVAL", "pnum": 7}
PROBE_ID = "probecall"  # nine letters or digits: Mistral's templates check ids
_QUESTION, _ANSWER, _THOUGHT, _RESULT = "PROBE_Q", "PROBE_A", "PROBE_T", "PROBE_R"
# A syntax no parser reads by itself (a family's tool-note form, left out of a probe's parser).
_NOTHING = CallSyntax(begin="\x00probe-nothing\x00")

# A marker at the start of a turn's end: <|im_end|>, </s>, [/INST] and the like.
_MARKER = re.compile(r"<\|[^|<>]*\|>|<｜[^｜<>]*｜>|<[^<>\s]+>|\[/?[A-Z_]+\]")
# Template variables that turn reasoning on or off ("bool"), or set its effort or budget.
SWITCHES: dict[str, str] = {
    "enable_thinking": "bool",
    "thinking": "bool",
    "reasoning": "bool",
    "reasoning_effort": "effort",
    "thinking_effort": "effort",
    "thinking_budget": "budget",
}
# Two values of each kind whose renderings differ where the switch works.
_PROBE_VALUES: dict[str, tuple[Any, Any]] = {"bool": (True, False), "effort": ("high", "low"), "budget": (-1, 0)}


@dataclass(frozen=True)
class Detection:
    """What the template says about the model."""

    family: str
    # The call syntax the template writes (None: it writes no call we could read).
    syntax: Syntax | None
    # The reasoning markers the template writes around an earlier turn's reasoning.
    reasoning: tuple[str, str] | None
    # The switches that change the generation prompt, in SWITCHES' order.
    switches: tuple[str, ...] = ()
    # What the template closes an assistant turn with (the model's end-of-turn text).
    turn_end: str = ""
    # Why, in words, for /health and the load log.
    why: str = ""
    # Whether the generation prompt opens the reasoning block (thinking on, where it can be).
    opens_reasoning: bool = False


def probe_call_messages() -> list[dict[str, Any]]:
    """A conversation with one call of the probe tool and its result."""
    call = {"id": PROBE_ID, "type": "function", "function": {"name": "probe_fn", "arguments": dict(PROBE_ARGS)}}
    return [{"role": "user", "content": _QUESTION},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": PROBE_ID, "name": "probe_fn", "content": _RESULT}]


def detect(render: Renderer, template: str, model_name: str) -> Detection:
    """The family and markers of the model whose template ``render`` applies."""
    header, turn_end = _assistant_frame(render)
    call_text = _call_text(render, header)
    found = _family_of_call(call_text) if call_text is not None else None
    if found is not None:
        family, syntax = found
        why = f"its template writes the probe call as {family.name} reads it"
    else:
        family = FAMILIES[detect_parser(model_name, template)]
        syntax = None
        what = "writes no tool call" if call_text is None else "writes a tool call no family reads"
        why = f"its template {what}; {family.name} from " + (
            "the markers it mentions or the model's name" if family.name != "generic" else "nothing: the fallback")
    reasoning = _reasoning_markers(render, family)
    switches = tuple(name for name in SWITCHES if _switch_works(render, template, name))
    opens = _prompt_opens(render, family, switches)
    if reasoning is not None:
        opened = ", opened by the generation prompt" if opens else ""
        why += f"; reasoning in {reasoning[0]}...{reasoning[1]}{opened}"
    elif opens:
        why += "; the generation prompt opens the reasoning"
    if switches:
        why += f"; switches: {', '.join(switches)}"
    return Detection(family.name, syntax, reasoning, switches, turn_end, why, opens)


def _render(render: Renderer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
            generation_prompt: bool = False, **kwargs: Any) -> str | None:
    try:
        return render(messages, tools, generation_prompt, kwargs)
    except Exception:  # noqa: BLE001 - a template that refuses a probe says nothing of it
        return None


def _assistant_frame(render: Renderer) -> tuple[str, str]:
    """The text between the user's turn and an assistant's answer (the assistant's header,
    with the user turn's end), and the text that ends the assistant's turn: what follows the
    answer both at the end of a conversation and before the next user turn."""
    answer = [{"role": "user", "content": _QUESTION}, {"role": "assistant", "content": _ANSWER}]
    text = _render(render, answer)
    if not text or _QUESTION not in text or _ANSWER not in text:
        return "", ""
    header, _, tail = text.split(_QUESTION, 1)[1].partition(_ANSWER)
    more = _render(render, [*answer, {"role": "user", "content": _RESULT}])
    after = more.split(_ANSWER, 1)[1].split(_RESULT, 1)[0] if more and _ANSWER in more else ""
    common = os.path.commonprefix([tail, after]).strip()
    marker = _MARKER.match(common)
    return header, marker.group(0) if marker else ""


def _call_text(render: Renderer, header: str) -> str | None:
    """What the template writes for the probe call, from the assistant's header on."""
    text = _render(render, probe_call_messages(), [PROBE_TOOL], generation_prompt=True)
    if not text or _QUESTION not in text or _RESULT not in text:
        return None
    region = text.split(_QUESTION, 1)[1].split(_RESULT, 1)[0]
    stripped = header.strip()
    if stripped and stripped in region:
        region = region.split(stripped, 1)[1]
    return region if "probe_fn" in region else None


def _family_of_call(text: str) -> tuple[Family, Syntax] | None:
    """The first family (and syntax of it) whose parser reads the probe call out of ``text``."""
    tools = {"probe_fn": _PROBE_PARAMETERS}
    for family in FAMILIES.values():
        # What the family's templates write; its tool-note form (bare JSON) only where it says so.
        for syntax in dict.fromkeys((*(s for _, s in family.templated), *family.also_reads)):
            single = replace(family, templated=(("", syntax),), also_reads=(), noted=_NOTHING)
            parser = parser_for(single, reasoning=True, tools_offered=True, tools=tools)
            out = collect([*parser.feed(text), *parser.finish()])
            if len(out.tool_calls) == 1 and not out.errors and out.tool_calls[0].name == "probe_fn" and \
                    json.loads(out.tool_calls[0].arguments_json) == PROBE_ARGS and _same_shape(syntax, text):
                return family, syntax
    return None


def _same_shape(syntax: Syntax, text: str) -> bool:
    """Whether a JSON syntax's list or object is what the template writes after the marker
    (Apriel's ``<tool_calls>[...]`` against MiniMax M1's ``<tool_calls>`` lines)."""
    if not isinstance(syntax, CallSyntax) or syntax.args is not None or not syntax.begin.strip():
        return True
    after = text.split(syntax.begin.strip(), 1)[-1].lstrip()
    return after[:1] == ("[" if syntax.listed else "{")


def _reasoning_markers(render: Renderer, family: Family) -> tuple[str, str] | None:
    """The markers the template writes around an answer's reasoning, when a family knows them."""
    messages = [{"role": "user", "content": _QUESTION},
                {"role": "assistant", "content": _ANSWER, "reasoning_content": _THOUGHT}]
    text = _render(render, messages)
    if not text or _THOUGHT not in text:
        return None
    before, after = text.split(_THOUGHT, 1)
    before = before.split(_QUESTION, 1)[-1]
    after = after.split(_ANSWER, 1)[0]
    known = [*family.reasoning_pairs, *(p for f in FAMILIES.values() for p in f.reasoning)]
    for opener, closer in known:
        if opener in before and closer in after:
            return opener, closer
    return None


def _prompt_opens(render: Renderer, family: Family, switches: tuple[str, ...]) -> bool:
    """Whether the generation prompt (thinking on) ends inside a reasoning block of the family's."""
    on = {name: _PROBE_VALUES[SWITCHES[name]][0] for name in switches}
    text = _render(render, [{"role": "user", "content": _QUESTION}], generation_prompt=True, **on)
    return text is not None and template_opens_reasoning(text, family.reasoning_pairs)


def _switch_works(render: Renderer, template: str, name: str) -> bool:
    if not re.search(rf"\b{name}\b", template):
        return False
    on, off = _PROBE_VALUES[SWITCHES[name]]
    user = [{"role": "user", "content": _QUESTION}]
    first = _render(render, user, generation_prompt=True, **{name: on})
    second = _render(render, user, generation_prompt=True, **{name: off})
    return first is not None and second is not None and first != second
