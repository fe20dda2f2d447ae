"""The disk tier for every cache kind: round trips that continue exactly, restore points, forgeries.

Each architecture of the zoo (tests/fixtures/zoo.py: plain KV, sliding windows, Mamba,
gated delta-net, short convolutions, KV-shared layers) and two whose layers are lists of
caches (Baichuan-M1: a short convolution beside a window or full KV; Falcon-H1: Mamba
beside KV) prefills a prompt in two chunks, keeping a checkpoint of its untrimmable
layers between them, as Tandem's step does where a segment ends. Its cache goes to disk
through the tier (``offer``, the writer), a new tier over the same directory (a restart)
finds it, and what it loads continues as the live cache does: the next logits are equal,
bit for bit, at the file's end and at its checkpoint. The test thread is the only one
using MLX here.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from app.engine.kv.disk_cache import DiskTier
from app.engine.kv.kv_files import Tensor, read_file, write_file
from app.engine.kv.kv_layout import KVLayout, model_layout
from app.engine.kv.layers import SeqCache, trims
from tests.fixtures.zoo import ZOO, make_model

KEY = "zoo\x00"
N, AT = 40, 20  # a prompt of 40 tokens, checkpointed at 20: both past the zoo's 16-token windows
TOKENS = list(range(300, 300 + N))

# Models whose layers are CacheLists, built in memory (random weights, a 256-token vocabulary).
_LISTS: dict[str, dict[str, Any]] = {
    "baichuan_m1": {"model_type": "baichuan_m1", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                    "rope_theta": 10000.0, "sliding_window": 16, "sliding_window_layers": [0], "conv_window": 2,
                    "rms_norm_eps": 1e-5},
    "falcon_h1": {"model_type": "falcon_h1", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
                  "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                  "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16,
                  "mamba_chunk_size": 16},
}
# Quantized KV (kv_cache_bits) beside each other kind.
_QUANTIZED = ("llama", "qwen3_5", "gemma3_text", "lfm2")


@pytest.fixture(scope="module")
def model(request, zoo_model) -> Any:
    name = request.param
    if name in _LISTS:
        mx.random.seed(0)
        m = make_model(_LISTS[name])
        mx.eval(m.parameters())
        return m
    return load(str(zoo_model(name)))[0]


def prefill(model: Any, layout: KVLayout) -> tuple[SeqCache, list[Any], list[Any]]:
    """The prompt in two chunks: its cache with a checkpoint at AT (where some layer cannot
    trim), and deep copies of the live cache at AT and at N."""
    cache = layout.make_cache()
    model(mx.array([TOKENS[:AT]]), cache=cache)
    mx.eval([c.state for c in cache])
    at = copy.deepcopy(cache)
    states = [None if trims(c) else copy.deepcopy(c) for c in cache]
    model(mx.array([TOKENS[AT:]]), cache=cache)
    mx.eval([c.state for c in cache])
    checkpoints = [(AT, states)] if not layout.trims else []
    return SeqCache(cache, checkpoints), at, copy.deepcopy(cache)


def continues_alike(model: Any, live: list[Any], restored: list[Any]) -> None:
    """A chunk, then two decode steps, on both caches: the logits are equal, bit for bit."""
    for step in ([7, 8, 9], [5], [6]):
        a = model(mx.array([step]), cache=live)
        b = model(mx.array([step]), cache=restored)
        assert mx.array_equal(a, b).item(), f"logits differ by {mx.abs(a - b).max().item()} after {step}"


def tier(path: Path, layout: KVLayout, **kw: Any) -> DiskTier:
    return DiskTier(path, budget_bytes=kw.pop("budget", 1 << 30), identity="i" * 20, queue_bytes=1 << 30,
                    layout=layout, **kw)


def write(path: Path, layout: KVLayout, cache: SeqCache, key: str = KEY, tokens: list[int] = TOKENS) -> None:
    t = tier(path, layout)
    t.offer(key, tokens, cache)
    assert t.close(30) and t.stats().writes == 1
    t.collect()


CASES = [*(pytest.param(name, None, id=name) for name in ZOO),
         *(pytest.param(name, 8, id=f"{name}-kv8") for name in _QUANTIZED),
         *(pytest.param(name, None, id=name) for name in _LISTS)]


@pytest.mark.parametrize(("model", "bits"), CASES, indirect=["model"])
def test_every_kind_round_trips_through_disk_and_continues_exactly(model, bits, tmp_path):
    layout = model_layout(model, bits)
    cache, live_at, live_end = prefill(model, layout)
    write(tmp_path / "m", layout, cache)
    reopened = tier(tmp_path / "m", layout)  # a restart: the index is read back from the directory
    try:
        found = reopened.lookup(KEY, [*TOKENS, 1])
        assert found is not None and found[1] == N
        restored = reopened.load(*found, [*TOKENS, 1])
        assert restored is not None
        assert [type(c).__name__ for c in restored] == [type(c).__name__ for c in layout.make_cache()]
        assert [p for p, _ in restored.checkpoints] == ([] if layout.trims else [AT])
        continues_alike(model, live_end, restored)

        edited = [*TOKENS[:AT], 1, 2, 3]  # shares the prompt up to its checkpoint, then differs
        found = reopened.lookup(KEY, edited)
        if layout.trims:  # every layer trims: exact stored prefixes only, as before
            assert found is None
        else:
            assert found is not None and found[1] == AT
            restored = reopened.load(*found, edited)
            assert restored is not None and restored.checkpoints == []
            continues_alike(model, live_at, restored)
        assert reopened.stats().hits == (1 if layout.trims else 2)
    finally:
        reopened.close()


@pytest.mark.parametrize("model", ["qwen3_5", "gemma3_text", "llama"], indirect=True)
def test_a_restore_point_leaves_the_prompts_last_token_to_feed(model, tmp_path):
    """A row always feeds at least its last prompt token: a prompt that ends where a file
    does restores at its checkpoint where a layer cannot trim (the caller cuts a trimmable
    file back by one instead)."""
    layout = model_layout(model)
    cache, _, _ = prefill(model, layout)
    write(tmp_path / "m", layout, cache)
    reopened = tier(tmp_path / "m", layout)
    try:
        found = reopened.lookup(KEY, TOKENS)
        assert found is not None and found[1] == (N if layout.trims else AT)
        assert reopened.lookup(KEY, TOKENS[: AT + 1]) == (None if layout.trims else (found[0], AT))
        assert reopened.lookup(KEY, TOKENS[:AT]) is None
        assert reopened.lookup("zoo\x00other", [*TOKENS, 1]) is None  # another partition's
    finally:
        reopened.close()


# ---- files made to pass the checksum, for the new kinds -------------------------------------


def forge(path: Path, change) -> None:
    """Rewrite ``path`` with ``change(meta, tensors)`` applied, and a valid checksum."""
    meta, read = read_file(path)
    meta, tensors = change(dict(meta), [Tensor(t.name, t.dtype, t.shape, memoryview(bytes(t.data)))
                                        for t in read.values()])
    path.unlink()
    write_file(path.parent, path.name, {k: v for k, v in meta.items() if k != "format"}, tensors)


def _replace(tensors: list[Tensor], name: str, dtype: str, shape: tuple[int, ...], data: bytes) -> list[Tensor]:
    return [Tensor(name, dtype, shape, memoryview(data)) if t.name == name else t for t in tensors]


def state_not_finite(meta, tensors):
    t = next(t for t in tensors if ".state." in t.name and not t.name.startswith("c"))
    return meta, _replace(tensors, t.name, t.dtype, t.shape, b"\xff" * t.data.nbytes)


def state_shape_changed(meta, tensors):
    t = next(t for t in tensors if ".state." in t.name)
    half = bytes(t.data)[: t.data.nbytes // 2]
    return meta, _replace(tensors, t.name, t.dtype, (*t.shape[:-1], t.shape[-1] // 2), half)


def window_grown(meta, tensors):
    """A window holding one token more than its size."""
    t = next(t for t in tensors if t.name == "0.keys")
    row = t.data.nbytes // t.shape[2]
    return meta, _replace(tensors, t.name, t.dtype, (*t.shape[:2], t.shape[2] + 1, t.shape[3]),
                          bytes(t.data) + bytes(t.data)[:row])


def checkpoint_dropped(meta, tensors):
    """The checkpoint's tensors gone, its position still in the metadata."""
    return meta, [t for t in tensors if not t.name.startswith("c0.")]


def checkpoint_digest_wrong(meta, tensors):
    meta["checkpoints"] = f"{AT}:{'0' * 32}"
    return meta, tensors


def checkpoints_garbled(meta, tensors):
    meta["checkpoints"] = "20:zz,5:x"
    return meta, tensors


FORGERIES = {
    "qwen3_5": [state_not_finite, state_shape_changed, checkpoint_dropped, checkpoint_digest_wrong,
                checkpoints_garbled],
    "gemma3_text": [window_grown, checkpoint_dropped],
}


@pytest.mark.parametrize(("model", "change"), [pytest.param(m, c, id=f"{m}-{c.__name__}")
                                               for m, cs in FORGERIES.items() for c in cs], indirect=["model"])
def test_a_forged_file_of_a_new_kind_is_refused_with_one_warning(model, change, tmp_path, caplog):
    layout = model_layout(model)
    cache, _, _ = prefill(model, layout)
    write(tmp_path / "m", layout, cache)
    (path,) = (tmp_path / "m").iterdir()
    forge(path, change)
    reopened = tier(tmp_path / "m", layout)
    try:
        with caplog.at_level(logging.WARNING, logger="tandem.engine"):
            for prompt in ([*TOKENS[:AT], 1, 2], [*TOKENS, 1]):
                found = reopened.lookup(KEY, prompt)
                assert found is None or reopened.load(*found, prompt) is None
        warned = [r for r in caplog.records if path.name in r.getMessage()]
        assert len(warned) == 1 and "damaged" in warned[0].getMessage()
        assert reopened.stats().damaged == 1 and not path.exists()
    finally:
        reopened.close()


# ---- one key's share of the disk ------------------------------------------------------------


def kv_file_cache(seed: int, layout: KVLayout) -> list[Any]:
    cache = layout.make_cache()
    rng = np.random.default_rng(seed)
    for c in cache:
        c.keys = mx.array(rng.standard_normal((1, 1, 100, 64)).astype(np.float32))
        c.values = mx.array(rng.standard_normal((1, 1, 100, 64)).astype(np.float32))
        c.offset = 100
    return cache


@pytest.mark.parametrize("model", ["llama"], indirect=True)
def test_one_keys_prompts_evict_its_own_files_before_another_keys(model, tmp_path):
    """Issue 30: 120 abandoned prompts of one key wrote 267 MB to the disk tier and pushed every
    other key's prefixes out. Past its share of the budget, a key's own files go first."""
    layout = model_layout(model)
    budget = 10 * (2 * 2 * 100 * 64 * 4 + 4096)  # ten files of 100 tokens
    t = tier(tmp_path / "m", layout, budget=budget, key_share=0.5)
    for i in range(3):
        t.offer("zoo\x00bob", [i] * 100, kv_file_cache(i, layout))
    for i in range(20):
        t.offer("zoo\x00mallory", [100 + i] * 100, kv_file_cache(100 + i, layout))
    assert t.close(30)
    t.collect()
    assert [t.lookup("zoo\x00bob", [i] * 101) is not None for i in range(3)] == [True] * 3
    kept = [i for i in range(20) if t.lookup("zoo\x00mallory", [100 + i] * 101) is not None]
    assert kept == list(range(13, 20))  # mallory's newest, in what bob leaves
    assert t.stats().bytes <= budget


@pytest.mark.parametrize("model", ["llama"], indirect=True)
def test_a_checkpoint_of_a_model_whose_layers_all_trim_is_a_position_alone(model, tmp_path):
    """Where every layer trims, a checkpoint holds no tensors: the file's KV cut back to it."""
    layout = model_layout(model)
    cache, live_at, _ = prefill(model, layout)
    write(tmp_path / "m", layout, SeqCache(cache, [(AT, [None] * len(cache))]))
    (path,) = (tmp_path / "m").iterdir()
    assert not [name for name in read_file(path)[1] if name.startswith("c0.")]
    reopened = tier(tmp_path / "m", layout)
    try:
        edited = [*TOKENS[:AT], 1, 2, 3]
        found = reopened.lookup(KEY, edited)
        assert found is not None and found[1] == AT
        restored = reopened.load(*found, edited)
        assert restored is not None and all(c.offset == AT for c in restored)
        continues_alike(model, live_at, restored)
    finally:
        reopened.close()
