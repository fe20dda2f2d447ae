"""Kimi K2: call sections of special tokens, ids ``functions.NAME:N``.

Raw output (Kimi-K2-Thinking reasons in ``<think>`` first; a call may end a
reasoning block that was never closed)::

    <think>The user wants the weather.</think><|tool_calls_section_begin|>
    <|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>
    <|tool_calls_section_end|>

(one line, broken here).

The model's ``functions.get_weather:0`` is its call id; Tandem's ids replace it
(``fit_call_id`` writes one back in that form for the template).
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import CallSyntax

CALLS = CallSyntax(
    section=("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
    begin="<|tool_call_begin|>",
    header="functions.{name}:{index}",
    args="<|tool_call_argument_begin|>",
    end="<|tool_call_end|>",
)

FAMILY = Family(
    "kimi",
    # The template names a call functions.NAME:N and its result by the id it carries.
    call_id_format="functions.{name}:{index}",
    templated=(("", CALLS),),
    template_hints=("<|tool_calls_section_begin|>",),
    name_hint=r"kimi",
)
