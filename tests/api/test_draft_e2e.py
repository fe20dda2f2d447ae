"""A draft model end to end: a server whose tiny llama names another entry as its draft answers
at temperature 0 exactly as it does with the draft switched off, and /health and /metrics count
the draft's proposals."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.api.serving import serving
from tests.fixtures.tiny_llama import TINY_LLAMA, build_tiny_llama

PROMPTS = ["Hello there", "Write a list of fruits", "1 2 3 4"]


def models_yaml(target: Path, draft: Path) -> str:
    params = {"mem": 16, "max_tokens": 24, "temperature": 0.0, "max_num_seqs": 4}
    return yaml.safe_dump({"server": {"shutdown_grace_s": 1}, "models": [
        {"name": "tiny", "local_path": str(target), "params": {**params, "speculative": {"draft": "twin"}}},
        {"name": "twin", "local_path": str(draft), "params": params},
        {"name": "other", "local_path": str(target), "params": {**params, "speculative": {"draft": "small"}}},
        {"name": "small", "local_path": str(draft.parent / "small"), "params": params},
    ]})


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, demo_model_dir: Path):
    root = tmp_path_factory.mktemp("drafts")
    # A twin of the target (its very weights: every proposal accepted) and a smaller, different llama.
    twin = build_tiny_llama(root / "twin", demo_model_dir)
    build_tiny_llama(root / "small", demo_model_dir, {**TINY_LLAMA, "num_hidden_layers": 1}, seed=5)
    with serving(root, models_yaml(tiny_model_dir, twin)) as served:
        yield served


def answer(srv, model: str, prompt: str, **extra) -> dict:
    r = srv.post("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": prompt}],
                                          "speculative": {"prompt_lookup": False, **extra}})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("model", ["tiny", "other"])
def test_greedy_answers_are_the_answers_without_the_draft(srv, model):
    for prompt in PROMPTS:
        plain = answer(srv, model, prompt, draft=False)["choices"][0]["message"]["content"]
        assert answer(srv, model, prompt)["choices"][0]["message"]["content"] == plain


def test_the_twin_drafts_and_health_and_metrics_count_it(srv):
    for prompt in PROMPTS:
        answer(srv, "tiny", prompt)
    health = srv.get("/health").json()["models"]
    assert health["tiny"]["draft"] == "twin" and health["twin"]["state"] == "loaded"
    counts = health["tiny"]["speculation"]["draft"]
    assert counts["proposed"] > 0 and counts["accepted"] > 0 and counts["steps"] > 0
    assert 'tandem_speculative_accepted_tokens_total{drafter="draft",model="tiny"}' in srv.get("/metrics").text
