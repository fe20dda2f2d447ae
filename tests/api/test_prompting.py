"""Request -> prompt conversion on the real demo tokenizer: thinking switches, tools, limits."""

from __future__ import annotations

import pytest

from app.api.prompting import make_profile, prepare_chat
from app.api.schemas import ChatCompletionRequest
from app.config.schema import EngineParams, ModelCapabilities
from app.errors import ConfigError, ContextLengthError, InvalidRequestError


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(demo_model_dir)


def profile(tokenizer, **caps):
    return make_profile("demo", tokenizer, EngineParams(max_tokens=64), 2048, ModelCapabilities(**caps))


def chat(**kw):
    return ChatCompletionRequest.model_validate({"model": "demo", "messages": [{"role": "user", "content": "Hi"}], **kw})


@pytest.mark.parametrize("body, thinking", [
    ({}, True),
    ({"thinking": False}, False),
    ({"chat_template_kwargs": {"enable_thinking": False}}, False),
    ({"reasoning_effort": "none"}, False),
    ({"reasoning_effort": "high"}, True),
])
def test_thinking_switches(tokenizer, body, thinking):
    p = prepare_chat(profile(tokenizer, reasoning_parser="qwen"), chat(**body))
    assert p.reasoning is thinking and p.parser == "qwen"


def test_non_reasoning_model_never_thinks(tokenizer):
    p = prepare_chat(profile(tokenizer, reasoning_parser="none"), chat(thinking=True))
    assert p.reasoning is False


def test_unknown_parser_names_are_config_errors(tokenizer):
    with pytest.raises(ConfigError, match="tool_parser 'hermes2'"):
        profile(tokenizer, tool_parser="hermes2")


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}},
         {"type": "function", "function": {"name": "g"}}]


def test_named_tool_choice_offers_only_that_tool(tokenizer):
    p = prepare_chat(profile(tokenizer), chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}}))
    assert '"name": "g"' in p.prompt_text and '"name": "f"' not in p.prompt_text and p.tools_offered
    with pytest.raises(InvalidRequestError, match="'h'"):
        prepare_chat(profile(tokenizer), chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "h"}}))


def test_required_tool_choice_says_so(tokenizer):
    assert "You must call one of them" in prepare_chat(profile(tokenizer), chat(tools=TOOLS, tool_choice="required")).prompt_text


def test_max_tokens_and_max_completion_tokens(tokenizer):
    assert prepare_chat(profile(tokenizer), chat()).gen.max_tokens == 64  # the model default
    assert prepare_chat(profile(tokenizer), chat(max_completion_tokens=5)).gen.max_tokens == 5
    assert prepare_chat(profile(tokenizer), chat(max_tokens=7)).gen.max_tokens == 7
    with pytest.raises(ContextLengthError):
        prepare_chat(profile(tokenizer), chat(max_tokens=5000))


def test_default_max_tokens_is_capped_to_the_context(tokenizer):
    p = make_profile("demo", tokenizer, EngineParams(max_tokens=4000), 100, ModelCapabilities())
    req = prepare_chat(p, chat())
    assert req.gen.max_tokens == 100 - len(req.gen.prompt_tokens)
