"""Apriel: reasoning up to ``[BEGIN FINAL RESPONSE]``, calls as a JSON list in ``<tool_calls>``.

Raw output (Apriel 1.6's generation prompt opens the reasoning with
``Here are my reasoning steps:``)::

    The user wants the weather.
    [BEGIN FINAL RESPONSE]
    <tool_calls>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_calls>
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import CallSyntax

CALLS = CallSyntax(begin="<tool_calls>", end="</tool_calls>", listed=True)

FAMILY = Family(
    "apriel",
    templated=(("", CALLS),),
    reasoning=(("Here are my reasoning steps:", "[BEGIN FINAL RESPONSE]"),),
    dropped=("[END FINAL RESPONSE]",),
    template_hints=("[BEGIN FINAL RESPONSE]", "<tool_calls>["),
    name_hint=r"apriel",
)
