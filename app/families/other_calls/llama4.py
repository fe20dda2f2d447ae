"""Llama 4: a Python list of calls as the whole answer, sometimes between ``<|python_start|>``
and ``<|python_end|>``.

Raw output::

    [get_weather(city="Paris", days=3), get_time(tz="CET")]

An answer that starts like a list but is not one of calls (``[a link](url)``)
is content.
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import PythonicCalls

CALLS = PythonicCalls()
TAGGED = PythonicCalls(begin="<|python_start|>", end="<|python_end|>")

FAMILY = Family(
    "llama4",
    templated=(("", CALLS),),
    also_reads=(TAGGED,),
    template_hints=("<|header_start|>",),
    name_hint=r"llama-?4",
)
