"""Prompt-cache breakpoints on the real demo tokenizer: each wire format's marks reach the
typed request, and each mark becomes the token position where its block ends in the
rendered prompt, with its TTL; marks never change the prompt itself."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.api.anthropic.protocol import MessagesRequest
from app.api.openai.decisions_protocol import DecisionCreateRequest
from app.api.openai.protocol import ChatCompletionRequest
from app.api.openai.responses_protocol import ResponsesRequest
from app.config.schema import ChatParams, ModelCapabilities
from app.engine.types import CacheBreakpoint
from app.errors import InvalidRequestError
from app.pipeline.breakpoints import MAX_BREAKPOINTS
from app.pipeline.pipeline import build_chat
from app.pipeline.prompting import make_profile
from app.pipeline.request import CacheMark

EPHEMERAL = {"type": "ephemeral"}
SYSTEM = "You are a careful assistant for the billing team."
TOOL = {"name": "lookup", "description": "Find an invoice", "input_schema": {"type": "object", "properties": {}}}


@pytest.fixture(scope="module")
def profile(demo_model_dir):
    from mlx_lm.utils import load_tokenizer

    return make_profile("demo", load_tokenizer(demo_model_dir), ChatParams(max_tokens=16), 2048, ModelCapabilities())


def anthropic(**kw):
    body = {"model": "demo", "max_tokens": 8, "system": [{"type": "text", "text": SYSTEM, "cache_control": EPHEMERAL}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "First question here."},
                                                      {"type": "text", "text": "Second part.",
                                                       "cache_control": {"type": "ephemeral", "ttl": "1h"}}]}],
            **kw}
    return MessagesRequest.model_validate(body).to_request()


def ends_at(profile, tokens: list[int], at: CacheBreakpoint, text: str) -> bool:
    """The breakpoint falls at the end of ``text`` in the prompt, or one token short of it."""
    decoded = profile.tokenizer.decode(tokens[:at.tokens])
    longer = profile.tokenizer.decode(tokens[:at.tokens + 1])
    return decoded.endswith(text) or (longer.endswith(text) and not decoded.endswith(text))


def test_cache_control_marks_reach_the_typed_request():
    req = anthropic(tools=[{**TOOL, "cache_control": EPHEMERAL}])
    system, user = req.messages
    assert system.content[0].cache == CacheMark(300)
    assert user.content[0].cache is None and user.content[1].cache == CacheMark(3600)
    assert req.tools[0].cache == CacheMark(300)


def test_each_mark_ends_where_its_block_ends(profile):
    req = anthropic()
    gen = build_chat(profile, req).gen
    tokens = gen.prompt.tokens
    first, second = gen.cache_breakpoints
    assert first.ttl_s == 300 and ends_at(profile, tokens, first, SYSTEM)
    assert second.ttl_s == 3600 and ends_at(profile, tokens, second, "Second part.")
    # The marks change nothing of the prompt.
    unmarked = MessagesRequest.model_validate({
        "model": "demo", "max_tokens": 8, "system": SYSTEM,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "First question here."},
                                                  {"type": "text", "text": "Second part."}]}]}).to_request()
    plain = build_chat(profile, unmarked).gen
    assert plain.prompt.tokens == tokens and plain.cache_breakpoints == ()


def test_a_tool_mark_ends_after_the_tool(profile):
    tools = [TOOL, {**TOOL, "name": "refund", "cache_control": EPHEMERAL}]
    gen = build_chat(profile, anthropic(tools=tools, system=SYSTEM)).gen
    (tool_mark, _) = gen.cache_breakpoints
    text = profile.tokenizer.decode(gen.prompt.tokens[:tool_mark.tokens])
    assert "refund" in text and SYSTEM not in text.split("refund")[-1]


def test_a_tool_use_mark_and_the_request_mark(profile):
    req = anthropic(cache_control=EPHEMERAL, messages=[
        {"role": "user", "content": "Find invoice 7."},
        {"role": "assistant", "content": [{"type": "text", "text": "Looking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {},
                                           "cache_control": EPHEMERAL}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": "Invoice 7: 12 EUR"}]},
    ])
    gen = build_chat(profile, req).gen
    assert len(gen.cache_breakpoints) == 3  # system, the assistant's turn, the last block (the request's mark)
    assert ends_at(profile, gen.prompt.tokens, gen.cache_breakpoints[1], "Looking.")
    assert ends_at(profile, gen.prompt.tokens, gen.cache_breakpoints[2], "Invoice 7: 12 EUR")


def test_more_than_four_cache_controls_are_refused():
    blocks = [{"type": "text", "text": f"part {i}", "cache_control": EPHEMERAL} for i in range(4)]
    with pytest.raises(InvalidRequestError) as caught:
        anthropic(messages=[{"role": "user", "content": blocks}])
    assert "Found 5" in caught.value.message
    with pytest.raises(ValidationError):
        anthropic(cache_control={"type": "ephemeral", "ttl": "2h"})


def test_openai_breakpoints_on_chat_responses_and_decisions(profile):
    bp = {"mode": "explicit"}
    chat = ChatCompletionRequest.model_validate({
        "model": "demo", "prompt_cache_key": "tenant", "prompt_cache_options": {"mode": "explicit", "ttl": "30m"},
        "messages": [{"role": "system", "content": [{"type": "text", "text": SYSTEM, "prompt_cache_breakpoint": bp}]},
                     {"role": "user", "content": [{"type": "text", "text": "Hi",
                                                   "prompt_cache_breakpoint": {**bp, "ttl": "12h"}}]}]}).to_request()
    assert chat.options.prompt_cache_key == "tenant" and chat.options.cache_implicit is False
    assert [m.content[0].cache for m in chat.messages] == [CacheMark(1800), CacheMark(43200)]
    gen = build_chat(profile, chat).gen
    assert [b.ttl_s for b in gen.cache_breakpoints] == [1800, 43200] and gen.cache_implicit is False
    assert ends_at(profile, gen.prompt.tokens, gen.cache_breakpoints[0], SYSTEM)

    responses = ResponsesRequest.model_validate({
        "model": "demo", "prompt_cache_key": "tenant",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi", "prompt_cache_breakpoint": bp}]}],
    }).to_request([])
    assert responses.messages[0].content[0].cache == CacheMark(1800) and responses.options.cache_implicit

    decision = DecisionCreateRequest.model_validate({
        "model": "demo", "prompt_cache_key": "tenant",
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi", "prompt_cache_breakpoint": bp}]}],
        "questions": [{"type": "predicate", "instructions": "A greeting."}]}).to_request()
    assert decision.input[0].content[0].cache == CacheMark(1800) and decision.options.prompt_cache_key == "tenant"


def test_only_the_latest_marks_are_kept(profile):
    bp = {"mode": "explicit"}
    parts = [{"type": "text", "text": f"Paragraph number {i}.", "prompt_cache_breakpoint": bp} for i in range(6)]
    req = ChatCompletionRequest.model_validate({"model": "demo", "messages": [{"role": "user", "content": parts}]})
    gen = build_chat(profile, req.to_request()).gen
    assert len(gen.cache_breakpoints) == MAX_BREAKPOINTS
    assert ends_at(profile, gen.prompt.tokens, gen.cache_breakpoints[0], "Paragraph number 2.")
