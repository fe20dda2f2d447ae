"""MiniMax M3: ``<mm:think>`` reasoning; arguments as elements named by their keys.

Raw output (every tag after the ``]<]minimax[>[`` token; an object's members and
an array's ``<item>``s nest as elements)::

    <mm:think>The user wants the weather.</mm:think>]<]minimax[>[<tool_call>
    ]<]minimax[>[<invoke name="get_weather">]<]minimax[>[<city>Paris]<]minimax[>[</city>]<]minimax[>[</invoke>
    ]<]minimax[>[</tool_call>
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import NestedXmlCalls

TAG = "]<]minimax[>["
CALLS = NestedXmlCalls(
    tag=TAG,
    section=(f"{TAG}<tool_call>\n", f"{TAG}</tool_call>"),
    call=f'{TAG}<invoke name="{{name}}">',
    end=f"{TAG}</invoke>\n",
)

FAMILY = Family(
    "minimax_m3",
    templated=(("", CALLS),),
    reasoning=(("<mm:think>", "</mm:think>"),),
    template_hints=(TAG,),
    name_hint=r"minimax-m3",
)
