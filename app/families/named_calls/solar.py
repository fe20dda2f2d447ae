"""Upstage Solar Open: calls between ``<|tool_calls|>`` and ``<|calls|>``, each with its id.

Raw output (the model's id is read, and replaced by Tandem's)::

    <|tool_calls|><|tool_call:begin|>call_1<|tool_call:name|>get_weather<|tool_call:args|>{"city": "Paris"}
    <|tool_call:end|><|calls|>

(one line, broken here).
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import CallSyntax

CALLS = CallSyntax(
    section=("<|tool_calls|>", "<|calls|>"),
    begin="<|tool_call:begin|>",
    header="{id}<|tool_call:name|>{name}",
    args="<|tool_call:args|>",
    end="<|tool_call:end|>",
)

FAMILY = Family(
    "solar",
    templated=(("", CALLS),),
    template_hints=("<|tool_call:begin|>",),
    name_hint=r"solar-open",
)
