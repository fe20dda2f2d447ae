"""IBM Granite 3.x: ``<think>`` reasoning (the template's ``thinking`` switch) and
``<|tool_call|>`` with a JSON list of calls. Granite 4 writes Hermes-style
``<tool_call>`` objects, which the qwen family reads.

Raw output::

    <think>The user wants the weather.</think><|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import CallSyntax

CALLS = CallSyntax(begin="<|tool_call|>", listed=True)

FAMILY = Family(
    "granite",
    templated=(("", CALLS),),
    template_hints=("<|tool_call|>",),
    name_hint=r"granite-3",
)
