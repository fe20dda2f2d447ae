"""GLM-4.5 to 4.7, Ling 3, Spark, Laguna: ``<arg_key>`` / ``<arg_value>`` pairs.

Raw output (GLM-4.6 puts newlines between the tags, GLM-4.7 none; both read)::

    <think>The user wants the weather.</think>
    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

Values are text read by the tool's schema. A call written before the
reasoning block is closed ends it (Ling writes them so).
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import XmlCalls

CALLS = XmlCalls(
    call="<tool_call>{name}\n",
    param="<arg_key>{key}</arg_key>\n<arg_value>{value}</arg_value>\n",
    end="</tool_call>",
    separator="\n",
)

FAMILY = Family(
    "glm",
    templated=(("", CALLS),),
    template_hints=("<arg_key>",),
    name_hint=r"glm-4\.[5-9]|ling-|spark|laguna",
)
