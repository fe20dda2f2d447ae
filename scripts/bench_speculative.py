"""Speculative decoding, measured side by side in one server (``scripts/bench.py --only speculative``).

Three workloads, each answered with speculation and without it, alternated, at 1 and at 4
streams (issue 21):

  a. code edit: a source file in the prompt, asked to rename one identifier and answer with
     the whole file (prompt lookup proposes from the file);
  b. the same, with the renamed file sent as OpenAI's ``prediction``;
  c. free chat: a story, where nothing repeats (the adaptive rule must keep it at plain speed).

"Plain" is the same request with every drafter switched off for it (the ``speculative``
request extension); both run on one server, one after the other, so they share the machine,
the weights and the prefix cache (each prompt is prefilled once, before the timed runs, so
TTFT compares the cached prompt either way). Decode tokens/s per stream is the completion's
tokens after the first over the time from the first token to the last (usage, not chunks:
an accepted run may arrive as one chunk). Acceptance is the accepted share of the proposed
tokens, from /metrics, per drafter.
"""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import time
from typing import Any

import httpx

# Switches every drafter off for one request (Tandem's request extension; see docs/guides/speculative.md).
PLAIN = {"speculative": {"prompt_lookup": False, "draft": False}}

IDENT, RENAMED = "total_count", "item_total"


def source_file(tokens: int) -> str:
    """A plausible Python module of about ``tokens`` tokens that uses ``IDENT`` throughout."""
    blocks = []
    i = 0
    while len(" ".join(blocks).split()) * 2.3 < tokens:  # ~2.3 tokens per word of code here
        blocks.append(
            f"def update_{i}(records, {IDENT}):\n"
            f"    \"\"\"Add the weight of every record of kind {i} to {IDENT}.\"\"\"\n"
            f"    for record in records:\n"
            f"        if record.kind == {i}:\n"
            f"            {IDENT} += record.weight * {i + 1}\n"
            f"    return {IDENT}\n"
        )
        i += 1
    return "\n\n".join(blocks)


def edit_messages(source: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You edit code. Answer with the whole file and nothing else."},
        {"role": "user", "content": f"Rename `{IDENT}` to `{RENAMED}` in this file:\n\n{source}"},
    ]


async def one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, float]:
    """One streamed completion: TTFT, per-stream decode tokens/s, and its usage."""
    t0 = time.perf_counter()
    first = last = None
    usage: dict[str, Any] = {}
    async with client.stream("POST", url, json={**body, "stream": True,
                                                "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices", []):
                delta = c.get("delta") or {}
                if delta.get("content") or delta.get("reasoning_content"):
                    last = time.perf_counter()
                    first = first or last
    tokens = usage.get("completion_tokens", 0)
    details = usage.get("completion_tokens_details") or {}
    span = (last or t0) - (first or t0)
    return {"ttft": (first or t0) - t0, "tokens": tokens, "decode_tok_s": (tokens - 1) / span if span > 0 else 0.0,
            "accepted": details.get("accepted_prediction_tokens", 0),
            "rejected": details.get("rejected_prediction_tokens", 0)}


async def streams(base: str, body: dict[str, Any], n: int) -> dict[str, float]:
    """``n`` copies of ``body`` at once: the per-stream medians."""
    async with httpx.AsyncClient(timeout=3600) as client:
        runs = await asyncio.gather(*(one(client, base + "/v1/chat/completions", body) for _ in range(n)))
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def counters(base: str) -> dict[str, float]:
    """The speculative counters of /metrics, by (name, drafter)."""
    out: dict[str, float] = {}
    for line in httpx.get(base + "/metrics", timeout=30).text.splitlines():
        m = re.match(r'tandem_speculative_(\w+)_tokens_total\{[^}]*drafter="(\w+)"[^}]*\} ([0-9.e+]+)', line)
        if m:
            key = f"{m[1]}:{m[2]}"
            out[key] = out.get(key, 0.0) + float(m[3])
    return out


def acceptance(before: dict[str, float], after: dict[str, float], drafter: str) -> float | None:
    proposed = after.get(f"proposed:{drafter}", 0) - before.get(f"proposed:{drafter}", 0)
    accepted = after.get(f"accepted:{drafter}", 0) - before.get(f"accepted:{drafter}", 0)
    return accepted / proposed if proposed else None


def bench_speculative(base: str, model: str, prof: dict[str, Any], rounds: int = 2) -> list[str]:
    """The three workloads at 1 and 4 streams, speculative against plain; the lines of ratios."""
    source = source_file(prof["spec_file_tokens"])
    renamed = source.replace(IDENT, RENAMED)
    answer = prof["spec_answer_tokens"]
    edit = {"model": model, "messages": edit_messages(source), "max_tokens": answer, "temperature": 0}
    workloads = {
        "a. code edit": (edit, {}, "prompt_lookup"),
        "b. code edit + prediction": (edit, {"prediction": {"type": "content", "content": renamed}}, "prediction"),
        "c. free chat": ({"model": model, "max_tokens": prof["spec_chat_tokens"], "temperature": 0.7, "seed": 7,
                          "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse."}]},
                         {}, "prompt_lookup"),
    }
    # Each prompt prefilled once, so every timed run finds it cached.
    for body, _, _ in workloads.values():
        asyncio.run(streams(base, {**body, **PLAIN, "max_tokens": 1}, 1))
    lines = []
    for label, (body, extra, drafter) in workloads.items():
        for n in (1, 4):
            spec_runs, plain_runs = [], []
            before = counters(base)
            for _ in range(rounds):  # alternated: a busy machine drifts between runs
                plain_runs.append(asyncio.run(streams(base, {**body, **PLAIN}, n)))
                spec_runs.append(asyncio.run(streams(base, {**body, **extra}, n)))
            rate = acceptance(before, counters(base), drafter)
            s = statistics.median(r["decode_tok_s"] for r in spec_runs)
            p = statistics.median(r["decode_tok_s"] for r in plain_runs)
            ts = statistics.median(r["ttft"] for r in spec_runs)
            tp = statistics.median(r["ttft"] for r in plain_runs)
            accepted = statistics.median(r["accepted"] for r in spec_runs)
            print(f"{label}, {n} stream(s): speculative {s:.2f} tok/s, plain {p:.2f} tok/s; "
                  f"TTFT {ts:.2f}s / {tp:.2f}s; acceptance ({drafter}) {rate}; accepted_prediction_tokens {accepted}")
            target = {"a": ("1.6" if n == 1 else "1.3"), "b": ("2.0" if n == 1 else "1.3"), "c": "0.97"}[label[0]]
            lines.append(
                f"speculative / plain decode tok/s, {label}, {n} stream(s): {s:.2f} / {p:.2f} = {s / p:.3f}   "
                f"(GPU target >= {target}; CPU: c >= 0.95); acceptance "
                f"{'n/a' if rate is None else f'{rate:.2f}'}; TTFT {ts / tp:.2f}x")
    return lines
