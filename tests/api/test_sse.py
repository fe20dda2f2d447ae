"""The SSE wire: text/event-stream, no empty chunks (Open WebUI renders them as blank
turns), exactly one finish, [DONE] last; the same for text completions and AG-UI."""

from __future__ import annotations

import json

import httpx

Q = [{"role": "user", "content": "What is the capital of France?"}]


def events(base: str, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", base + path, json=body, timeout=120) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-request-id"]
        # Comment lines are keep-alives (server.sse_keepalive_s) on a busy machine.
        lines = [line for line in r.iter_lines() if line != ": keep-alive"]
    data = [line.removeprefix("data: ") for line in lines if line]
    assert len(data) == sum(1 for line in lines if line.startswith("data: ")), lines  # nothing but data lines
    return data


def test_chat_stream_has_no_empty_chunks(demo_server):
    data = events(demo_server.base_url, "/v1/chat/completions", {
        "model": "demo", "messages": Q, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}})
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}  # OpenAI's opening chunk
    for c in chunks[1:]:
        if not c["choices"]:
            assert c["usage"]["completion_tokens"] > 0
            continue
        delta, finish = c["choices"][0]["delta"], c["choices"][0]["finish_reason"]
        assert finish or any(v for v in delta.values()), c  # every chunk carries something
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finishes) == 1


def test_completion_stream_has_no_empty_chunks(demo_server):
    data = events(demo_server.base_url, "/v1/completions",
                  {"model": "demo", "prompt": "The capital of France is", "max_tokens": 6, "stream": True})
    assert data[-1] == "[DONE]"
    for c in map(json.loads, data[:-1]):
        assert c["choices"][0]["text"] or c["choices"][0]["finish_reason"], c


def test_agui_stream_has_no_empty_deltas(demo_server):
    data = events(demo_server.base_url, "/v1/agui", {
        "threadId": "t", "runId": "r", "state": {}, "tools": [], "context": [], "forwardedProps": {"max_tokens": 6},
        "messages": [{"id": "1", "role": "user", "content": Q[0]["content"]}]})
    kinds = [json.loads(d) for d in data]
    assert kinds[0]["type"] == "RUN_STARTED" and kinds[-1]["type"] == "RUN_FINISHED"
    assert all(e["delta"] for e in kinds if "delta" in e)
