"""Nemotron Nano v2: ``<think>`` and a JSON list of calls in ``<TOOLCALL>``.

Raw output::

    The user wants the weather.
    </think>
    <TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</TOOLCALL>
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import CallSyntax

CALLS = CallSyntax(begin="<TOOLCALL>", end="</TOOLCALL>", listed=True)

FAMILY = Family(
    "nemotron",
    templated=(("", CALLS),),
    template_hints=("<TOOLCALL>",),
    name_hint=r"nemotron-nano|nemotron-h",
)
