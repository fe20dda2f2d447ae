"""The prefix cache's disk tier across a real restart of `python -m app serve`.

SIGTERM right after a response: the prefixes queued for disk are written before
the process exits 0. A second process answers the same request from disk: the
same text at temperature 0, ``cached_tokens`` counting the disk hit, and
/health and /metrics showing it per tier. Models with recurrent state or sliding
windows (tests/fixtures/zoo.py) continue a conversation from disk as plain ones do.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
import yaml

from tests.api.serving import server_process, tiny_yaml

SYSTEM = "You are a terse assistant who counts sheep and never stops counting them. " * 12


def models(model_dir: Path, cache_dir: Path) -> dict:
    return yaml.safe_load(tiny_yaml(model_dir, {"shutdown_grace_s": 5}, {
        "max_tokens": 8, "cache_min_tokens": 16, "prompt_cache_disk_mb": 64, "prompt_cache_disk_dir": str(cache_dir)}))


def ask(base: str) -> dict:
    r = httpx.post(base + "/v1/chat/completions", timeout=60, json={"model": "tiny", "temperature": 0, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "How many sheep?"}]})
    assert r.status_code == 200, r.text
    return r.json()


def test_sigterm_writes_queued_prefixes_and_a_restart_reads_them(tmp_path, tiny_model_dir):
    cache_dir = tmp_path / "prompt-cache"
    (tmp_path / "first").mkdir()
    with server_process(tmp_path / "first", models(tiny_model_dir, cache_dir)) as (proc, base):
        cold = ask(base)
        os.kill(proc.pid, signal.SIGTERM)  # at once: the response's prefixes may still be queued
        assert proc.wait(timeout=30) == 0
    written = list(cache_dir.glob("*/*.safetensors"))
    assert len(written) == 2  # the system prompt, and the whole conversation

    (tmp_path / "second").mkdir()
    with server_process(tmp_path / "second", models(tiny_model_dir, cache_dir)) as (proc, base):
        warm = ask(base)
        tiers = httpx.get(base + "/health").json()["engine"]["prompt_cache_tiers"]
        metrics = httpx.get(base + "/metrics").text
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < warm["usage"]["prompt_tokens"]
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    assert tiers["disk"]["hits"] == 1 and tiers["disk"]["tokens"] == cached and tiers["disk"]["entries"] == 2
    assert tiers["memory"]["entries"] >= 1  # the disk hit is in memory again
    assert 'tandem_prompt_cache_tier_hits_total{model="tiny",tier="disk"} 1.0' in metrics
    assert f'tandem_prompt_cache_tier_tokens_total{{model="tiny",tier="disk"}} {float(cached)}' in metrics
    assert 'tandem_prompt_cache_disk_writes_total{model="tiny",outcome="dropped"} 0.0' in metrics
    assert "tandem_kv_cache_bytes " in metrics


def chat(base: str, model: str, messages: list[dict], **body) -> dict:
    r = httpx.post(base + "/v1/chat/completions", timeout=60, json={
        "model": model, "temperature": 0, "max_tokens": 8, "messages": messages, **body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3_text"])
def test_turn_2_on_a_hybrid_or_sliding_model_starts_from_turn_1_after_a_restart(tmp_path, zoo_model, arch):
    """Gated delta-net beside attention (Qwen3.5), sliding windows beside full attention (Gemma 3):
    a conversation's next turn on a restarted server reads turn 1 from disk, at least up to where
    its prompt ended (a checkpoint of the states there), and answers as a cold prefill does."""
    cache_dir = tmp_path / "prompt-cache"
    models = yaml.safe_load(yaml.safe_dump({"server": {"shutdown_grace_s": 5}, "models": [{
        "name": arch, "local_path": str(zoo_model(arch)), "params": {
            "mem": 16, "cache_min_tokens": 8, "prompt_cache_disk_mb": 64, "prompt_cache_disk_dir": str(cache_dir)}}]}))
    question = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How many sheep?"}]
    (tmp_path / "first").mkdir()
    with server_process(tmp_path / "first", models) as (proc, base):
        one = chat(base, arch, question)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    turn_two = [*question, {"role": "assistant", "content": one["choices"][0]["message"]["content"]},
                {"role": "user", "content": "And goats?"}]
    (tmp_path / "second").mkdir()
    with server_process(tmp_path / "second", models) as (proc, base):
        two = chat(base, arch, turn_two)
        cold = chat(base, arch, turn_two, cache_salt="cold")
        tiers = httpx.get(base + "/health").json()["engine"]["prompt_cache_tiers"]
    # At least up to turn 1's checkpoint where its prompt was prefilled (all but the token the first
    # decode step feeds); all of turn 1 where its answer, sent back as text, tokenizes as it was written.
    assert two["usage"]["prompt_tokens_details"]["cached_tokens"] >= one["usage"]["prompt_tokens"] - 1
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert two["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    assert tiers["disk"]["hits"] == 1 and tiers["disk"]["damaged"] == 0
