"""Kimi K3: ``<|open|>`` / ``<|close|>`` sections for thinking, the response and tools.

Raw output (the generation prompt opens the think section)::

    The user wants the weather.<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|>
    <|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>
    <|open|>argument key="city" type="string"<|sep|>Paris<|close|>argument<|sep|>
    <|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>

(one line, broken here).

The response and message tags are structure, dropped; each argument's
``type`` says whether its text is a string.
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import XmlCalls

CALLS = XmlCalls(
    section=("<|open|>tools<|sep|>", "<|close|>tools<|sep|>"),
    call='<|open|>call tool="{name}" index="{index}"<|sep|>',
    param='<|open|>argument key="{key}" type="{type}"<|sep|>{value}<|close|>argument<|sep|>',
    end="<|close|>call<|sep|>",
)

FAMILY = Family(
    "kimi_k3",
    templated=(("", CALLS),),
    reasoning=(("<|open|>think<|sep|>", "<|close|>think<|sep|>"),),
    dropped=("<|open|>response<|sep|>", "<|close|>response<|sep|>", "<|close|>message<|sep|>"),
    template_hints=("<|open|>",),
    name_hint=r"kimi-k3",
)
