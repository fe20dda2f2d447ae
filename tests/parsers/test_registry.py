"""make_parser over the family registry, family detection, and the import rule for app/parsers.

That each family module is registered under its own name is tests/families' business."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import app.parsers
from app.errors import ConfigError
from app.families import FAMILIES
from app.parsers import PARSERS, detect_parser, is_reasoning_model, make_parser, new_call_id, template_opens_reasoning

PACKAGE = Path(app.parsers.__file__).parent


def test_parser_names_are_the_family_names_users_type() -> None:
    """models.yaml's tool_parser / reasoning_parser values: renaming one breaks configs."""
    assert PARSERS is FAMILIES
    assert {"generic", "llama", "mistral", "qwen"} <= set(PARSERS)


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_make_parser_gives_a_working_parser(name: str) -> None:
    parser = make_parser(name, reasoning=True, starts_in_reasoning=False, tools_offered=True)
    assert parser.feed("Hello") + parser.finish()


def test_unknown_parser_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="known: " + ", ".join(sorted(PARSERS))):
        make_parser("hermes2", reasoning=False)


def test_call_ids_look_like_openai_ids() -> None:
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", new_call_id())
    assert new_call_id() != new_call_id()


@pytest.mark.parametrize(
    ("model", "template", "family"),
    [
        ("whatever", "{{ '[AVAILABLE_TOOLS]' }}...{{ '[TOOL_CALLS]' + name + '[ARGS]' }}", "mistral"),
        ("ministral-3-3b-reasoning", "{%- if thinking %}{{ '[THINK]' }}{%- endif %}", "mistral"),
        ("whatever", "<|im_start|>...<tool_call>\\n{\"name\": {{ tool_call.name }}}</tool_call>", "qwen"),
        ("whatever", "Call a function with <function=example_function_name>{...}</function>", "llama"),
        ("whatever", "<|start_header_id|>assistant<|end_header_id|>", "llama"),
        ("mlx-community/Mistral-7B-Instruct-v0.3-4bit", None, "mistral"),
        ("mlx-community/Magistral-Small-2509-4bit", "", "mistral"),
        ("Qwen/QwQ-32B", None, "qwen"),
        ("NousResearch/Hermes-3", None, "qwen"),
        ("meta-llama/Llama-3.2-1B-Instruct", None, "llama"),
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "<｜tool▁calls▁begin｜><think>", "deepseek_r1"),
        ("my-model", None, "generic"),
        ("my-model", "{{ messages }}", "generic"),
    ],
)
def test_detect_parser(model: str, template: str | None, family: str) -> None:
    assert detect_parser(model, template) == family


@pytest.mark.parametrize(
    ("model", "template", "reasons"),
    [
        ("deepseek-r1", None, True),
        ("deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", None, True),
        ("Qwen/QwQ-32B-Preview", None, True),
        ("ministral-3-3b-reasoning", None, True),
        ("some-thinking-model", None, True),
        ("Magistral-Small", None, True),
        ("Qwen3-4B", "{%- if enable_thinking is false %}<think>\n\n</think>{% endif %}", True),
        ("x", "{{ '[THINK]' }}", True),
        ("x", "<thought>", True),
        ("Qwen2.5-7B-Instruct", "<|im_start|><tool_call>", False),
        ("Llama-3.2-1B-Instruct", None, False),
    ],
)
def test_is_reasoning_model(model: str, template: str | None, reasons: bool) -> None:
    assert is_reasoning_model(model, template) is reasons


@pytest.mark.parametrize(
    ("prompt", "opens"),
    [
        ("<|im_start|>assistant\n<think>\n", True),
        ("<｜Assistant｜><think>\n", True),
        ("[INST]Hi[/INST][THINK]", True),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        ("<|im_start|>assistant\n", False),
        ("Use <think> tags.<|im_start|>assistant\n", False),
        ("", False),
    ],
)
def test_template_opens_reasoning(prompt: str, opens: bool) -> None:
    assert template_opens_reasoning(prompt) is opens


def test_parsers_import_nothing_from_the_edges() -> None:
    """Parsers emit their own events; the API renders them (house style)."""
    banned = re.compile(r"^(litestar|pydantic|mlx|mlx_lm|mlx_vlm|app\.api|app\.engine|app\.vision|app\.config)(\.|$)")
    for path in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not [n for n in names if banned.match(n)], f"{path.name} imports {names}"


def test_mistral_call_ids_fit_its_chat_template():
    """Mistral templates raise on tool call ids that are not 9 alphanumerics."""
    from app.parsers import ToolCallStart, make_parser

    p = make_parser("mistral", reasoning=False, tools_offered=True)
    events = p.feed('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}') + p.finish()
    (start,) = [e for e in events if isinstance(e, ToolCallStart)]
    assert len(start.id) == 9 and start.id.isalnum()
    q = make_parser("qwen", reasoning=False, tools_offered=True)
    (other,) = [
        e for e in q.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>') + q.finish()
        if isinstance(e, ToolCallStart)
    ]
    assert other.id.startswith("call_")
