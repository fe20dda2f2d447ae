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

The arguments stream as soon as ``{"name": ..., "arguments":`` is in.
"""

from __future__ import annotations

from app.parsers.base import Family
from app.parsers.calls import TaggedJson

FAMILY = Family("qwen", call_formats=(TaggedJson("<tool_call>", "</tool_call>"),))
