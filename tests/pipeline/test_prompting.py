"""Typed request -> prompt on the real demo tokenizer: thinking switches, tools, limits."""

from __future__ import annotations

import pytest

from app.api.openai.protocol import ChatCompletionRequest
from app.config.schema import ChatParams, ModelCapabilities
from app.errors import ConfigError, InvalidRequestError
from app.pipeline.pipeline import build_chat
from app.pipeline.prompting import make_profile, template_message
from app.pipeline.request import ImagePart, Message, TextPart, ToolCall
from tests.vision.sample_images import data_url, image_bytes


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(demo_model_dir)


def profile(tokenizer, **caps):
    return make_profile("demo", tokenizer, ChatParams(max_tokens=64), 2048, ModelCapabilities(**caps))


def chat(**kw):
    body = {"model": "demo", "messages": [{"role": "user", "content": "Hi"}], **kw}
    return ChatCompletionRequest.model_validate(body).to_request()


def prepare_chat(profile, req):
    return build_chat(profile, req)


@pytest.mark.parametrize("body, thinking", [
    ({}, True),
    ({"thinking": False}, False),
    ({"chat_template_kwargs": {"enable_thinking": False}}, False),
    ({"reasoning_effort": "none"}, False),
    ({"reasoning_effort": "high"}, True),
])
def test_thinking_switches(tokenizer, body, thinking):
    p = prepare_chat(profile(tokenizer, reasoning_parser="qwen"), chat(**body))
    assert p.emit_reasoning is thinking and p.parser == "qwen"
    # SmolLM2's template has no thinking switch: reasoning markers are read either way.
    assert p.parse_reasoning is True


def test_non_reasoning_model_never_thinks(tokenizer):
    p = prepare_chat(profile(tokenizer, reasoning_parser="none"), chat(thinking=True))
    assert p.emit_reasoning is False and p.parse_reasoning is False


def test_unknown_parser_names_are_config_errors(tokenizer):
    with pytest.raises(ConfigError, match="tool_parser 'hermes2'"):
        profile(tokenizer, tool_parser="hermes2")


TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}},
         {"type": "function", "function": {"name": "g"}}]


def test_named_tool_choice_offers_only_that_tool(tokenizer):
    p = prepare_chat(profile(tokenizer), chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}}))
    assert "\n- g()" in p.prompt_text and "\n- f(" not in p.prompt_text and p.tools_offered
    with pytest.raises(InvalidRequestError, match="'h'"):
        prepare_chat(profile(tokenizer), chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "h"}}))


def test_required_tool_choice_says_so(tokenizer):
    prompt = prepare_chat(profile(tokenizer), chat(tools=TOOLS, tool_choice="required")).prompt_text
    assert "You must call one of them" in prompt


def test_max_tokens_and_max_completion_tokens(tokenizer):
    assert prepare_chat(profile(tokenizer), chat()).gen.max_tokens == 64  # the model default
    assert prepare_chat(profile(tokenizer), chat(max_completion_tokens=5)).gen.max_tokens == 5
    assert prepare_chat(profile(tokenizer), chat(max_tokens=7)).gen.max_tokens == 7
    # More than the context leaves is clamped, not refused (Claude Code asks for 32000).
    big = prepare_chat(profile(tokenizer), chat(max_tokens=5000))
    assert big.gen.max_tokens == 2048 - len(big.gen.prompt_tokens)


def test_default_max_tokens_is_capped_to_the_context(tokenizer):
    p = make_profile("demo", tokenizer, ChatParams(max_tokens=4000), 100, ModelCapabilities())
    req = prepare_chat(p, chat())
    assert req.gen.max_tokens == 100 - len(req.gen.prompt_tokens)


@pytest.mark.parametrize("body, priority", [
    ({}, "interactive"),
    ({"priority": "background"}, "background"),
    # Open WebUI's title / tags / follow-up prompts.
    ({"messages": [{"role": "user", "content": "### Task:\nGenerate a concise title for the chat."}]}, "background"),
    ({"messages": [{"role": "user", "content": "Tell me about ### Task: lists"}]}, "interactive"),
])
def test_background_work_is_recognised(tokenizer, body, priority):
    assert prepare_chat(profile(tokenizer), chat(**body)).gen.priority == priority


def test_text_parts_join_with_one_rule(tokenizer):
    """The same message reads the same whatever carries it: parts are joined by newlines."""
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                       {"type": "text", "text": "world"}]}]}
    joined = {"messages": [{"role": "user", "content": "Hello\nworld"}]}
    assert prepare_chat(profile(tokenizer), chat(**parts)).prompt_text == \
        prepare_chat(profile(tokenizer), chat(**joined)).prompt_text


def test_template_messages_with_images_keep_the_clients_order():
    """For a builder that takes images (a native VLM): mlx-vlm's parts, in the client's order."""
    messages = [
        Message.of("system", "Be brief."),
        Message("user", (TextPart("Compare"), TextPart("these:"), ImagePart(data_url(image_bytes()), "m[1].c[2]"),
                         TextPart("and"), ImagePart(data_url(image_bytes()), "m[1].c[4]"))),
        Message("assistant", (TextPart(""),), tool_calls=(ToolCall("c1", "look", '{"x": 1}'),)),
        Message("tool", (TextPart("done"),), tool_call_id="c1"),
    ]
    assert [template_message(m, images=True) for m in messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Compare\nthese:"}, {"type": "image"},
                                     {"type": "text", "text": "and"}, {"type": "image"}]},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "look", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "done", "tool_call_id": "c1"},
    ]


    # A text model's builder takes text: the same message is its text.
    assert template_message(messages[1])["content"] == "Compare\nthese:\nand"


BILLING = "x-anthropic-billing-header: cc_version=2.1.197.6e2; cc_entrypoint=cli;"


@pytest.mark.parametrize("system", [[{"type": "text", "text": BILLING}, {"type": "text", "text": "Be brief."}],
                                    f"{BILLING}\nBe brief."], ids=["own part", "first line"])
def test_claude_codes_billing_line_never_reaches_the_template(tokenizer, system):
    """On any format (a proxy may forward Claude Code's system blocks to chat completions): the
    prompt is the one without the line, whose hash would change the prompt's first tokens."""
    plain = prepare_chat(profile(tokenizer), chat(messages=[{"role": "system", "content": "Be brief."},
                                                            {"role": "user", "content": "Hi"}]))
    billed = prepare_chat(profile(tokenizer), chat(messages=[{"role": "system", "content": system},
                                                             {"role": "user", "content": "Hi"}]))
    assert billed.prompt_text == plain.prompt_text and "x-anthropic-billing-header" not in billed.prompt_text
    # A system message of the line alone is no system message: the template's default stands.
    alone = prepare_chat(profile(tokenizer), chat(messages=[{"role": "system", "content": BILLING},
                                                            {"role": "user", "content": "Hi"}]))
    assert alone.prompt_text == prepare_chat(profile(tokenizer), chat()).prompt_text
