"""Claude Code's real requests, recorded: a second run, and a retry, read what the first left.

``tests/fixtures/claude_code/run1.json`` and ``run2.json`` are the first /v1/messages
request of two ``claude -p`` runs (Claude Code 2.1.197) one after the other in the same
project, recorded by a loopback server (their ``metadata`` ids zeroed): the same system
prompt and tools, another question. Claude Code puts a billing header with a hash that
changes on every request at the head of the system prompt; Tandem leaves it out
(``app.api.anthropic.protocol.BILLING_HEADER``), so the two prompts share their whole
system prompt and tools. Served by a tiny model with a 32k context (the demo model's
tokenizer and template) and a KV budget that one such prompt nearly fills, as the demo
model's is: making room for run 2 must not evict the prefix run 2 is about to read.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.api.serving import serving
from tests.conftest import REPO

FIXTURES = REPO / "tests" / "fixtures" / "claude_code"


def recorded(name: str) -> dict:
    body = json.loads((FIXTURES / f"{name}.json").read_text())
    return {**body, "model": "tiny", "max_tokens": 2, "stream": False}


@pytest.fixture(scope="module")
def long_context_llama(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Path:
    from tests.fixtures.tiny_llama import TINY_LLAMA, build_tiny_llama

    # 2 KB of KV a token (2 layers x 4 KV heads x 32 x K and V x float32): one ~4,000-token prompt
    # is 8 MB, and its row 9 MB, in a 16 MB budget.
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-32k"), demo_model_dir,
                            {**TINY_LLAMA, "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
                             "max_position_embeddings": 32768})


def models_yaml(model: Path, **params) -> str:
    # The cache may hold all of `mem`: one prompt's entry and the next request's row do not both fit.
    base = {"mem": 16, "prompt_cache_mem": 16, "max_model_len": 32768, "temperature": 0.0, "cache_min_tokens": 16,
            "prompt_cache_disk_mb": 0}
    return yaml.safe_dump({"server": {"shutdown_grace_s": 1},
                           "models": [{"name": "tiny", "local_path": str(model), "params": {**base, **params}}]})


def test_the_billing_header_is_not_the_models_text():
    from app.api.anthropic.protocol import BILLING_HEADER, MessagesRequest

    body = recorded("run1")
    assert body["system"][0]["text"].startswith(BILLING_HEADER)
    req = MessagesRequest.model_validate(body).to_request()
    system = "".join(p.text for m in req.messages if m.role == "system" for p in m.content)
    assert BILLING_HEADER not in system and body["system"][2]["text"][:200] in system


def test_claude_codes_second_run_reads_the_system_prompt_and_tools_from_the_cache(tmp_path, long_context_llama):
    run1, run2 = recorded("run1"), recorded("run2")
    with serving(tmp_path, models_yaml(long_context_llama)) as srv:
        first = httpx.post(srv.base_url + "/v1/messages", json=run1, timeout=300).json()
        second = httpx.post(srv.base_url + "/v1/messages", json=run2, timeout=300).json()
        shared = _shared(srv.base_url, run1, run2)
    assert total(first["usage"]) > 3000, first["usage"]
    # Everything run 2 shares with run 1 (the system prompt and the tools; the question and what
    # follows it differ) comes from the cache.
    assert shared > 1500 and second["usage"]["cache_read_input_tokens"] >= shared - 1, (second["usage"], shared)


def total(usage: dict) -> int:
    """A request's prompt tokens: Anthropic splits them into read, written and the rest."""
    return usage["input_tokens"] + usage["cache_creation_input_tokens"] + usage["cache_read_input_tokens"]


def other_traffic(base: str, n: int, words: int) -> None:
    """``n`` unrelated requests, each its own long system prompt: what fills the cache."""
    for i in range(n):
        r = httpx.post(base + "/v1/messages", timeout=300, json={
            "model": "tiny", "max_tokens": 2, "system": f"Document {i}: " + f"w{i} " * words,
            "messages": [{"role": "user", "content": f"Question {i}?"}]})
        assert r.status_code == 200, r.text


def unmarked(body: dict) -> dict:
    """``body`` without its cache_control marks."""
    strip = lambda block: {k: v for k, v in block.items() if k != "cache_control"}  # noqa: E731
    messages = [{**m, "content": [strip(b) for b in m["content"]] if isinstance(m["content"], list) else m["content"]}
                for m in body["messages"]]
    return {**body, "system": [strip(b) for b in body["system"]], "messages": messages}


@pytest.mark.parametrize("marks", [True, False], ids=["cache_control", "unmarked"])
def test_claude_codes_cache_control_keeps_its_prompt_through_traffic_that_fills_the_cache(
        tmp_path, long_context_llama, marks):
    """Claude Code marks its system prompt and its last message with cache_control: the first
    run reports what it wrote there, and the next run reads it back after unrelated traffic
    has filled the prefix cache twice over. Without the marks (the control), that traffic
    evicts it."""
    run1, run2 = recorded("run1"), recorded("run2")
    if not marks:
        run1, run2 = unmarked(run1), unmarked(run2)
    # 16 MB of prefix cache: about 8,000 tokens of this model's KV, two of Claude Code's prompts.
    with serving(tmp_path, models_yaml(long_context_llama, mem=48, prompt_cache_mem=16)) as srv:
        first = httpx.post(srv.base_url + "/v1/messages", json=run1, timeout=300).json()["usage"]
        other_traffic(srv.base_url, 8, 1000)  # 8 x ~2,000 tokens: 32 MB of prefixes
        second = httpx.post(srv.base_url + "/v1/messages", json=run2, timeout=300).json()["usage"]
        shared = _shared(srv.base_url, run1, run2)
        evictions = srv.get("/health").json()["engine"]["prompt_cache_tiers"]["memory"]["evictions"]
    assert evictions >= 4
    if marks:
        assert first["cache_creation_input_tokens"] > 3000 and first["cache_read_input_tokens"] == 0, first
        assert second["cache_read_input_tokens"] >= shared - 1, (second, shared)
    else:
        assert first["cache_creation_input_tokens"] == 0
        assert second["cache_read_input_tokens"] < shared // 2, (second, shared)


def _shared(base: str, a: dict, b: dict) -> int:
    """Tokens the two rendered prompts share: count_tokens of each prompt cut at every system
    block and tool, compared (the public way to measure what a client's prompt renders to)."""
    count = lambda body: httpx.post(base + "/v1/messages/count_tokens", timeout=120, json={  # noqa: E731
        k: v for k, v in body.items() if k in ("model", "messages", "system", "tools")}).json()["input_tokens"]
    head = {**a, "messages": [{"role": "user", "content": "x"}]}
    return count(head) - 8  # the same system prompt and tools, before the first user message


def test_a_request_cut_during_its_prefill_is_resumed_by_its_retry(tmp_path, long_context_llama):
    """Claude Code gives up on a request after ~300 s without output and sends it again; the
    retry starts where the first one's prefill was cut, however far it got."""
    body = {**recorded("run1"), "stream": True}
    slow = {"prefill_chunk_size": 16, "prefill_step_ms": 0}
    with serving(tmp_path, models_yaml(long_context_llama, **slow)) as srv:
        cut = threading.Event()

        def abandon() -> None:
            with httpx.stream("POST", srv.base_url + "/v1/messages", json=body, timeout=300) as r:
                for _ in r.iter_lines():
                    if cut.wait(0.5):
                        return
                    cut.set()  # the prefill is under way: hang up, as a client's watchdog does
                    return

        worker = threading.Thread(target=abandon)
        worker.start()
        worker.join(300)
        time.sleep(1.0)  # the cancellation reaches the engine, the cut prefill goes to the cache
        retry = httpx.post(srv.base_url + "/v1/messages", json={**body, "stream": False}, timeout=300).json()
    read = retry["usage"]["cache_read_input_tokens"]
    assert 0 < read < retry["usage"]["input_tokens"] + read, retry["usage"]
