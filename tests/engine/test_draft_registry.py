"""A draft model in the registry: loaded with its target (before it), counted in the same memory
budget with its KV for the target's rows, never unloaded while the target is loaded, and a
draft with another tokenizer refused at load."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from app.config.loader import load_models_file
from app.engine.registry import MB, Registry
from app.engine.worker import MLXWorker
from app.errors import AppError, ConflictError, ModelLoadError
from app.specs import model_spec
from tests.fixtures.tiny_llama import TINY_LLAMA, build_tiny_llama

YAML = """models:
  - name: target
    local_path: {target}
    params: {{mem: 16, speculative: {{draft: small, tokens: 3}}}}
  - name: small
    local_path: {small}
    params: {{mem: 16}}
  - name: alone
    local_path: {target}
    params: {{mem: 16}}
"""


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("small"), demo_model_dir,
                            {**TINY_LLAMA, "num_hidden_layers": 1}, seed=3)


@pytest.fixture()
def worker():
    w = MLXWorker()
    w.start()
    yield w
    w.stop()


def registry(worker: MLXWorker, tmp_path: Path, target: Path, small: Path, **kw) -> Registry:
    path = tmp_path / "models.yaml"
    path.write_text(YAML.format(target=target, small=small))
    files = load_models_file(path)
    return Registry(worker, [model_spec(e, None) for e in files.models], **kw)


def test_the_draft_loads_first_and_stays_while_its_target_is_loaded(worker, tmp_path, tiny_model_dir, small_dir):
    reg = registry(worker, tmp_path, tiny_model_dir, small_dir)

    async def scenario() -> None:
        assert await reg.load("target") == "target"
        snap = reg.snapshot()["models"]
        assert snap["small"]["state"] == "loaded" and snap["target"]["draft"] == "small"
        # The draft's KV for the target's rows counts with the target: its budget in tokens x the
        # draft's bytes per token (1 layer, 2 KV heads of 16, K and V, float32).
        target = reg.loaded_chat("target")
        assert target is not None
        tokens = 16 * MB // target.kv_bytes_per_token
        weights = snap["target"]["memory_mb"]["weights"] * MB
        alone = sum(f.stat().st_size for f in tiny_model_dir.glob("*.safetensors"))
        assert weights == pytest.approx(alone + tokens * (1 * 2 * 16 * 2 * 4), abs=0.1 * MB)
        with pytest.raises(ConflictError, match="drafts for 'target', which is loaded"):
            await reg.unload_idle("small")  # its target holds it
        await reg.unload_idle("target")
        assert reg.snapshot()["models"]["target"]["draft"] is None
        assert await reg.unload_idle("small") == "small"  # free once its target is gone
        assert reg.snapshot()["models"]["small"]["state"] == "unloaded"

    asyncio.run(scenario())


def test_a_target_whose_draft_does_not_fit_does_not_load(worker, tmp_path, tiny_model_dir, small_dir):
    """Both count in one budget: room for the target alone is not room for it and its draft."""
    weights = sum(f.stat().st_size for f in tiny_model_dir.glob("*.safetensors"))
    # The target (weights, mem, its draft's KV estimate) fits alone; with the draft's entry too it does not.
    reg = registry(worker, tmp_path, tiny_model_dir, small_dir, memory_limit_bytes=weights + 40 * MB)

    async def scenario() -> None:
        assert await reg.load("alone") == "alone"
        await reg.unload_idle("alone")
        with pytest.raises(Exception, match="needs .* MB"):
            await reg.load("target")
        assert reg.snapshot()["models"]["target"]["state"] == "unloaded"
        # The draft it loaded first is not held: nothing leaks a lease.
        assert await reg.unload_idle("small") in ("small",)

    asyncio.run(scenario())


def test_a_draft_with_another_tokenizer_fails_its_target_clearly(worker, tmp_path, tiny_model_dir, demo_model_dir):
    tok = tmp_path / "tok"
    tok.mkdir()
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (demo_model_dir / name).exists():
            shutil.copy(demo_model_dir / name, tok / name)
    data = json.loads((demo_model_dir / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = (t for t, i in vocab.items() if i in (2000, 2001))
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tok / "tokenizer.json").write_text(json.dumps(data))
    other = build_tiny_llama(tmp_path / "other", tok, {**TINY_LLAMA, "num_hidden_layers": 1})
    reg = registry(worker, tmp_path, tiny_model_dir, other)
    with pytest.raises(AppError, match="draft model 'small' cannot draft for it: the vocabularies differ"):
        reg.load_now("target")
    # The draft is not held by a target that failed.
    assert reg.snapshot()["models"]["small"]["requests"]["running"] == 0

    async def scenario() -> None:
        with pytest.raises(ModelLoadError, match="the vocabularies differ"):
            await reg.acquire_chat("target")
        assert await reg.unload_idle("small") == "small"

    asyncio.run(scenario())


def test_a_draft_that_is_not_served_here_is_done_without(worker, tmp_path, tiny_model_dir, small_dir, caplog):
    """Distributed serving serves one chat model: its draft is not an entry there, and it decodes without."""
    path = tmp_path / "models.yaml"
    path.write_text(YAML.format(target=tiny_model_dir, small=small_dir))
    target = model_spec(load_models_file(path).models[0], None)
    with caplog.at_level("WARNING", logger="tandem.registry"):
        reg = Registry(worker, [target])
    assert "draft model small is not served here; decoding without it" in caplog.text
    reg.load_now("target")
    assert reg.snapshot()["models"]["target"]["state"] == "loaded"
    assert reg.snapshot()["models"]["target"]["draft"] is None
