"""Apertus: calls as ``[{"NAME": {arguments}}]`` between ``<|tools_prefix|>`` and ``<|tools_suffix|>``.

Raw output::

    <|tools_prefix|>[{"get_weather": {"city": "Paris"}}]<|tools_suffix|>
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import CallSyntax

CALLS = CallSyntax(begin="<|tools_prefix|>", end="<|tools_suffix|>", keyed=True, listed=True)

FAMILY = Family(
    "apertus",
    templated=(("", CALLS),),
    reasoning=(("<|inner_prefix|>", "<|inner_suffix|>"),),
    template_hints=("<|tools_prefix|>",),
    name_hint=r"apertus",
)
