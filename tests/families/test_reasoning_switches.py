"""A request's thinking, effort and budget reach each template as its own switch.

Detection finds the variables a template reads to turn reasoning on or off or to
set its effort or budget (``detection.SWITCHES``); ``prompting.template_switches``
sets them from the typed request. Here each wire format's own way of asking goes
through its adapter and the pipeline into the real template's prompt:

    gpt-oss      reasoning_effort    "Reasoning: high"; thinking off is "low" (it cannot stop)
    Seed-OSS     thinking_budget     the budget's sentence; thinking off is budget 0
    Qwen3        enable_thinking     off: the empty <think></think> block
    DeepSeek 3.1 thinking            on: the prompt opens <think>
    Kimi K3      thinking_effort     the effort's sentence
    Command A    reasoning           off: the thinking block opened and closed
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.api.agui import to_chat_request
from app.api.anthropic.protocol import MessagesRequest
from app.api.openai.protocol import ChatCompletionRequest
from app.api.openai.responses_protocol import ResponsesRequest
from app.pipeline.pipeline import build_chat
from app.pipeline.request import ChatRequest
from tests.families import corpus

HI = [{"role": "user", "content": "Hi"}]


def chat(**kw: Any) -> ChatRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": HI, **kw}).to_request()


def responses(**kw: Any) -> ChatRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": HI, **kw}).to_request([])


def messages(**kw: Any) -> ChatRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 4096, "messages": HI, **kw}).to_request()


def agui(**props: Any) -> ChatRequest:
    from ag_ui.core import RunAgentInput

    return to_chat_request(RunAgentInput.model_validate({
        "threadId": "t", "runId": "r", "state": None, "context": [], "tools": [],
        "forwardedProps": {"model": "m", **props}, "messages": [{"id": "1", "role": "user", "content": "Hi"}]}), "m")


ENABLED = {"type": "enabled", "budget_tokens": 1024}
CASES = [
    ("openai-gpt-oss-120b", chat(reasoning_effort="high"), "Reasoning: high", None),
    ("openai-gpt-oss-120b", responses(reasoning={"effort": "low"}), "Reasoning: low", None),
    ("openai-gpt-oss-120b", messages(thinking=ENABLED, output_config={"effort": "high"}), "Reasoning: high", None),
    ("openai-gpt-oss-120b", messages(), "Reasoning: low", None),  # Anthropic's default: no thinking
    ("openai-gpt-oss-120b", agui(reasoning_effort="medium"), "Reasoning: medium", None),
    ("ByteDance-Seed-OSS", messages(thinking=ENABLED), "the thinking budget, which is 1024", None),
    ("ByteDance-Seed-OSS", responses(reasoning={"max_tokens": 512}), "which is 512", None),
    ("ByteDance-Seed-OSS", chat(chat_template_kwargs={"enable_thinking": False}), "thinking budget is 0", None),
    ("Qwen-Qwen3-0.6B", chat(chat_template_kwargs={"enable_thinking": False}), "<think>\n\n</think>\n\n", None),
    ("Qwen-Qwen3-0.6B", messages(thinking=ENABLED), None, "</think>"),
    ("Qwen-Qwen3-0.6B", agui(thinking=False), "<think>\n\n</think>\n\n", None),
    ("deepseek-ai-DeepSeek-V3.1", messages(thinking=ENABLED), "<｜Assistant｜><think>", "</think>"),
    ("deepseek-ai-DeepSeek-V3.1", chat(chat_template_kwargs={"enable_thinking": False}), "<think></think>", None),
    ("Kimi-K3", chat(reasoning_effort="high"), "thinking_effort=high", None),
    ("Cohere2MoE", messages(), "<|START_THINKING|><|END_THINKING|>", None),
    ("Cohere2MoE", messages(thinking=ENABLED), None, "<|END_THINKING|>"),
]


@pytest.mark.parametrize(("template", "req", "present", "absent"), CASES,
                         ids=[f"{t}-{i}" for i, (t, *_) in enumerate(CASES)])
def test_the_request_sets_the_templates_switch(corpus_root: Path, corpus_tokenizer: Any, template: str,
                                               req: ChatRequest, present: str | None, absent: str | None) -> None:
    profile = corpus.profile_for(corpus_tokenizer, corpus.template_text(corpus_root, f"{template}.jinja"), "model")
    prompt = build_chat(profile, req).prompt_text
    if present is not None:
        assert present in prompt, prompt[-600:]
    if absent is not None:
        assert absent not in prompt.split("Hi", 1)[-1], prompt[-600:]


def test_detection_finds_each_templates_switches(corpus_root: Path, corpus_tokenizer: Any) -> None:
    found = {t: corpus.profile_for(corpus_tokenizer, corpus.template_text(corpus_root, f"{t}.jinja"), "m").switches
             for t in ("openai-gpt-oss-120b", "ByteDance-Seed-OSS", "Qwen-Qwen3-0.6B", "Kimi-K3", "Cohere2MoE",
                       "meta-llama-Llama-3.1-8B-Instruct")}
    assert found == {
        "openai-gpt-oss-120b": ("reasoning_effort",), "ByteDance-Seed-OSS": ("thinking_budget",),
        "Qwen-Qwen3-0.6B": ("enable_thinking",), "Kimi-K3": ("thinking", "thinking_effort"),
        "Cohere2MoE": ("reasoning",), "meta-llama-Llama-3.1-8B-Instruct": (),
    }
