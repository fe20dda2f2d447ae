"""FireFunction v2 (a Llama 3 fine-tune): `` functools`` and a JSON list of calls.

Raw output::

     functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import CallSyntax

CALLS = CallSyntax(begin=" functools", listed=True)

FAMILY = Family(
    "firefunction",
    templated=(("", CALLS),),
    template_hints=("functools[",),
    name_hint=r"firefunction",
)
