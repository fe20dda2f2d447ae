"""The prefix cache's disk tier across a real restart of `python -m app serve`.

SIGTERM right after a response: the prefixes queued for disk are written before
the process exits 0. A second process answers the same request from disk: the
same text at temperature 0, ``cached_tokens`` counting the disk hit, and
/health and /metrics showing it per tier.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.api.serving import tiny_yaml
from tests.conftest import REPO, free_port

SYSTEM = "You are a terse assistant who counts sheep and never stops counting them. " * 12


def start(tmp_path: Path, model_dir: Path, cache_dir: Path, procs: list) -> tuple[subprocess.Popen, str]:
    models = tmp_path / "models.yaml"
    models.write_text(tiny_yaml(model_dir, {"shutdown_grace_s": 5}, {
        "max_tokens": 8, "cache_min_tokens": 16, "prompt_cache_disk_mb": 64, "prompt_cache_disk_dir": str(cache_dir)}))
    port = free_port()
    log = open(tmp_path / f"server-{len(procs)}.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "serve", "--models-file", str(models), "--port", str(port), "--log-level", "warning"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    procs.append(proc)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, (tmp_path / f"server-{len(procs) - 1}.log").read_text()
        assert time.monotonic() < deadline, "server did not start"
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            time.sleep(0.1)


@pytest.fixture()
def servers(tmp_path, tiny_model_dir):
    procs: list[subprocess.Popen] = []
    yield lambda: start(tmp_path, tiny_model_dir, tmp_path / "prompt-cache", procs)
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def ask(base: str) -> dict:
    r = httpx.post(base + "/v1/chat/completions", timeout=60, json={"model": "tiny", "temperature": 0, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": "How many sheep?"}]})
    assert r.status_code == 200, r.text
    return r.json()


def test_sigterm_writes_queued_prefixes_and_a_restart_reads_them(servers, tmp_path):
    proc, base = servers()
    cold = ask(base)
    os.kill(proc.pid, signal.SIGTERM)  # at once: the response's prefixes may still be queued
    assert proc.wait(timeout=30) == 0
    written = list((tmp_path / "prompt-cache").glob("*/*.safetensors"))
    assert len(written) == 2  # the system prompt, and the whole conversation

    proc, base = servers()
    warm = ask(base)
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < warm["usage"]["prompt_tokens"]
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    tiers = httpx.get(base + "/health").json()["engine"]["prompt_cache_tiers"]
    assert tiers["disk"]["hits"] == 1 and tiers["disk"]["tokens"] == cached and tiers["disk"]["entries"] == 2
    assert tiers["memory"]["entries"] >= 1  # the disk hit is in memory again
    metrics = httpx.get(base + "/metrics").text
    assert 'tandem_prompt_cache_tier_hits_total{model="tiny",tier="disk"} 1.0' in metrics
    assert f'tandem_prompt_cache_tier_tokens_total{{model="tiny",tier="disk"}} {float(cached)}' in metrics
    assert 'tandem_prompt_cache_disk_writes_total{model="tiny",outcome="dropped"} 0.0' in metrics
    assert "tandem_kv_cache_bytes " in metrics
