"""A forced tool comes back as calls (issue 30, item 11).

The demo model, told to call a named tool with parallel calls allowed, repeated the
call: the grammar let the list of calls grow until max_tokens, and the answer
came back as one text block holding a cut JSON array. Now a named choice is one
call unless parallel calls are asked for in so many words, ``required`` is at most
``MAX_PARALLEL_CALLS``, and a list max_tokens cuts keeps its complete calls.

Greedy decoding makes the demo model write one call object anyway, so what the
grammar lets through is checked on the request each wire format makes, through
the pipeline's own constraint and llguidance, then the answers over HTTP.
"""

from __future__ import annotations

import json

import anthropic
import pytest

from app.api.anthropic.protocol import MessagesRequest
from app.api.openai.protocol import ChatCompletionRequest
from app.config.schema import ChatParams, ModelCapabilities
from app.engine.constrain.constraints import MAX_PARALLEL_CALLS
from app.parsers import collect, make_parser
from app.pipeline.constraining import compile_constraint, constraint_spec
from app.pipeline.prompting import make_profile, offered_tools

CALCULATE = {"name": "calculate", "description": "Evaluate an arithmetic expression",
             "input_schema": {"type": "object", "properties": {"expression": {"type": "string", "maxLength": 8}},
                              "required": ["expression"], "additionalProperties": False}}
ASK = [{"role": "user", "content": "What is 2+2? Use the calculator."}]


@pytest.fixture(scope="module")
def profile(demo_model_dir):
    from mlx_lm.utils import load_tokenizer

    return make_profile("demo", load_tokenizer(demo_model_dir), ChatParams(), 2048, ModelCapabilities())


def _lets_through(profile, req, text: str) -> bool:
    """Whether the request's forced-call grammar accepts ``text`` token by token."""
    import mlx.core as mx
    import numpy as np

    grammar = compile_constraint(profile, constraint_spec(profile, req, offered_tools(req.tools, req.tool_choice)),
                                 None)
    assert grammar is not None
    proc, ids = grammar.processor(prompt_len=1), profile.tokenizer.encode(text, add_special_tokens=False)
    width = len(profile.tokenizer._tokenizer)
    for n, token in enumerate(ids):
        bias = np.array(proc(mx.array([0, *ids[:n]]), mx.zeros((1, width)))[0])
        if bias[token] == -np.inf:
            return False
    return True


ONE = '{"name": "calculate", "arguments": {"expression": "2+2"}}'
TWO = f'[{ONE}, {ONE}]'


def test_a_named_tool_lets_one_call_through_unless_parallel_calls_are_asked_for(profile) -> None:
    messages = MessagesRequest.model_validate({"model": "demo", "max_tokens": 60, "messages": ASK,
                                               "tools": [CALCULATE],
                                               "tool_choice": {"type": "tool", "name": "calculate"}}).to_request()
    assert _lets_through(profile, messages, ONE) and not _lets_through(profile, messages, TWO)
    tool = {"type": "function", "function": {"name": "calculate", "parameters": CALCULATE["input_schema"]}}
    body = {"model": "demo", "messages": ASK, "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "calculate"}}}
    chat = ChatCompletionRequest.model_validate(body).to_request()
    assert not _lets_through(profile, chat, TWO)
    asked = ChatCompletionRequest.model_validate({**body, "parallel_tool_calls": True}).to_request()
    assert _lets_through(profile, asked, TWO)


def test_required_calls_stop_at_the_cap(profile) -> None:
    tool = {"type": "function", "function": {"name": "calculate", "parameters": CALCULATE["input_schema"]}}
    req = ChatCompletionRequest.model_validate({"model": "demo", "messages": ASK, "tools": [tool],
                                                "tool_choice": "required"}).to_request()
    most = "[" + ", ".join([ONE] * MAX_PARALLEL_CALLS) + "]"
    over = "[" + ", ".join([ONE] * (MAX_PARALLEL_CALLS + 1)) + "]"
    assert _lets_through(profile, req, most) and not _lets_through(profile, req, over)


@pytest.fixture()
def claude(demo_server):
    with anthropic.Anthropic(base_url=demo_server.base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def test_a_named_tool_on_messages_is_one_tool_use(claude) -> None:
    r = claude.messages.create(model="demo", max_tokens=60, messages=ASK, tools=[CALCULATE],
                               tool_choice={"type": "tool", "name": "calculate"})
    assert [b.type for b in r.content] == ["tool_use"], r.content
    assert r.content[0].name == "calculate" and set(r.content[0].input) == {"expression"}
    assert r.stop_reason == "tool_use"


def test_a_named_function_on_chat_completions_is_one_call(client) -> None:
    tool = {"type": "function", "function": {"name": CALCULATE["name"], "parameters": CALCULATE["input_schema"]}}
    r = client.chat.completions.create(model="demo", max_tokens=60, messages=ASK, tools=[tool],
                                       tool_choice={"type": "function", "function": {"name": "calculate"}})
    calls = r.choices[0].message.tool_calls
    assert calls is not None and len(calls) == 1 and calls[0].function.name == "calculate"
    assert r.choices[0].finish_reason == "tool_calls"


def test_required_calls_are_bounded_and_a_cut_list_keeps_its_complete_calls(claude) -> None:
    """``any`` may write several calls: at most the cap, and when max_tokens cuts the list the
    complete ones are tool_use blocks, the stop says max_tokens."""
    r = claude.messages.create(model="demo", max_tokens=40, messages=ASK, tools=[CALCULATE],
                               tool_choice={"type": "any"})
    uses = [b for b in r.content if b.type == "tool_use"]
    assert 1 <= len(uses) <= MAX_PARALLEL_CALLS
    assert r.stop_reason in ("tool_use", "max_tokens")
    if r.stop_reason == "max_tokens":
        assert all(b.name == "calculate" for b in uses)


def test_a_cut_list_of_bare_calls_parses_to_its_complete_calls() -> None:
    """The parser's side: each call of a bare JSON list goes out when its object closes; the
    cut one is an error, not the whole list turned into text."""
    text = '[{"name": "calculate", "arguments": {"expression": "2+2"}}, {"name": "calculate", "arguments": {"exp'
    parser = make_parser("generic", reasoning=False, tools_offered=True)
    out = collect([*parser.feed(text), *parser.finish()])
    assert [(c.name, json.loads(c.arguments_json)) for c in out.tool_calls] == [("calculate", {"expression": "2+2"})]
    assert out.errors == ["tool call list cut off after 1 complete call(s)"]
    assert out.content == '{"name": "calculate", "arguments": {"exp'
