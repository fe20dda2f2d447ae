"""Contracts of the private mlx-lm API that ``app/engine/mlx_internals.py`` lists.

Each test names the contract it checks, so an mlx-lm upgrade that breaks one
fails here first, saying which.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from app.engine.batch.admission import KV_STEP
from app.engine.kv.kv_quant import BatchQuantizedKVCache, SeqQuantizedKVCache
from app.engine.kv.layers import restore, snapshot
from app.engine.mlx_internals import (
    ArraysCache,
    BatchRotatingKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    trim_prompt_cache,
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


def test_contract_a_plain_cache_rebuilt_from_its_fields_batches_like_the_original():
    """kv_snapshot saves keys / values / offset and sets them on a fresh cache."""
    c = kv(70, 0.5)
    fresh = KVCache()
    fresh.keys, fresh.values, fresh.offset = c.keys[..., :70, :], c.values[..., :70, :], 70
    a, b = KVCache.merge([c, kv(5)]), KVCache.merge([fresh, kv(5)])
    assert mx.array_equal(a.keys, b.keys) and mx.array_equal(a.values, b.values)
    assert trim_prompt_cache([fresh], 1) == 1 and fresh.offset == 69


def test_contract_a_quantized_cache_rebuilt_from_its_fields_batches_like_the_original():
    c = SeqQuantizedKVCache(group_size=64, bits=8)
    x = mx.random.normal((1, 2, 70, 64))
    c.update_and_fetch(x, -x)
    fresh = SeqQuantizedKVCache(group_size=64, bits=8)
    fresh.keys = tuple(q[..., :70, :] for q in c.keys)
    fresh.values = tuple(q[..., :70, :] for q in c.values)
    fresh.offset = 70
    a, b = SeqQuantizedKVCache.merge([c, c]), SeqQuantizedKVCache.merge([fresh, fresh])
    for u, v in zip(a.keys + a.values, b.keys + b.values):
        assert mx.array_equal(u, v)


def test_contract_batch_kv_rolls_back_to_what_each_row_kept():
    """The verify step's rollback (``app.engine.step.verify``) on a BatchKVCache: trim the
    common tail, roll shorter rows right by their surplus (``prepare(right_padding=)``,
    ``finalize``), then drop the left padding every row shares (``keys``, ``values``,
    ``_idx``, ``left_padding``): each row ends as wide as what it kept."""
    from app.engine.step.verify import _shift_left

    a, b = kv(5, 1.0), kv(7, 2.0)
    batch = BatchKVCache.merge([a, b])  # a left-padded by 2
    fed = mx.stack([mx.full((2, 3, 8), 9.0), mx.full((2, 3, 8), 8.0)])  # 3 positions each
    batch.update_and_fetch(fed, fed)
    kept = [1, 3]  # row 0 keeps 1 of its 3, row 1 all 3
    batch.trim(3 - max(kept))
    batch.prepare(right_padding=[max(kept) - n for n in kept])
    batch.finalize()
    shared = int(batch.left_padding.min().item())
    if shared:
        _shift_left(batch, shared)
    row0, row1 = batch.extract(0), batch.extract(1)
    assert row0.offset == 6 and row1.offset == 10
    assert mx.array_equal(row0.keys[0, :, 5, :], mx.full((2, 8), 9.0)).item()
    assert mx.array_equal(row1.keys[0, :, 7:, :], mx.full((2, 3, 8), 8.0)).item()
    assert batch._idx == 10 and int(batch.left_padding.min().item()) == 0


def test_contract_every_batch_kind_snapshots_and_restores_by_its_fields():
    """``layers.snapshot`` / ``restore`` read and set each batch kind's fields
    (``_BATCH_FIELDS``): a write after a snapshot, in place or not, is undone by restore."""
    rot = BatchRotatingKVCache.merge([_rotating(6, 1.0), _rotating(3, 2.0)])
    arrays = ArraysCache.merge([_arrays(1.0), _arrays(2.0)])
    plain = BatchKVCache.merge([kv(4), kv(6)])
    for cache, step in ((rot, 1), (rot, 3), (arrays, 1), (plain, 2)):
        before = [mx.array(x) for x in _tensors(cache)]
        snap = snapshot(cache)
        if cache is arrays:
            cache[0] = cache[0] + 1  # a recurrent layer replaces its state
            cache[1][..., 0] = 7.0  # or writes into it
        else:
            cache.update_and_fetch(mx.ones((2, 2, step, 8)), mx.ones((2, 2, step, 8)))
        restore(cache, snap)
        after = _tensors(cache)
        assert len(after) == len(before) and all(mx.array_equal(x, y).item() for x, y in zip(before, after))


def test_contract_arrays_cache_batches_rows_and_masks_padding():
    """``ArraysCache``: ``merge`` stacks rows' arrays, ``filter`` / ``extract`` take rows back,
    ``prepare(lengths=)`` masks a right-padded chunk's padding (``make_mask``) and
    ``finalize`` clears it; ``extend`` appends rows."""
    batch = ArraysCache.merge([_arrays(1.0), _arrays(2.0)])
    assert batch[0].shape[0] == 2 and float(batch.extract(1)[0][0, 0, 0].item()) == 2.0
    batch.prepare(lengths=[2, 4])
    assert batch.make_mask(4).tolist() == [[True, True, False, False], [True, True, True, True]]
    batch.finalize()
    assert batch.lengths is None and batch.left_padding is None
    batch.extend(ArraysCache.merge([_arrays(3.0)]))
    batch.filter([2, 0])
    assert [float(batch[0][i, 0, 0].item()) for i in range(2)] == [3.0, 1.0]


def test_contract_rotating_rows_merge_extract_and_restore_exactly():
    """A ``RotatingKVCache`` row merged into ``BatchRotatingKVCache``, decoded past its window,
    and extracted holds the last ``max_size`` tokens in order (``keys``, ``offset``); merged
    again it continues as the row would alone."""
    alone = _rotating(5, 1.0)
    batch = BatchRotatingKVCache.merge([_rotating(5, 1.0), _rotating(2, 2.0)])
    for t in range(6):
        x = mx.full((1, 2, 1, 8), float(10 + t))
        alone.update_and_fetch(x, x)
        batch.update_and_fetch(mx.concatenate([x, x]), mx.concatenate([x, x]))
    row = batch.extract(0)
    assert row.offset == alone.offset == 11
    k_alone, _ = alone.state[0], alone.state[1]
    ordered = alone._temporal_order(k_alone)[..., -alone.max_size:, :]
    assert mx.array_equal(row.keys[..., -row.max_size:, :], ordered).item()


def _rotating(tokens: int, value: float, window: int = 4) -> RotatingKVCache:
    c = RotatingKVCache(max_size=window)
    x = mx.full((1, 2, tokens, 8), value)
    c.update_and_fetch(x, x)
    return c


def _arrays(value: float) -> ArraysCache:
    c = ArraysCache(size=2)
    c[0] = mx.full((1, 3, 8), value)
    c[1] = mx.full((1, 2, 4, 4), value)
    return c


def _tensors(cache) -> list:
    if isinstance(cache, ArraysCache):
        padding = [cache.left_padding] if cache.left_padding is not None else []
        return [x for x in cache.cache if x is not None] + padding
    keys, values = cache.keys, cache.values
    return [keys, values, cache.offset, cache.left_padding, mx.array(cache._idx)]
