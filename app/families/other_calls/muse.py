"""muse-glimmer: messages to recipients; a call is a message to the tool, its body ATEM XML.

Raw output (the generation prompt ends with ``<|start|>assistant``)::

     to=self<|message|>The user wants the weather.<|eom|>
    <|start|>assistant to=get_weather<|message|><atem:function_calls>
    <atem:invoke name="get_weather">
    <atem:parameter name="city">Paris</atem:parameter>
    </atem:invoke>
    </atem:function_calls>

`` to=user`` is the answer and `` to=self`` the reasoning; calls written in
either stay their text.
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import RecipientCalls, XmlCalls

BODY = XmlCalls(
    section=("<atem:function_calls>\n", "</atem:function_calls>"),
    call='<atem:invoke name="{name}">\n',
    param='<atem:parameter name="{key}">{value}</atem:parameter>\n',
    end="</atem:invoke>\n",
)
CALLS = RecipientCalls(BODY)

FAMILY = Family(
    "muse",
    templated=(("", CALLS),),
    reasoning=((" to=self<|message|>", "<|eom|>"),),
    template_hints=("<atem:function_calls>",),
    name_hint=r"muse",
)
