"""Qwen3-Coder, Qwen3.5 / 3.6, Nemotron 3, StepFun 3.5: XML parameters in ``<tool_call>``.

Raw output (Qwen3.5 and Nemotron 3 open ``<think>\\n`` in the generation
prompt when thinking is on; a call may also end reasoning that was never closed)::

    The user wants the weather.
    </think>

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Values are text, read by the tool's schema (``days`` above is the number 3);
a string value streams as it is written. Models sometimes drop the
``<tool_call>`` opener and start at ``<function=``, which is read too.
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import XmlCalls

CALLS = XmlCalls(
    call="<tool_call>\n<function={name}>\n",
    param="<parameter={key}>\n{value}\n</parameter>\n",
    end="</function>\n</tool_call>",
    separator="\n",
)

FAMILY = Family(
    "qwen3_coder",
    templated=(("", CALLS),),
    template_hints=("<parameter=",),
    name_hint=r"qwen3-coder|qwen3\.[5-9]|nemotron-3|step-?3",
)
