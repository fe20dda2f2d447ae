"""logprobs / top_logprobs and n > 1, on chat and completions, streamed and not (demo model)."""

from __future__ import annotations

import httpx
import pytest

Q = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_logprobs_shape_and_greedy_choice(client):
    r = client.chat.completions.create(model="demo", messages=Q, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    text = r.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3 and bytes(entry.bytes).decode() == entry.token
        # Greedy: the chosen token is the most likely one of the distribution.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    assert "".join(e.token for e in content).strip() in text or text in "".join(e.token for e in content)


def test_streamed_logprobs_equal_the_non_streamed_ones(client):
    kw = dict(model="demo", messages=Q, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [e for c in client.chat.completions.create(**kw, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in whole]


def test_no_logprobs_unless_asked(client):
    r = client.chat.completions.create(model="demo", messages=Q, max_tokens=2, temperature=0)
    assert r.choices[0].logprobs is None


def test_top_logprobs_needs_logprobs(demo_server):
    r = httpx.post(demo_server.base_url + "/v1/chat/completions",
                   json={"model": "demo", "messages": Q, "top_logprobs": 2})
    assert r.status_code == 400 and "logprobs" in r.json()["error"]["message"]


def test_completion_logprobs_in_the_legacy_shape(client):
    r = client.completions.create(model="demo", prompt="The capital of France is", max_tokens=3, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 3
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(len(top) == 2 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset)


def test_n_choices_share_the_prompt_and_sum_their_usage(client, demo_state):
    before = demo_state.engine.stats().prompt_cache_hits
    long_q = [{"role": "user", "content": "Tell me a short story about a fox who lives in the forest."}]
    one = client.chat.completions.create(model="demo", messages=long_q, max_tokens=4, temperature=0)
    three = client.chat.completions.create(model="demo", messages=long_q, max_tokens=4, temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    # Greedy: every choice is the one answer.
    assert {c.message.content for c in three.choices} == {one.choices[0].message.content}
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert demo_state.engine.stats().prompt_cache_hits >= before + 2  # the prompt computed once for the three


def test_n_choices_streamed_with_a_seed(client):
    chunks = list(client.chat.completions.create(model="demo", messages=Q, max_tokens=6, temperature=1.0, seed=7,
                                                 n=3, stream=True, stream_options={"include_usage": True}))
    texts = {i: "" for i in range(3)}
    finishes = {i: [] for i in range(3)}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index].append(ch.finish_reason)
    assert all(len(f) == 1 for f in finishes.values())
    assert len(set(texts.values())) > 1  # one seed, a different draw per choice
    assert chunks[-1].usage.completion_tokens == sum(1 for c in chunks for ch in c.choices if ch.delta.content) or \
        chunks[-1].usage.completion_tokens >= 3


def test_n_on_completions(client):
    r = client.completions.create(model="demo", prompt="Paris is", max_tokens=3, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text == r.choices[1].text
    assert r.usage.completion_tokens == 6
