"""Every format's way of saying how much to think, read into one typed request, and the
budget the pipeline gives it (``pipeline.thinking_budget``): no model needed.

Before budgets, each of these was a thinking switch at most: ``reasoning.max_tokens`` and
``forwardedProps.reasoning_effort`` were dropped, and no effort reached the pipeline."""

from __future__ import annotations

from dataclasses import replace

import pytest
from ag_ui.core import RunAgentInput

from app.api.agui import to_chat_request
from app.api.anthropic.protocol import MessagesRequest
from app.api.openai.protocol import ChatCompletionRequest
from app.api.openai.responses_protocol import ResponsesRequest
from app.config.schema import ChatParams, ModelCapabilities
from app.pipeline.pipeline import thinking_budget
from app.pipeline.prompting import make_profile

USER = [{"role": "user", "content": "Hi"}]


def chat(**body):
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **body}).to_request()


def responses(**body):
    return ResponsesRequest.model_validate({"model": "m", "input": "Hi", **body}).to_request([])


def messages(**body):
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": USER, **body}).to_request()


def agui(**props):
    run = RunAgentInput.model_validate({
        "threadId": "t", "runId": "r", "state": {}, "tools": [], "context": [], "forwardedProps": props,
        "messages": [{"id": "1", "role": "user", "content": "Hi"}]})
    return to_chat_request(run, "m")


@pytest.mark.parametrize("req, effort, budget", [
    (chat(reasoning_effort="low"), "low", None),
    (chat(reasoning_effort="xhigh"), "xhigh", None),
    (chat(), None, None),
    (responses(reasoning={"effort": "medium"}), "medium", None),
    (responses(reasoning={"effort": "low", "max_tokens": 300}), "low", 300),
    (messages(thinking={"type": "enabled", "budget_tokens": 2048}), None, 2048),
    (messages(thinking={"type": "adaptive"}, output_config={"effort": "high"}), "high", None),
    # A budget only counts when thinking is enabled: disabled thinking has none to bound.
    (messages(thinking={"type": "disabled", "budget_tokens": 2048}), None, None),
    (agui(reasoning_effort="minimal"), "minimal", None),
    (agui(thinking_budget=99), None, 99),
])
def test_each_format_says_how_much_to_think(req, effort, budget):
    assert (req.reasoning_effort, req.reasoning_budget) == (effort, budget)


@pytest.fixture(scope="module")
def profile(demo_model_dir):
    from mlx_lm.utils import load_tokenizer

    caps = ModelCapabilities(reasoning_budgets={"low": 64, "high": 50_000})
    return make_profile("demo", load_tokenizer(demo_model_dir), ChatParams(), 8192, caps)


@pytest.mark.parametrize("effort, budget, expected", [
    ("low", None, 64),          # the model's own table
    ("minimal", None, 256),     # a level it left at its default
    ("high", None, 8192),       # clamped to the context
    ("xhigh", None, 8192),      # past the table's top: high
    ("max", None, 8192),        # Anthropic's top level: high
    ("low", 10, 10),            # an explicit budget wins
    (None, 100_000, 8192),
    ("none", None, None),       # thinking off is a switch, not a budget
    ("turbo", None, None),      # a level no table knows
    (None, None, None),
])
def test_the_budget_a_request_gets(profile, effort, budget, expected):
    req = replace(chat(), reasoning_effort=effort, reasoning_budget=budget)
    assert thinking_budget(profile, req) == expected
