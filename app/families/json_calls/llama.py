"""Llama 3.x: calls as ``<function=name>{...}</function>``, or bare JSON.

Raw output with Meta's custom tool-call prompt (templates that show it say
``<function=``, and then that is what forced calls are)::

    <function=get_weather>{"city": "Paris"}</function>

Llama 3.1/3.2's own template asks for bare JSON with ``parameters``, which the
bare-JSON path reads::

    {"name": "get_weather", "parameters": {"city": "Paris"}}
"""

from __future__ import annotations

from app.families.family import CallSyntax, Family

FUNCTION_TAG = CallSyntax(begin="<function=", args=">", end="</function>")
JSON_PARAMETERS = CallSyntax(arguments_key="parameters")

FAMILY = Family(
    "llama",
    templated=(("<function=", FUNCTION_TAG), ("", JSON_PARAMETERS)),
    template_hints=("<function=", "<|python_tag|>", "<|start_header_id|>"),
    name_hint=r"llama",
)
