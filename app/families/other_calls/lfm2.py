"""LFM2 and LFM2.5: Python-style calls between ``<|tool_call_start|>`` and ``<|tool_call_end|>``.

Raw output (LFM2.5-8B reasons in ``<think>`` first)::

    <think>The user wants the weather.</think><|tool_call_start|>[get_weather(city="Paris", days=3)]<|tool_call_end|>

A call written inside the reasoning block is part of the reasoning, as the
model's thinking about what to call.
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import PythonicCalls

CALLS = PythonicCalls(begin="<|tool_call_start|>", end="<|tool_call_end|>")

FAMILY = Family(
    "lfm2",
    templated=(("", CALLS),),
    calls_in_reasoning=False,
    template_hints=("<|tool_call_start|>", "<|tool_list_start|>", "List of tools: ["),
    name_hint=r"lfm2",
)
