"""Earlier calls and their results, rendered back through each family's real template.

A conversation that carries a call and its result comes in on each wire format
(chat completions, Responses, Messages, AG-UI), goes through the adapter into
the typed request and through the pipeline (``build_chat``) into the model's
prompt, with a template from llama.cpp's corpus. The prompt must hold the call
as the model writes it: the family's own parser reads it back out of the turn,
the call's name and arguments intact, and the result follows it. Ids are the
family's where its template writes its own (Kimi's ``functions.NAME:N``) and
accepted ones where it checks them (Mistral's nine characters).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.api.agui import to_chat_request
from app.api.anthropic.protocol import MessagesRequest
from app.api.openai.protocol import ChatCompletionRequest
from app.api.openai.responses_protocol import ResponsesRequest
from app.parsers import collect, make_parser
from app.pipeline.pipeline import build_chat
from app.pipeline.request import ChatRequest
from tests.families import corpus

QUESTION, RESULT = "Weather in Paris, please?", "RESULT-SUNNY-21"
ARGS = {"city": "Paris", "days": 2}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
          "required": ["city"]}
CALL_ID = "call_abc123"

# One template of each family whose template renders earlier calls.
TEMPLATES = [
    "Qwen-Qwen3-0.6B", "Qwen3.5-4B", "ByteDance-Seed-OSS", "openbmb-MiniCPM5-1B", "GLM-4.7-Flash", "MiniMax-M2",
    "MiniMax-M3", "deepseek-ai-DeepSeek-V3.2", "deepseek-ai-DeepSeek-V3.1", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    "moonshotai-Kimi-K2", "Kimi-K3", "openai-gpt-oss-120b", "google-gemma-4-31B-it", "LFM2.5-8B-A1B",
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use", "NVIDIA-Nemotron-Nano-v2", "Apertus-8B-Instruct",
    "GigaChat3.1-10B-A1.8B", "meta-llama-Llama-3.1-8B-Instruct", "mistralai-Ministral-3-14B-Reasoning-2512",
    "unsloth-Apriel-1.5", "meetkai-functionary-medium-v3.1", "tencent-Hy3", "upstage-Solar-Open-100B",
    # Rendered where transformers' sandbox refuses them (app.engine.chat_templates): Kimi K2 Thinking
    # appends to a list to pair results with calls; llama.cpp's DeepSeek R1 writes map(...) | tojson.
    "Kimi-K2-Thinking", "llama-cpp-deepseek-r1", "muse-glimmer",
]


def chat_completions() -> ChatRequest:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
    return ChatCompletionRequest.model_validate({"model": "m", "tools": [tool], "messages": [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGS)}}]},
        {"role": "tool", "tool_call_id": CALL_ID, "content": RESULT},
    ]}).to_request()


def responses() -> ChatRequest:
    tool = {"type": "function", "name": "get_weather", "parameters": SCHEMA}
    return ResponsesRequest.model_validate({"model": "m", "tools": [tool], "input": [
        {"role": "user", "content": QUESTION},
        {"type": "function_call", "call_id": CALL_ID, "name": "get_weather", "arguments": json.dumps(ARGS)},
        {"type": "function_call_output", "call_id": CALL_ID, "output": RESULT},
    ]}).to_request([])


def messages() -> ChatRequest:
    tool = {"name": "get_weather", "input_schema": SCHEMA}
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 16, "tools": [tool], "messages": [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_abc", "name": "get_weather",
                                           "input": ARGS}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_abc", "content": RESULT}]},
    ]}).to_request()


def agui() -> ChatRequest:
    from ag_ui.core import RunAgentInput

    tool = {"name": "get_weather", "description": "Weather", "parameters": SCHEMA}
    inp = RunAgentInput.model_validate({
        "threadId": "t", "runId": "r", "state": None, "context": [], "forwardedProps": {"model": "m"},
        "tools": [tool], "messages": [
            {"id": "1", "role": "user", "content": QUESTION},
            {"id": "2", "role": "assistant", "toolCalls": [{"id": CALL_ID, "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps(ARGS)}}]},
            {"id": "3", "role": "tool", "toolCallId": CALL_ID, "content": RESULT},
        ]})
    return to_chat_request(inp, "m")


def _assistant_header(profile: Any) -> str:
    """What the template writes between a user's question and an answer to it."""
    text = profile.prompts.render([{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "ANSWER"}],
                                  generation_prompt=False)
    return text.split(QUESTION, 1)[1].split("ANSWER", 1)[0]


FORMATS = {"chat": chat_completions, "responses": responses, "messages": messages, "agui": agui}


@pytest.mark.parametrize("template", TEMPLATES)
def test_earlier_calls_render_as_the_model_writes_them(corpus_root: Path, corpus_tokenizer: Any,
                                                       template: str) -> None:
    profile = corpus.profile_for(corpus_tokenizer, corpus.template_text(corpus_root, f"{template}.jinja"), "model")
    header = _assistant_header(profile).strip()
    for name, make in FORMATS.items():
        req = make()
        prompt = build_chat(profile, req).prompt_text
        assert QUESTION in prompt and RESULT in prompt, (name, prompt)
        turn = prompt.split(QUESTION, 1)[1].split(RESULT, 1)[0]
        turn = turn.split(header, 1)[1] if header and header in turn else turn
        parser = make_parser(profile.parser, reasoning=True, tools_offered=True, tools={"get_weather": SCHEMA})
        out = collect([*parser.feed(turn), *parser.finish()])
        assert [(c.name, json.loads(c.arguments_json)) for c in out.tool_calls] == [("get_weather", ARGS)], \
            (name, profile.parser, turn)


def test_kimi_results_carry_the_ids_its_template_gives_the_calls(corpus_root: Path, corpus_tokenizer: Any) -> None:
    profile = corpus.profile_for(corpus_tokenizer, corpus.template_text(corpus_root, "moonshotai-Kimi-K2.jinja"),
                                 "model")
    prompt = build_chat(profile, chat_completions()).prompt_text
    assert "<|tool_call_begin|>functions.get_weather:0" in prompt and "## Return of functions.get_weather:0" in prompt


def test_mistral_gets_ids_it_accepts(corpus_root: Path, corpus_tokenizer: Any) -> None:
    """Mistral's templates refuse ids that are not nine letters or digits; another client's
    ``call_abc123`` is mapped to one, the same for the call and its result."""
    profile = corpus.profile_for(corpus_tokenizer,
                                 corpus.template_text(corpus_root, "mistralai-Mistral-Nemo-Instruct-2407.jinja"), "m")
    for make in FORMATS.values():
        assert RESULT in build_chat(profile, make()).prompt_text


THOUGHT = "R-THOUGHT-7"


def _with_reasoning(fmt: str) -> ChatRequest:
    """The call turn carrying its reasoning, as each format carries it back."""
    args = json.dumps(ARGS)
    if fmt == "chat":
        return ChatCompletionRequest.model_validate({"model": "m", "messages": [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": None, "reasoning_content": THOUGHT, "tool_calls": [
                {"id": CALL_ID, "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
            {"role": "tool", "tool_call_id": CALL_ID, "content": RESULT}]}).to_request()
    if fmt == "responses":
        return ResponsesRequest.model_validate({"model": "m", "input": [
            {"role": "user", "content": QUESTION},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": THOUGHT}]},
            {"type": "function_call", "call_id": CALL_ID, "name": "get_weather", "arguments": args},
            {"type": "function_call_output", "call_id": CALL_ID, "output": RESULT}]}).to_request([])
    # A conversation that thinks says so (Anthropic's default is no thinking; DeepSeek's template
    # then drops earlier thoughts).
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 2048, "messages": [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": THOUGHT, "signature": "x"},
                                          {"type": "tool_use", "id": "toolu_abc", "name": "get_weather",
                                           "input": ARGS}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_abc", "content": RESULT}]},
    ], "thinking": {"type": "enabled", "budget_tokens": 1024}}).to_request()


@pytest.mark.parametrize("template", ["openai-gpt-oss-120b", "Qwen3.5-4B", "MiniMax-M2", "deepseek-ai-DeepSeek-V3.2"])
@pytest.mark.parametrize("fmt", ["chat", "responses", "messages"])
def test_the_reasoning_of_a_call_turn_goes_back_in_the_familys_markers(corpus_root: Path, corpus_tokenizer: Any,
                                                                       template: str, fmt: str) -> None:
    """gpt-oss's earlier thinking goes back on the analysis channel, the others' in <think>."""
    profile = corpus.profile_for(corpus_tokenizer, corpus.template_text(corpus_root, f"{template}.jinja"), "model")
    prompt = build_chat(profile, _with_reasoning(fmt)).prompt_text
    opener, closer = profile.reasoning_markers
    assert THOUGHT in prompt
    before, after = prompt.split(THOUGHT, 1)
    assert before.rstrip().endswith(opener.strip()) and after.lstrip().startswith(closer.strip()), prompt
