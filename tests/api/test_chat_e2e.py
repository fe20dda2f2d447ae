"""End to end: the real demo model over HTTP, with the official openai SDK as the client."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from openai import AsyncOpenAI

Q = [{"role": "user", "content": "What is the capital of France?"}]


def test_answers_paris(client):
    r = client.chat.completions.create(model="demo", messages=Q, max_tokens=16, temperature=0)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_stream_equals_non_stream(client, demo_state):
    kw = dict(model="demo", messages=Q, max_tokens=10, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    ids = {c.id for c in chunks}
    assert len(ids) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == full.usage.completion_tokens
    # Exact usage: the prompt is what the chat template renders, tokenized.
    tok = demo_state.profile.tokenizer
    expected = len(
        tok.encode(tok.apply_chat_template(Q, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    )
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens == expected


def test_stop_string_ends_before_it(client):
    kw = dict(model="demo", messages=Q, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kw).choices[0].message.content
    stop = "Paris" if "Paris" in full else full.split()[2]
    r = client.chat.completions.create(**kw, stop=[stop])
    assert r.choices[0].message.content == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stop=stop, stream=True)
    )
    assert streamed == r.choices[0].message.content


def test_models_and_health(client, demo_server):
    models = client.models.list()
    assert [m.id for m in models.data] == ["demo"]
    assert models.data[0].owned_by == "tandem"
    h = httpx.get(demo_server.base_url + "/health").json()
    assert h["status"] == "ok" and h["model"] == "demo"
    assert h["engine"]["kv_budget_tokens"] > 0
    assert h["vision"]["available"] is False and "missing-vlm" in h["vision"]["reason"]


def test_text_completions(client):
    r = client.completions.create(model="demo", prompt="The capital of France is", max_tokens=4, temperature=0)
    assert r.choices[0].text and r.usage.completion_tokens <= 4
    chunks = list(
        client.completions.create(
            model="demo", prompt="The capital of France is", max_tokens=4, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text


def test_seed_makes_sampling_reproducible(client):
    kw = dict(model="demo", messages=Q, max_tokens=6, temperature=1.0, seed=7)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_max_tokens_beyond_the_context_is_clamped(client):
    """Agents ask for more than a local context holds (Claude Code: 32000); they get what fits."""
    r = client.chat.completions.create(model="demo", messages=Q, max_tokens=10_000_000, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens + r.usage.completion_tokens <= 8192


BAD_BODIES = [
    ("not json", b"{nope", 400),
    ("not utf-8", b'{"model": "demo", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),
    ("no messages", {"model": "demo"}, 400),
    ("empty messages", {"model": "demo", "messages": []}, 400),
    ("unknown role", {"model": "demo", "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("no content", {"model": "demo", "messages": [{"role": "user"}]}, 400),
    ("messages not a list", {"model": "demo", "messages": "hi"}, 400),
    ("temperature too high", {"model": "demo", "messages": Q, "temperature": 9}, 400),
    ("top_p zero", {"model": "demo", "messages": Q, "top_p": 0}, 400),
    ("negative max_tokens", {"model": "demo", "messages": Q, "max_tokens": -1}, 400),
    ("unknown model", {"model": "gpt-9", "messages": Q}, 404),
    ("tool message without id", {"model": "demo", "messages": [{"role": "tool", "content": "x"}]}, 400),
    ("bad image part", {"model": "demo", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]}]}, 400),
    ("bad part type", {"model": "demo", "messages": [{"role": "user", "content": [{"type": "audio", "x": 1}]}]}, 400),
    ("wrong method", None, 405),
]


@pytest.mark.parametrize("name, body, status", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_bodies_get_openai_errors(demo_server, client, name, body, status):
    url = demo_server.base_url + "/v1/chat/completions"
    if body is None:
        r = httpx.get(url)
    elif isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(url, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    # The server keeps serving.
    assert httpx.get(demo_server.base_url + "/health").json()["status"] == "ok"


def test_context_length_is_refused_before_prefill(demo_server):
    long = "word " * 3000
    r = httpx.post(demo_server.base_url + "/v1/chat/completions",
                   json={"model": "demo", "messages": [{"role": "user", "content": long}]})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_disconnect_mid_stream_then_serving(demo_server, demo_state, client):
    with httpx.stream("POST", demo_server.base_url + "/v1/chat/completions",
                      json={"model": "demo", "messages": Q, "max_tokens": 200, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data:") and '"content":"' in line and '"content":""' not in line:
                break
    # The sequence is cancelled and its KV freed.
    import time

    deadline = time.monotonic() + 20
    while demo_state.engine.admission.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert demo_state.engine.admission.running == 0
    r = client.chat.completions.create(model="demo", messages=Q, max_tokens=4, temperature=0)
    assert r.choices[0].message.content


def test_eight_concurrent_streams_complete(demo_server):
    async def one(c: AsyncOpenAI, i: int) -> tuple[str, str]:
        stream = await c.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": f"Say the number {i}."}],
            max_tokens=5, temperature=0, stream=True)
        text, finish = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main():
        async with AsyncOpenAI(base_url=demo_server.base_url + "/v1", api_key="x", max_retries=0, timeout=300) as c:
            return await asyncio.gather(*(one(c, i) for i in range(8)))

    results = asyncio.run(main())
    assert len(results) == 8 and all(f in ("stop", "length") for _, f in results)


def test_cached_tokens_reported_for_a_shared_system_prompt(client, demo_state):
    system = {"role": "system", "content": "You are a concise geography tutor. Answer in one short sentence."}
    kw = dict(model="demo", max_tokens=2, temperature=0)
    client.chat.completions.create(messages=[system, {"role": "user", "content": "Capital of Italy?"}], **kw)
    r = client.chat.completions.create(messages=[system, {"role": "user", "content": "Capital of Spain?"}], **kw)
    tok = demo_state.profile.tokenizer
    head = tok.apply_chat_template([system], tokenize=False, add_generation_prompt=False)
    assert r.usage.prompt_tokens_details.cached_tokens >= len(tok.encode(head, add_special_tokens=False))
    assert r.usage.prompt_tokens_details.cached_tokens < r.usage.prompt_tokens


def test_non_streaming_client_that_gives_up_stops_generation(demo_server, demo_state, client):
    import time

    with pytest.raises(httpx.TimeoutException):
        httpx.post(demo_server.base_url + "/v1/chat/completions", timeout=2.0,
                   json={"model": "demo", "max_tokens": 400, "temperature": 0,
                         "messages": [{"role": "user", "content": "Count from 1 to 500, separated by commas."}]})
    deadline = time.monotonic() + 15  # 400 tokens would take the demo model ~50 s
    while demo_state.engine.admission.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert demo_state.engine.admission.running == 0 and demo_state.engine.admission.reserved == 0
    assert client.chat.completions.create(
        model="demo", messages=Q, max_tokens=2, temperature=0
    ).choices[0].message.content
