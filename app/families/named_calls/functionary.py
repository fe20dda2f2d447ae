"""Functionary v3.2: ``>>>recipient`` then the message; v3.1: ``<function=NAME>``.

Raw output of v3.2 (the generation prompt ends with ``>>>``: the output starts
with the first recipient; ``all`` is the user)::

    all
    Let me look it up.>>>get_weather
    {"city": "Paris"}
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import CallSyntax

RECIPIENT = CallSyntax(begin=">>>", args="\n", content_header="all")
FUNCTION_TAG = CallSyntax(begin="<function=", args=">", end="</function>")

FAMILY = Family(
    "functionary",
    templated=((">>>", RECIPIENT), ("", FUNCTION_TAG)),
    template_hints=(">>>all",),
    name_hint=r"functionary",
)
