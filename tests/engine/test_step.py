"""Tandem's decode step (``app.engine.step``) on tiny random models of every cache kind.

Each test drives ``DecodeBatch`` directly, greedily, and compares it with the same rows run
alone: batching, verifying proposals, resuming and restoring must never change a row's
tokens. The zoo (tests/fixtures/zoo.py) covers plain KV, sliding windows (rotating),
recurrent state (Mamba, gated delta-net, short convolutions) and MoE.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load

from app.engine.kv.layers import at_checkpoint, kinds
from app.engine.mlx_internals import make_prompt_cache
from app.engine.step import DecodeBatch, Drawn, RowProposal, ScoreSpec
from tests.fixtures.zoo import ZOO

KINDS = ("llama", "qwen3_5", "gemma3_text", "nemotron_h", "lfm2", "gpt_oss", "granitemoehybrid", "gemma4_text")
# One of each cache mix, for the longer tests.
MIXES = ("llama", "qwen3_5", "gemma3_text")
PROMPTS = [list(range(100, 131)), list(range(200, 205)), list(range(300, 347))]


@pytest.fixture(scope="module")
def models(zoo_model):
    loaded: dict[str, object] = {}

    def get(name: str):
        if name not in loaded:
            loaded[name] = load(str(zoo_model(name)))[0]
        return loaded[name]

    return get


def batch(model, **kw) -> DecodeBatch:
    settings = {"stop_tokens": (), "prefill_step_size": 8, "prefill_batch_size": 4, "completion_batch_size": 4}
    return DecodeBatch(model, **{**settings, **kw})


def finish(b: DecodeBatch, uids: list[int], before_step=lambda: None) -> dict[int, object]:
    """Step until every row of ``uids`` finished; each one's last response."""
    done: dict[int, object] = {}
    for _ in range(500):
        if len(done) == len(uids):
            return done
        before_step()
        for r in b.next()[1]:
            if r.finish_reason is not None and r.uid in uids:
                done[r.uid] = r
    raise AssertionError("rows never finished")


def alone(model, prompt: list[int], n: int) -> list[int]:
    b = batch(model)
    (uid,) = b.insert_segments([[prompt]], max_tokens=[n])
    return finish(b, [uid])[uid].all_tokens[len(prompt):]


@pytest.mark.parametrize("name", KINDS)
def test_a_batch_gives_each_row_its_lone_tokens(models, name):
    """Prompts of different lengths, prefilled together in chunks (right-padded, rolled
    left), then decoded together: each row's tokens are its lone tokens, whatever its
    layers keep (the model's own make_cache: ``ZOO[name].kinds``)."""
    model = models(name)
    assert sorted(set(type(c).__name__ for c in make_prompt_cache(model))) == sorted(set(ZOO[name].kinds))
    b = batch(model)
    uids = b.insert_segments([[p] for p in PROMPTS], max_tokens=[6, 9, 4])
    got = finish(b, uids)
    for uid, prompt, n in zip(uids, PROMPTS, (6, 9, 4)):
        assert got[uid].all_tokens[len(prompt):] == alone(model, prompt, n), f"row {uid}"


@pytest.mark.parametrize("name", MIXES)
def test_verified_proposals_keep_the_plain_tokens_and_the_kv(models, name):
    """Rows proposing right and wrong tokens (and one proposing nothing): the emitted tokens
    and each finished row's KV are plain decoding's. Where a layer cannot trim (windows,
    recurrent state) the step restores its snapshot and replays what each row kept."""
    model = models(name)
    n = 12
    expected = [alone(model, p, n) for p in PROMPTS]
    b = batch(model)
    uids = b.insert_segments([[p] for p in PROMPTS], max_tokens=[n] * 3)
    outcomes: dict[int, list] = {}

    def propose():
        for uid, o in b.outcomes.items():
            outcomes.setdefault(uid, []).append(o)
        props = {}
        for uid in b.pending():
            done = len(b.context(uid)) - len(PROMPTS[uid]) + 1
            truth = expected[uid][done:done + 3]
            if uid == 1:  # wrong from its second token on
                truth = [*truth[:1], *(t + 1 for t in truth[1:])]
            if uid != 2 and truth:
                props[uid] = RowProposal(tuple(truth))
        b.propose(props)

    got = finish(b, uids, propose)
    for uid, prompt in zip(uids, PROMPTS):
        assert got[uid].all_tokens[len(prompt):] == expected[uid]
    assert set(outcomes) == {0, 1} and any(o.accepted for o in outcomes[0])
    # The finished rows' KV continues as plain decoding's would.
    plain = batch(model)
    ref = finish(plain, plain.insert_segments([[p] for p in PROMPTS], max_tokens=[n] * 3), lambda: None)
    for uid in uids:
        _same_next_logits(model, got[uid].prompt_cache, ref[uid].prompt_cache)


def _same_next_logits(model, a, b) -> None:
    x = mx.array([[7]])
    la, lb = model(x, cache=list(a)), model(x, cache=list(b))
    assert mx.allclose(la, lb, atol=1e-4).item()


@pytest.mark.parametrize("name", MIXES)
def test_a_checkpoint_restores_a_row_where_its_prompt_ended(models, name):
    """With checkpoints on, a row keeps each untrimmable layer's state where its prompt's
    prefill ended; its finished KV restored there (``at_checkpoint``) continues exactly as a
    fresh prefill of that prompt does."""
    model = models(name)
    prompt = PROMPTS[2]
    b = batch(model, checkpoints=True)
    (uid,) = b.insert_segments([[prompt]], max_tokens=[5])
    last = finish(b, [uid])[uid]
    cache = last.prompt_cache
    if all(k in ("kv", "quantized") for k in kinds(list(cache))):
        assert cache.checkpoints == [] or all(s is None for _, st in cache.checkpoints for s in st)
    points = dict(cache.checkpoints)
    assert len(prompt) - 1 in points  # the held-back last token is fed by the first decode step
    restored = at_checkpoint(list(cache), len(prompt) - 1, points[len(prompt) - 1])
    fresh = make_prompt_cache(model)
    model(mx.array([prompt[:-1]]), cache=fresh)
    _same_next_logits(model, restored, fresh)


@pytest.mark.parametrize("name", MIXES)
def test_a_row_taken_out_resumes_with_the_token_it_drew(models, name):
    """A decoding row removed with its KV and re-inserted with the token it had drawn (``Drawn``)
    emits what it would have: the drawn token first, then the same tokens, on any cache kind."""
    model = models(name)
    prompt, n = PROMPTS[0], 10
    expected = alone(model, prompt, n)
    b = batch(model)
    (uid,) = b.insert_segments([[prompt]], max_tokens=[n])
    emitted: list[int] = []
    while len(emitted) < 4:
        emitted += [r.token for r in b.next()[1] if r.uid == uid]
    token, lp = b.pending_of(uid)
    cache, tokens = b.remove([uid], return_prompt_caches=True)[uid]
    (again,) = b.insert_segments([[[token]]], max_tokens=[n - len(emitted)], caches=[cache], all_tokens=[tokens],
                                 drawn=[Drawn(lp)])
    rest = finish(b, [again])[again]
    assert emitted + rest.all_tokens[len(tokens):] == expected


@pytest.mark.parametrize("name", MIXES)
def test_score_rows_read_the_prompts_tail_in_one_pass(models, name):
    """A score row generates nothing: it gives its prompt's last ``tail`` tokens' and the
    ``next_tokens``' log-probabilities, which are what the model's own forward pass gives.
    Score rows batch with each other and beside decoding rows."""
    model = models(name)
    b = batch(model)
    chat = b.insert_segments([[PROMPTS[0]]], max_tokens=[5])
    prompts = [PROMPTS[2], PROMPTS[2][:-2] + [9, 11]]
    uids = b.insert_segments([[p] for p in prompts], max_tokens=[0, 0], scores=[ScoreSpec(2, (5, 6))] * 2)
    got = finish(b, [*uids, *chat])
    for uid, prompt in zip(uids, prompts):
        logits = model(mx.array([prompt]), cache=make_prompt_cache(model)).astype(mx.float32)[0]
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tail = [lp[len(prompt) - 3 + j, prompt[len(prompt) - 2 + j]].item() for j in range(2)]
        nxt = [lp[-1, t].item() for t in (5, 6)]
        assert got[uid].tail == pytest.approx(tail, abs=1e-3) and got[uid].next == pytest.approx(nxt, abs=1e-3)
    assert got[chat[0]].all_tokens[len(PROMPTS[0]):] == alone(model, PROMPTS[0], 5)


def test_a_row_removed_in_prefill_leaves_the_others_as_they_were(models):
    model = models("qwen3_5")
    b = batch(model)
    uids = b.insert_segments([[p] for p in PROMPTS], max_tokens=[6, 6, 6])
    b.next()
    b.remove([uids[2]])
    got = finish(b, uids[:2])
    for uid, prompt in zip(uids[:2], PROMPTS):
        assert got[uid].all_tokens[len(prompt):] == alone(model, prompt, 6)
