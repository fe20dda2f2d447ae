"""Cohere Command R7B, Command A (Cohere2): thinking and action blocks.

Raw output::

    <|START_THINKING|>The user wants the weather.<|END_THINKING|><|START_ACTION|>[
        {"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}
    ]<|END_ACTION|>

    <|START_THINKING|>Easy.<|END_THINKING|><|START_RESPONSE|>Paris is sunny.<|END_RESPONSE|>

Command A's generation prompt opens the thinking block and writes its answer
in ``<|START_TEXT|>``; Command R+ writes ``Action:`` and a fenced JSON list.
The response markers are structure, dropped.
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import CallSyntax

ACTION = CallSyntax(begin="<|START_ACTION|>", end="<|END_ACTION|>", arguments_key="parameters", listed=True)
FENCED = CallSyntax(begin="Action:\n```json\n", end="\n```", arguments_key="parameters", listed=True)

FAMILY = Family(
    "cohere",
    templated=(("<|START_ACTION|>", ACTION), ("", FENCED)),
    reasoning=(("<|START_THINKING|>", "<|END_THINKING|>"),),
    dropped=("<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_TEXT|>", "<|END_TEXT|>", "<|CHATBOT_TOKEN|>"),
    template_hints=("<|START_ACTION|>", "<|START_THINKING|>", "<|CHATBOT_TOKEN|>"),
    name_hint=r"command-r|command-a|c4ai|cohere",
)
