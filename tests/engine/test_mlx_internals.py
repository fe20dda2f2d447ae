"""Contracts of the private mlx-lm API that ``app/engine/mlx_internals.py`` lists.

Each test names the contract it checks, so an mlx-lm upgrade that breaks one
fails here first, saying which.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from app.engine.admission import KV_STEP
from app.engine.kv_quant import BatchQuantizedKVCache
from app.engine.mlx_internals import (
    KVCache,
    QuantizedKVCache,
    batch_kv_nbytes,
    new_batch_generator,
)


def kv(tokens: int, value: float = 1.0) -> KVCache:
    c = KVCache()
    c.update_and_fetch(mx.full((1, 2, tokens, 8), value), mx.full((1, 2, tokens, 8), value))
    return c


def test_contract_every_kv_cache_grows_in_steps_of_kv_step():
    assert KVCache.step == BatchKVCache.step == QuantizedKVCache.step == BatchQuantizedKVCache.step == KV_STEP
    c = kv(300)
    assert c.keys.shape[2] == 2 * KV_STEP  # allocated, beyond the 300 used
    c.update_and_fetch(mx.zeros((1, 2, 212, 8)), mx.zeros((1, 2, 212, 8)))
    assert c.offset == 512 and c.keys.shape[2] == 512
    c.update_and_fetch(mx.zeros((1, 2, 1, 8)), mx.zeros((1, 2, 1, 8)))
    assert c.keys.shape[2] - c.offset == KV_STEP - 1  # the most a cache holds unused


def test_contract_batch_caches_are_rectangles_as_wide_as_the_widest_row():
    short, long = kv(10), kv(300)
    batch = BatchKVCache.merge([short, long])
    assert batch.keys.shape[:3] == (2, 2, 300)  # the short row left-padded to the long one
    batch.update_and_fetch(mx.zeros((2, 2, 1, 8)), mx.zeros((2, 2, 1, 8)))
    assert batch.keys.shape[2] == 301 + KV_STEP - 1 and batch.nbytes == 2 * 2 * (301 + 255) * 8 * 4 * 2
    batch.filter([0])  # the long row leaves: the padding every row shares goes
    assert batch.keys.shape[2] - batch._idx == KV_STEP - 1 and batch._idx == 11


def test_contract_batch_generator_reports_the_bytes_of_its_caches(tiny_model_dir):
    from mlx_lm import load

    model, tokenizer = load(str(tiny_model_dir))
    bg = new_batch_generator(model, tokenizer, max_tokens=4, completion_batch_size=2, prefill_batch_size=2,
                             prefill_step_size=64)
    assert batch_kv_nbytes(bg) == 0
    bg.insert_segments([[[5] * 40], [[6] * 90]], max_tokens=[3, 3])
    bg.next()
    held = batch_kv_nbytes(bg)
    caches = list(bg._generation_batch.prompt_cache) + list(bg._prompt_batch.prompt_cache)
    assert held == sum(c.nbytes for c in caches) > 0
