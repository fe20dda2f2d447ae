"""gpt-oss: OpenAI's Harmony format, channels rather than tags.

Raw output (the generation prompt ends with ``<|start|>assistant``)::

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>

``analysis`` is reasoning, a message to ``functions.NAME`` is a call, ``final``
is the answer (app.parsers.harmony reads them). The template's
``reasoning_effort`` (low, medium, high) sets how long it reasons.
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import HarmonyCalls

CALLS = HarmonyCalls()

FAMILY = Family(
    "gpt_oss",
    templated=(("", CALLS),),
    reasoning=(("<|channel|>analysis<|message|>", "<|end|>"),),
    template_hints=("<|channel|>",),
    name_hint=r"gpt-oss",
)
