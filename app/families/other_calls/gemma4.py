"""Gemma 4: a ``<|channel>thought`` block and ``<|tool_call>call:NAME{...}<tool_call|>``.

Raw output (strings between ``<|"|>`` tokens, keys bare)::

    <|channel>thought
    The user wants the weather.<channel|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3}<tool_call|>

A stray ``<|channel>`` or ``<channel|>`` around an empty thought is structure, dropped.
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import GemmaCalls

CALLS = GemmaCalls()

FAMILY = Family(
    "gemma4",
    templated=(("", CALLS),),
    reasoning=(("<|channel>thought", "<channel|>"),),
    dropped=("<|channel>",),
    template_hints=("<|tool_call>",),
    name_hint=r"gemma-?4",
)
