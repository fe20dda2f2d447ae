"""Which parser family a model needs, and whether it reasons.

The chat template is the best witness: it renders past tool calls and
reasoning in the model's own markers (mlx-lm's ``_infer_tool_parser`` reads
it the same way). The model name is the fallback, with the reasoning-model
name patterns of the streaming spec. The hints are each family's
(``app.families``); this module only runs them.
"""

from __future__ import annotations

import re

from app.families import DEFAULT, FAMILIES, REASONING_MARKERS

# Each family's hints, in the registry's detection order (first match wins).
_TEMPLATE_HINTS = tuple((hint, f.name) for f in FAMILIES.values() for hint in f.template_hints)
_NAME_HINTS = tuple((re.compile(f.name_hint), f.name) for f in FAMILIES.values() if f.name_hint)
# *reasoning*, *thinking* (ministral-*-reasoning among them), and each family's own:
# deepseek-r1*, qwq-*, Magistral, which always reasons.
_REASONING_NAMES = re.compile("|".join(["reasoning", "thinking",
                                        *(f.reasoning_names for f in FAMILIES.values() if f.reasoning_names)]))
_REASONING_TEMPLATE = (*dict.fromkeys(opener for f in FAMILIES.values() for opener, _ in f.reasoning_pairs),
                       "enable_thinking")


def detect_parser(model_name: str, chat_template: str | None) -> str:
    """The parser family for a model: from its template's markers, else its name, else ``generic``."""
    for hint, family in _TEMPLATE_HINTS:
        parts = (hint,) if isinstance(hint, str) else hint
        if chat_template and all(part in chat_template for part in parts):
            return family
    name = _base_name(model_name)
    for pattern, family in _NAME_HINTS:
        if pattern.search(name):
            return family
    return DEFAULT


def is_reasoning_model(model_name: str, chat_template: str | None) -> bool:
    """Whether the model writes reasoning: its template knows reasoning markers, or its name says so."""
    if chat_template and any(marker in chat_template for marker in _REASONING_TEMPLATE):
        return True
    return _REASONING_NAMES.search(_base_name(model_name)) is not None


def template_opens_reasoning(rendered_prompt: str,
                             pairs: tuple[tuple[str, str], ...] = REASONING_MARKERS) -> bool:
    """Whether the prompt ends inside an open reasoning block of ``pairs`` (``...<think>\\n``,
    ``...[THINK]``, Command A's ``<|START_THINKING|>``).

    Then the output starts as reasoning (Qwen3 and DeepSeek-R1 open ``<think>``
    in the generation prompt; Ministral reasoning opens ``[THINK]`` when
    thinking is on). A prompt ending in an empty closed block does not count.
    """
    tail = rendered_prompt.rstrip()
    return any(tail.endswith(opener.rstrip()) for opener, _ in pairs)


def _base_name(model_name: str) -> str:
    """``mlx-community/Qwen3-4B-4bit`` -> ``qwen3-4b-4bit``."""
    return model_name.rsplit("/", 1)[-1].lower()
