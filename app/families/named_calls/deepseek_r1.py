"""DeepSeek R1 and its distills: ``<think>`` (opened by the prompt) and fenced JSON calls.

Raw output::

    The user wants the weather.</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""

from __future__ import annotations

from app.families.family import Family
from app.families.named_calls.deepseek_v3 import SECTION
from app.families.syntax import CallSyntax

CALLS = CallSyntax(section=SECTION, begin="<｜tool▁call▁begin｜>", header="function<｜tool▁sep｜>{name}",
                   args="\n```json\n", end="\n```<｜tool▁call▁end｜>")

FAMILY = Family(
    "deepseek_r1",
    templated=(("", CALLS),),
    template_hints=(("<｜tool▁sep｜>", "```json"),),
    name_hint=r"deepseek-r1",
    reasoning_names=r"deepseek-r1",
)
