"""Thinking budgets end to end (issue 20's acceptance): a scripted tiny Ministral 3 Reasoning
that would think for 500 tokens, served with ``reasoning_budgets: {low: 64}``.

Each format's way of asking for less thinking sets the row's budget: chat's
``reasoning_effort``, Responses' ``reasoning.effort`` (and OpenRouter's
``reasoning.max_tokens``), Anthropic's ``thinking.budget_tokens`` and
``output_config.effort``. At 64 tokens of reasoning the engine writes ``[/THINK]``,
the model's own closer, and the answer follows; usage reports the 64 tokens spent.
Before budgets, every effort only switched thinking on, and the model thought until
max_tokens ran out with no answer.
"""

from __future__ import annotations

import anthropic
import pytest
from openai import OpenAI

from tests.api.serving import serving
from tests.api.test_ministral_e2e import fold, models_yaml, reasoning_of
from tests.fixtures.tiny_ministral import distinct_words

ANSWER = "It is sunny"
THOUGHT_TOKENS = 500
BUDGET = 64
USER = [{"role": "user", "content": "Weather in Paris?"}]
# [THINK], 64 words, [/THINK], the answer's 3 tokens and </s>: room to spare, far short of 500.
MAX_TOKENS = 100


@pytest.fixture(scope="module")
def words(demo_model_dir):
    return distinct_words(demo_model_dir, THOUGHT_TOKENS, skip=("sunny",))


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_ministral, words):
    model = tiny_ministral(f"[THINK]{''.join(words)}[/THINK]{ANSWER}")
    text = models_yaml(model, reasoning_budgets={"low": BUDGET})
    with serving(tmp_path_factory.mktemp("budgets"), text) as s:
        yield s


@pytest.fixture(scope="module")
def client(served):
    with OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def thought(words, n=BUDGET):
    return "".join(words[:n]).strip()


def test_chat_reasoning_effort_low_stops_at_its_budget(client, words):
    r = client.chat.completions.create(model="ministral", messages=USER, reasoning_effort="low",
                                       max_tokens=MAX_TOKENS)
    msg = r.choices[0].message
    assert reasoning_of(msg)["reasoning_content"].strip() == thought(words)
    assert (msg.content, r.choices[0].finish_reason) == (ANSWER, "stop")
    assert r.usage.completion_tokens_details.reasoning_tokens == BUDGET
    assert r.usage.completion_tokens == 1 + BUDGET + 1 + 3 + 1


def test_chat_stream_the_same(client, words):
    chunks = list(client.chat.completions.create(model="ministral", messages=USER, reasoning_effort="low",
                                                 max_tokens=MAX_TOKENS, stream=True,
                                                 stream_options={"include_usage": True}))
    content, reasoning, _, finish = fold(chunks)
    assert (content, finish) == (ANSWER, "stop")
    assert reasoning["reasoning_content"].strip() == thought(words)
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == BUDGET


def test_without_an_effort_it_thinks_on(client, words):
    r = client.chat.completions.create(model="ministral", messages=USER, max_tokens=80)
    msg = r.choices[0].message
    assert (msg.content or "", r.choices[0].finish_reason) == ("", "length")
    assert reasoning_of(msg)["reasoning_content"].strip() == thought(words, 79)
    assert r.usage.completion_tokens_details.reasoning_tokens == 79


def test_messages_thinking_budget_tokens(served, words):
    with anthropic.Anthropic(base_url=served.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        m = c.messages.create(model="ministral", max_tokens=MAX_TOKENS, messages=USER,
                              thinking={"type": "enabled", "budget_tokens": BUDGET})
        assert [b.type for b in m.content] == ["thinking", "text"]
        assert m.content[0].thinking.strip() == thought(words) and m.content[1].text == ANSWER
        assert m.stop_reason == "end_turn" and m.usage.output_tokens == 1 + BUDGET + 1 + 3 + 1
        # output_config.effort names a level of the same table.
        m = c.messages.create(model="ministral", max_tokens=MAX_TOKENS, messages=USER,
                              thinking={"type": "adaptive"}, extra_body={"output_config": {"effort": "low"}})
        assert m.content[0].thinking.strip() == thought(words) and m.content[-1].text == ANSWER


def test_responses_reasoning_effort(client, words):
    r = client.responses.create(model="ministral", input="Weather in Paris?", reasoning={"effort": "low"},
                                max_output_tokens=MAX_TOKENS)
    assert r.status == "completed" and r.output_text == ANSWER
    reasoning = next(item for item in r.output if item.type == "reasoning")
    assert "".join(part.text for part in reasoning.content).strip() == thought(words)
    assert r.usage.output_tokens_details.reasoning_tokens == BUDGET
    # OpenRouter's explicit budget wins over the level's.
    r = client.responses.create(model="ministral", input="Weather in Paris?", max_output_tokens=MAX_TOKENS,
                                extra_body={"reasoning": {"effort": "low", "max_tokens": 10}})
    assert r.output_text == ANSWER and r.usage.output_tokens_details.reasoning_tokens == 10
