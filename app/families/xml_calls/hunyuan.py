"""Tencent Hunyuan (Hy3): GLM-style key/value tags, all in the ``:opensource`` namespace.

Raw output::

    <think:opensource>The user wants the weather.</think:opensource><tool_calls:opensource>
    <tool_call:opensource>get_weather<tool_sep:opensource>
    <arg_key:opensource>city</arg_key:opensource>
    <arg_value:opensource>Paris</arg_value:opensource>
    </tool_call:opensource>
    </tool_calls:opensource>
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import XmlCalls

CALLS = XmlCalls(
    section=("<tool_calls:opensource>\n", "</tool_calls:opensource>"),
    call="<tool_call:opensource>{name}<tool_sep:opensource>\n",
    param="<arg_key:opensource>{key}</arg_key:opensource>\n<arg_value:opensource>{value}</arg_value:opensource>\n",
    end="</tool_call:opensource>\n",
)

FAMILY = Family(
    "hunyuan",
    templated=(("", CALLS),),
    reasoning=(("<think:opensource>", "</think:opensource>"),),
    template_hints=("<tool_sep:opensource>",),
    name_hint=r"hunyuan|hy3",
)
