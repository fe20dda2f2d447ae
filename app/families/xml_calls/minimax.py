"""MiniMax M2: ``<invoke>`` with ``<parameter>`` children in ``<minimax:tool_call>``.

Raw output (the generation prompt opens ``<think>``)::

    The user wants the weather.
    </think>

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    </invoke>
    </minimax:tool_call>
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import XmlCalls

CALLS = XmlCalls(
    section=("<minimax:tool_call>\n", "</minimax:tool_call>"),
    call='<invoke name="{name}">\n',
    param='<parameter name="{key}">{value}</parameter>\n',
    end="</invoke>\n",
)

FAMILY = Family(
    "minimax",
    templated=(("", CALLS),),
    template_hints=("<minimax:tool_call>",),
    name_hint=r"minimax-m2",
)
