"""MiniMax M1: ``<tool_calls>`` holding one JSON call object a line.

Raw output::

    <think>The user wants the weather.</think>
    <tool_calls>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    {"name": "get_time", "arguments": {"tz": "CET"}}
    </tool_calls>
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import CallSyntax

CALLS = CallSyntax(begin="<tool_calls>\n", end="\n</tool_calls>", lines=True)

FAMILY = Family(
    "minimax_m1",
    templated=(("", CALLS),),
    template_hints=("<tool_calls>\\n{",),
    name_hint=r"minimax-m1",
)
