"""DeepSeek V3 and V3.1: calls as special-token sections, the arguments JSON.

Raw output (V3.1 with thinking: the generation prompt opens ``<think>``)::

    The user wants the weather.</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>
    {"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(one line, broken here).

The template's ``thinking`` switch turns reasoning on.
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import CallSyntax

SECTION = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
CALLS = CallSyntax(section=SECTION, begin="<｜tool▁call▁begin｜>", args="<｜tool▁sep｜>", end="<｜tool▁call▁end｜>")

FAMILY = Family(
    "deepseek_v3",
    templated=(("", CALLS),),
    template_hints=("<｜tool▁sep｜>",),
    name_hint=r"deepseek-v3",
)
