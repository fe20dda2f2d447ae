"""Any other model: every marker the other families know, plus bare JSON.

The fallback when neither the chat template nor the model name says which
family a model belongs to. It reads reasoning in any of the usual markers,
the JSON call markers of the Qwen, Llama and Mistral families, and, when
tools were offered, a bare JSON answer::

    <think>I should look it up.</think>
    {"name": "get_weather", "arguments": {"city": "Paris"}}

or a list of them: ``[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]``.
Forced calls are bare JSON, whatever the template.
"""

from __future__ import annotations

from app.families.family import Family
from app.families.json_calls import llama, qwen
from app.families.named_calls import mistral

FAMILY = Family(
    "generic",
    also_reads=(qwen.CALLS, llama.FUNCTION_TAG, mistral.CALLS),
)
