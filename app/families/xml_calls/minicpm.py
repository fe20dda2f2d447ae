"""MiniCPM 5: ``<function name="...">`` with ``<param name="...">`` values.

Raw output (a value holding ``</param>`` is wrapped in CDATA)::

    <think>The user wants code run.</think>
    <function name="python"><param name="code">print('hey')</param></function>
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import XmlCalls

CALLS = XmlCalls(
    call='<function name="{name}">',
    param='<param name="{key}">{value}</param>',
    end="</function>",
    separator="\n",
)

FAMILY = Family(
    "minicpm",
    templated=(("", CALLS),),
    template_hints=('<param name="',),
    name_hint=r"minicpm",
)
