"""Any other model: every marker the other families know, plus bare JSON.

The fallback when neither the chat template nor the model name says which
family a model belongs to. It reads reasoning in any of the usual markers
(DeepSeek-R1 distills write ``<think>...</think>``), each family's tool-call
markers, and, when tools were offered, a bare JSON answer::

    <think>I should look it up.</think>
    {"name": "get_weather", "arguments": {"city": "Paris"}}

or a list of them: ``[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]``.
"""

from __future__ import annotations

from app.parsers import llama, mistral, qwen
from app.parsers.base import Family

FAMILY = Family(
    "generic",
    call_formats=qwen.FAMILY.call_formats + llama.FAMILY.call_formats + mistral.FAMILY.call_formats,
)
