"""Contracts of the private mlx-lm API that ``app/engine/mlx_internals.py`` lists.

Each test names the contract it checks, so an mlx-lm upgrade that breaks one
fails here first, saying which.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from app.engine.batch.admission import KV_STEP
from app.engine.kv.kv_quant import BatchQuantizedKVCache, SeqQuantizedKVCache
from app.engine.mlx_internals import (
    KVCache,
    LRUPromptCache,
    QuantizedKVCache,
    batch_kv_nbytes,
    new_batch_generator,
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


def test_contract_lru_prompt_cache_len_trim_and_nearest():
    lru = LRUPromptCache(max_size=1 << 62, max_bytes=1 << 62)
    lru.insert_cache("m", [1, 2, 3, 4], [kv(4)], cache_type="system")
    lru.insert_cache("m", [7, 8, 9], [kv(3)], cache_type="assistant")
    lru.insert_cache("n", [1, 2], [kv(2)], cache_type="assistant")
    assert len(lru) == 3 and lru.nbytes == sum(kv(n).nbytes for n in (4, 3, 2))
    cache, rest = lru.fetch_nearest_cache("m", [1, 2, 3, 4, 5])  # shorter entry: the rest to prefill
    assert rest == [5] and cache[0].offset == 4
    cache, rest = lru.fetch_nearest_cache("m", [1, 2, 9])  # a longer entry, trimmed to the common prefix
    assert rest == [9] and cache[0].offset == 2
    cache[0].offset = 0  # a copy: the entry is untouched
    assert lru.fetch_nearest_cache("m", [1, 2, 3, 4])[0][0].offset == 4
    lru.trim_to(n_sequences=2, n_bytes=1 << 62)
    assert len(lru) == 2
    lru.trim_to(n_bytes=0)
    assert len(lru) == 0 and lru.nbytes == 0


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


def test_contract_prefill_step_size_sets_each_steps_chunk(tiny_model_dir):
    """``BatchGenerator.prefill_step_size``, set between steps, is the next step's chunk of
    every prompt being prefilled (``pacing`` sizes it by time); prompt responses carry
    each row's progress (tokens prefilled so far, of its total)."""
    from mlx_lm import load

    model, tokenizer = load(str(tiny_model_dir))
    bg = new_batch_generator(model, tokenizer, max_tokens=2, completion_batch_size=2, prefill_batch_size=2,
                             prefill_step_size=64)
    bg.insert_segments([[[5] * 150]], max_tokens=[2])
    progress = []
    for chunk in (64, 20, 33):
        bg.prefill_step_size = chunk
        prompts, _ = bg.next()
        progress.append(prompts[0].progress)
    assert progress == [(64, 150), (84, 150), (117, 150)]


def _generators(tiny_model_dir):
    from mlx_lm import load

    from app.engine.speculative.verify import install

    model, tokenizer = load(str(tiny_model_dir))
    make = lambda: new_batch_generator(model, tokenizer, max_tokens=64, completion_batch_size=4,  # noqa: E731
                                       prefill_batch_size=4, prefill_step_size=64)
    plain, spec = make(), make()
    return plain, spec, install(spec)


def _run(bg, prompts, max_tokens, before_step=lambda: None):
    """Each row's finishing response, by uid, stepping until every row finished."""
    uids = bg.insert_segments([[p] for p in prompts], max_tokens=[max_tokens] * len(prompts))
    done = {}
    while len(done) < len(uids):
        before_step()
        for r in bg.next()[1]:
            if r.finish_reason is not None:
                done[r.uid] = r
    return [done[u] for u in uids]


def test_contract_generation_batch_is_the_generators_own(tiny_model_dir):
    """BatchGenerator extends new generation batches into its ``_generation_batch``: an
    installed VerifyBatch holds every decoding row, and without proposals its step is
    mlx-lm's own (same tokens, same KV)."""
    plain, spec, vb = _generators(tiny_model_dir)
    prompts = [[5, 6, 7] * 9, [8, 9] * 20]
    a, b = _run(plain, prompts, 6), _run(spec, prompts, 6)
    assert spec._generation_batch is vb
    assert [r.all_tokens for r in a] == [r.all_tokens for r in b]
    for ra, rb in zip(a, b):
        assert all(mx.array_equal(x.state[0], y.state[0]).item() for x, y in zip(ra.prompt_cache, rb.prompt_cache))
    # The fields the verify step reads and sets (a row decoding: one sampled token ahead of its KV).
    spec.insert_segments([[[5, 6, 7] * 9]], max_tokens=[8])
    while not vb.uids:
        spec.next()
    assert vb._next_tokens.shape == (1,) and len(vb._next_logprobs) == 1 and len(vb._token_context) == 1
    assert vb._num_tokens == [0] and vb.max_tokens == [8] and len(vb._matchers) == 1
    assert vb.tokens[0] == [5, 6, 7] * 9 and isinstance(vb.prompt_cache[0], BatchKVCache)


def test_contract_a_verify_step_rolls_batch_kv_back_to_what_each_row_kept(tiny_model_dir):
    """Rows of different lengths keeping different runs of their proposals: each row's KV and
    tokens at the end are plain decoding's (trim, right-padding roll, the shared left
    padding and ``_idx`` shifted off)."""
    from app.engine.speculative.verify import RowProposal

    plain, spec, vb = _generators(tiny_model_dir)
    prompts = [[5, 6, 7] * 9, [8, 9] * 20, [11] * 7]
    n = 14
    expected = _run(plain, prompts, n)
    outputs = [r.all_tokens[len(p):] for r, p in zip(expected, prompts)]
    for r, p in zip(expected, prompts):
        assert r.all_tokens[:len(p)] == p

    seen: set[int] = set()

    def propose():
        seen.update(vb.outcomes)
        pending = vb.pending()
        props = {}
        for uid in pending:  # uid: the row's index (a fresh generator)
            done = len(vb.context(uid)) - len(prompts[uid]) + 1  # output tokens so far, x included
            truth = outputs[uid][done:done + 4]
            if uid == 1:  # wrong from its third token on
                truth = [*truth[:2], *(t + 1 for t in truth[2:])]
            if uid != 2 and truth:  # row 2 never proposes
                props[uid] = RowProposal(tuple(truth))
        vb.propose(props)

    got = _run(spec, prompts, n, propose)
    assert sorted(seen) == [0, 1]  # both proposing rows were verified: kept runs of 2 (row 1), up to 4 (row 0)
    assert [r.all_tokens for r in got] == [r.all_tokens for r in expected]
    for rg, re in zip(got, expected):
        for cg, ce in zip(rg.prompt_cache, re.prompt_cache):
            assert cg.offset == ce.offset
            assert mx.allclose(cg.state[0], ce.state[0], atol=1e-4).item()
            assert mx.allclose(cg.state[1], ce.state[1], atol=1e-4).item()
