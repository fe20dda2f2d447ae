"""ByteDance Seed-OSS: ``<seed:think>`` reasoning and XML parameters in ``<seed:tool_call>``.

Raw output::

    <seed:think>The user wants the weather.</seed:think>
    <seed:tool_call>
    <function=get_weather>
    <parameter=city>Paris</parameter>
    </function>
    </seed:tool_call>

Values are text read by the tool's schema, written without the newlines
Qwen3-Coder puts around them (a newline at a value's end is the value's).
The template's ``thinking_budget`` sets how long it may reason.
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import XmlCalls

CALLS = XmlCalls(
    call="<seed:tool_call>\n<function={name}>\n",
    param="<parameter={key}>{value}</parameter>\n",
    end="</function>\n</seed:tool_call>",
    separator="\n",
)

FAMILY = Family(
    "seed_oss",
    templated=(("", CALLS),),
    reasoning=(("<seed:think>", "</seed:think>"),),
    template_hints=("<seed:tool_call>", "<seed:think>"),
    name_hint=r"seed-oss",
)
