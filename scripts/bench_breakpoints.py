#!/usr/bin/env python
"""Cache breakpoints under memory pressure: an agent's marked system prompt outlives traffic.

    .venv/bin/python scripts/bench.py --only breakpoints      # a server on the demo model

Against a running Tandem (``scripts/bench.py`` starts one with a prefix cache a little
larger than one such prompt's KV): an agent's request on /v1/messages with a ~3,000-token
system prompt marked with ``cache_control`` (seeded pseudo-sentences, counted with the
model's tokenizer), then unrelated requests, each with a system prompt of its own, until
their prefixes add up to twice the prefix cache's memory budget, then the agent's next
request (the same system prompt, another question). Its time to first token against the
first request's (which computed the system prompt) is the ratio; the same again with the
marks left out is the control, where the traffic evicts the prompt.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
from bench_decisions import input_text


def first_token(base: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Seconds to the first streamed text, and the request's usage."""
    start, ttft, usage = time.perf_counter(), None, {}
    with httpx.stream("POST", base + "/v1/messages", json={**body, "stream": True}, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "content_block_delta" and ttft is None:
                ttft = time.perf_counter() - start
            if event["type"] == "message_start":
                usage.update(event["message"]["usage"])
            if event["type"] == "message_delta":
                usage.update(event.get("usage", {}))
    return (ttft if ttft is not None else time.perf_counter() - start), usage


def agent(model: str, system: str, question: str, marked: bool) -> dict[str, Any]:
    block: dict[str, Any] = {"type": "text", "text": system}
    if marked:
        block["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
    return {"model": model, "max_tokens": 2, "system": [block], "messages": [{"role": "user", "content": question}]}


def traffic(base: str, model: str, tokens: int, count: Any, each: int = 1500) -> int:
    """Unrelated requests, each its own ~``each``-token system prompt, ``tokens`` in all."""
    sent, i = 0, 0
    while sent < tokens:
        text = input_text(each, count, seed=1000 + i)
        r = httpx.post(base + "/v1/messages", timeout=3600, json={
            "model": model, "max_tokens": 2, "system": text, "messages": [{"role": "user", "content": f"Q{i}?"}]})
        r.raise_for_status()
        sent += r.json()["usage"]["input_tokens"] + r.json()["usage"].get("cache_read_input_tokens", 0)
        i += 1
    return i


def bench_breakpoints(base: str, model: str, model_path: str, system_tokens: int = 3000,
                      control: bool = True) -> list[str]:
    """The ratio lines for scripts/bench.py (``control=False`` leaves out the unmarked run:
    on a 2-core CPU each run prefills some 10,000 tokens)."""
    from pathlib import Path

    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(Path(model_path))
    count = lambda s: len(tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    engine = httpx.get(base + "/health", timeout=60).json()["engine"]
    cache_bytes = engine["prompt_cache_tiers"]["memory"]["budget_bytes"]
    per_token = sum(k["bytes_per_token"] for k in engine["kv_layers"].values() if "window" not in k)
    fill = 2 * cache_bytes // per_token
    lines = []
    for marked in (True, False) if control else (True,):
        system = input_text(system_tokens, count, seed=7 if marked else 8)
        cold, written = first_token(base, agent(model, system, "What is the first word?", marked))
        requests = traffic(base, model, fill, count)
        warm, read = first_token(base, agent(model, system, "And the last word?", marked))
        name = "cache_control" if marked else "unmarked (control)"
        print(f"breakpoints, {name}: first {cold:.1f}s {written}; {requests} requests of traffic "
              f"({fill} tokens); next {warm:.2f}s {read}")
        target = "   (target <= 0.2)" if marked else "   (control: evicted, about 1)"
        lines.append(f"agent's next request after traffic filling the prefix cache twice, {name}: TTFT "
                     f"{warm:.2f}s / {cold:.1f}s = {warm / cold:.3f}{target}; "
                     f"{read.get('cache_read_input_tokens', 0)} tokens read")
    return lines
