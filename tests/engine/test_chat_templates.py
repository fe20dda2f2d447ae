"""The fallback renderer for chat templates transformers' sandbox refuses: what llama.cpp's
renderer takes (a growing list, a map in tojson) renders, and the sandbox still holds."""

from __future__ import annotations

import jinja2
import pytest

from app.engine.chat_templates import render_template

MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "reasoning_content": "hmm"}]


def test_a_list_may_grow_and_tojson_reads_a_map() -> None:
    template = ("{%- set q = namespace(ids=[]) -%}{%- set _ = q.ids.append('a') -%}{{ q.ids | tojson }}"
                "{{ tools | map(attribute='function') | tojson }}")
    out = render_template(template, MESSAGES, tools=[{"function": {"name": "f"}}])
    assert out == '["a"][{"name": "f"}]'


def test_reasoning_is_there_as_thinking_too() -> None:
    assert render_template("{{ messages[1].thinking }}", MESSAGES) == "hmm"


def test_a_template_that_refuses_still_refuses() -> None:
    with pytest.raises(jinja2.exceptions.TemplateError, match="alternate"):
        render_template("{{ raise_exception('roles must alternate') }}", MESSAGES)


def test_the_sandbox_holds() -> None:
    with pytest.raises(jinja2.exceptions.SecurityError):
        render_template("{{ messages.__class__.__mro__ }}", MESSAGES)
