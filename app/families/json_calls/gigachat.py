"""GigaChat 3 and 3.1: a JSON call after ``<|function_call|>`` or a ``function call`` turn.

Raw output (3.1; GigaChat 3 opens a turn of its own for the call)::

    Let me check.<|function_call|>{"name": "get_weather", "arguments": {"city": "Paris"}}
    Let me check.<|message_sep|>\\n\\nfunction call<|role_sep|>\\n{"name": "get_weather", ...}
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import CallSyntax

V31 = CallSyntax(begin="<|function_call|>")
V3 = CallSyntax(begin="<|message_sep|>\n\nfunction call<|role_sep|>\n")

FAMILY = Family(
    "gigachat",
    templated=(("<|function_call|>", V31), ("", V3)),
    also_reads=(V31,),
    template_hints=("<|role_sep|>",),
    name_hint=r"gigachat",
)
