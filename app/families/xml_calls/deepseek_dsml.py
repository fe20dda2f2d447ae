"""DeepSeek V3.2 and V4: DSML invoke / parameter elements.

Raw output (``string="true"`` marks a value as text, ``"false"`` as JSON)::

    The user wants the weather.</think>

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls>

V4 names the section ``<｜DSML｜tool_calls>``.
"""

from __future__ import annotations

from app.families.family import Family
from app.families.syntax import XmlCalls

_CALL = '<｜DSML｜invoke name="{name}">\n'
_PARAM = '<｜DSML｜parameter name="{key}" string="{string}">{value}</｜DSML｜parameter>\n'
_END = "</｜DSML｜invoke>\n"
V32 = XmlCalls(section=("<｜DSML｜function_calls>\n", "</｜DSML｜function_calls>"), call=_CALL, param=_PARAM, end=_END)
V4 = XmlCalls(section=("<｜DSML｜tool_calls>\n", "</｜DSML｜tool_calls>"), call=_CALL, param=_PARAM, end=_END)

FAMILY = Family(
    "deepseek_dsml",
    templated=(("<｜DSML｜tool_calls>", V4), ("", V32)),
    template_hints=("｜DSML｜",),
    name_hint=r"deepseek-v3\.2|deepseek-v4",
)
