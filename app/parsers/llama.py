"""Llama 3.x: calls as ``<function=name>{...}</function>``, or bare JSON.

Raw output with Meta's custom tool-call prompt::

    <function=get_weather>{"city": "Paris"}</function>

Llama 3.1/3.2's own template asks for bare JSON with ``parameters``, which the
bare-JSON path reads when tools were offered::

    {"name": "get_weather", "parameters": {"city": "Paris"}}
"""

from __future__ import annotations

from app.parsers.base import Family
from app.parsers.calls import NamedTag

FAMILY = Family("llama", call_formats=(NamedTag("<function=", ">", "</function>"),))
