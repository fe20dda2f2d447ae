"""Qwen and Hermes-style models: reasoning in ``<think>``, calls in ``<tool_call>``.

Raw output (Qwen3, QwQ; Qwen3 puts ``<think>\\n`` in the generation prompt, so
the opener is often missing from the output)::

    <think>
    The user wants the weather in Paris.
    </think>

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {"tz": "Europe/Paris"}}
    </tool_call>

The arguments stream as soon as ``{"name": ..., "arguments":`` is in. Forced
calls are written as the template shows them, one per line-wrapped tag.
"""

from __future__ import annotations

from app.families.family import CallSyntax, Family

CALLS = CallSyntax(begin="<tool_call>\n", end="\n</tool_call>", separator="\n")

FAMILY = Family(
    "qwen",
    templated=(("", CALLS),),
    # Hermes-style models think about calls in <think> before they make one (llama.cpp too).
    calls_in_reasoning=False,
    template_hints=("<tool_call>",),
    name_hint=r"qwen|qwq|hermes",
    reasoning_names=r"qwq",
)
