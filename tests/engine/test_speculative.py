"""Speculative decoding in the batch on a real tiny model: the output is the output without it.

Verify steps on this CPU cost more than plain ones, so the adaptive rule would switch most
proposals off; these engines take verify steps as free (``FreeVerify``, the seam for step
costs) so that every proposal is verified, which is what exactness has to survive.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import replace

import mlx.core as mx
import pytest

from app.engine.constrain.constraints import JsonSchema
from app.engine.constrain.grammar import compiler_for
from app.engine.prompt import TokenPrompt
from app.engine.speculative.adaptive import FreeVerify
from app.engine.types import GREEDY, GenerationRequest, SpeculationRequest
from tests.engine.engines import make_engine, run

OFF = SpeculationRequest(prompt_lookup=False)
PROMPTS = ("Write a short poem about the sea and the sky.", "Count from one to twenty, slowly.",
           "List three colours of the rainbow please.", "Say something about mountains and rivers.")


def free_engine(path, **params):
    eng = make_engine(path, **params)
    assert eng.speculator is not None
    eng.speculator.adaptive.costs = FreeVerify()
    return eng


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = free_engine(tiny_model_dir)
    yield eng
    eng.worker.stop()


def request(engine, text: str, max_tokens: int = 24, **kw) -> GenerationRequest:
    return GenerationRequest(TokenPrompt(engine.tokenizer.encode(text)), max_tokens=max_tokens, **kw)


def ids(engine, req: GenerationRequest) -> list[int]:
    """The plain (no speculation) output's token ids."""
    text, _ = asyncio.run(run(engine, replace(req, speculation=OFF)))
    return engine.tokenizer.encode(text)


def corrupted(tokens: list[int], every: int = 7) -> tuple[int, ...]:
    """A prediction that is the output with every ``every``-th token wrong."""
    return tuple(t if i % every != every - 1 else (t + 17) % 40000 for i, t in enumerate(tokens))


def spec_counts(engine) -> dict[str, tuple[int, int]]:
    return {k: (c.proposed, c.accepted) for k, c in engine.stats().speculation.items()}


def test_prediction_gives_the_plain_output_and_counts_what_it_kept(engine):
    req = request(engine, PROMPTS[0])
    plain, _ = asyncio.run(run(engine, replace(req, speculation=OFF)))
    before = spec_counts(engine).get("prediction", (0, 0))
    prediction = corrupted(engine.tokenizer.encode(plain))
    text, last = asyncio.run(run(engine, replace(req, speculation=SpeculationRequest(prediction, False))))
    assert text == plain
    assert last.accepted_prediction_tokens > 0
    assert last.accepted_prediction_tokens + last.rejected_prediction_tokens == len(prediction)
    proposed, accepted = spec_counts(engine)["prediction"]
    assert accepted - before[1] == last.accepted_prediction_tokens and proposed > before[0]


def test_prompt_lookup_on_a_repetitive_prompt_gives_the_plain_output(engine):
    req = request(engine, "one two three four five six seven eight " * 6, max_tokens=32)
    plain, _ = asyncio.run(run(engine, replace(req, speculation=OFF)))
    before = spec_counts(engine).get("prompt_lookup", (0, 0))
    text, last = asyncio.run(run(engine, req))  # the model's default: prompt lookup on
    assert text == plain
    assert last.accepted_prediction_tokens == last.rejected_prediction_tokens == 0
    assert spec_counts(engine)["prompt_lookup"][0] > before[0]


def test_a_mixed_batch_where_some_rows_speculate_gives_each_its_plain_output(engine):
    reqs = [request(engine, p, max_tokens=20) for p in PROMPTS]
    plains = [asyncio.run(run(engine, replace(r, speculation=OFF)))[0] for r in reqs]
    mixed = [replace(r, speculation=SpeculationRequest(corrupted(engine.tokenizer.encode(t), 5), False))
             if i % 2 == 0 else replace(r, speculation=OFF) for i, (r, t) in enumerate(zip(reqs, plains))]
    # n > 1: the same request twice in the batch, one of its choices speculating.
    mixed.append(replace(mixed[0], speculation=OFF))

    async def together():
        return await asyncio.gather(*(run(engine, r) for r in mixed))

    out = asyncio.run(together())
    assert [t for t, _ in out] == [*plains, plains[0]]
    assert out[0][1].accepted_prediction_tokens > 0 and out[2][1].accepted_prediction_tokens > 0


def test_max_tokens_and_stop_strings_cut_inside_an_accepted_run(engine):
    req = request(engine, PROMPTS[1], max_tokens=24)
    plain, _ = asyncio.run(run(engine, replace(req, speculation=OFF)))
    exact = SpeculationRequest(tuple(engine.tokenizer.encode(plain)), False)
    for n in (5, 7, 10):
        cut, _ = asyncio.run(run(engine, replace(req, max_tokens=n, speculation=OFF)))
        text, last = asyncio.run(run(engine, replace(req, max_tokens=n, speculation=exact)))
        assert text == cut and last.completion_tokens == n and last.finish_reason == "length"
    stop = plain[len(plain) // 2:len(plain) // 2 + 4]
    if not stop.strip():
        pytest.skip("the random model wrote whitespace there")
    text, last = asyncio.run(run(engine, replace(req, stop=(stop,), speculation=exact)))
    assert last.finish_reason == "stop" and text == plain[:plain.find(stop)]
    # The row left the batch mid-run; the next request is served as ever.
    assert asyncio.run(run(engine, replace(req, speculation=exact)))[0] == plain
    assert engine.admission.reserved == 0 and not engine._running


def test_logprobs_come_from_the_target_at_each_position(engine):
    req = request(engine, PROMPTS[2], max_tokens=12, logprobs=2)
    plain, p_last = asyncio.run(run(engine, replace(req, speculation=OFF)))

    async def deltas(r):
        return [d async for d in engine.stream(r)]

    base = asyncio.run(deltas(replace(req, speculation=OFF)))
    exact = SpeculationRequest(tuple(engine.tokenizer.encode(plain)), False)
    spec = asyncio.run(deltas(replace(req, speculation=exact)))
    a = [lp for d in base for lp in d.logprobs]
    b = [lp for d in spec for lp in d.logprobs]
    assert [x.token for x in a] == [x.token for x in b]
    assert [x.logprob for x in a] == pytest.approx([x.logprob for x in b], abs=1e-3)
    assert [[t for t, _ in x.top] for x in a] == [[t for t, _ in x.top] for x in b]
    assert spec[-1].accepted_prediction_tokens > 0


def test_json_schema_constraint_advances_only_over_accepted_tokens(engine):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    grammar = compiler_for(engine.tokenizer).compile(JsonSchema(schema))
    req = request(engine, "Give me a person as JSON.", max_tokens=30, constraint=grammar)
    plain, plain_last = asyncio.run(run(engine, replace(req, speculation=OFF)))
    tokens = engine.tokenizer.encode(plain)
    # Some proposals the grammar refuses (a letter where JSON punctuation must go), some it takes.
    refused = tuple(t if i % 4 else engine.tokenizer.encode("x")[0] for i, t in enumerate(tokens))
    for prediction in (refused, corrupted(tokens, 3), tuple(tokens)):
        text, last = asyncio.run(run(engine, replace(req, speculation=SpeculationRequest(prediction, False))))
        assert text == plain and last.finish_reason == plain_last.finish_reason
        assert last.accepted_prediction_tokens > 0


def test_quantized_kv_rolls_back_too(tmp_path_factory, demo_model_dir):
    from tests.engine.test_kv_quant import CONFIG
    from tests.fixtures.tiny_llama import build_tiny_llama

    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-hd64"), demo_model_dir, CONFIG,
                                 weights=lambda p: p * 2 if p.ndim == 2 else p)
    eng = free_engine(model_dir, kv_cache_bits=8)
    try:
        reqs = [request(eng, p, max_tokens=16) for p in PROMPTS[:3]]
        plains = [asyncio.run(run(eng, replace(r, speculation=OFF)))[0] for r in reqs]
        specs = [replace(r, speculation=SpeculationRequest(corrupted(eng.tokenizer.encode(t), 4), False))
                 for r, t in zip(reqs, plains)]

        async def together():
            return await asyncio.gather(*(run(eng, r) for r in specs))

        out = asyncio.run(together())
        assert [t for t, _ in out] == plains
        assert all(last.accepted_prediction_tokens > 0 for _, last in out)
    finally:
        eng.worker.stop()


def test_after_a_prefix_cache_hit_and_a_disk_restore(tiny_model_dir, tmp_path):
    system = "You are a careful assistant who answers briefly. " * 4
    eng = free_engine(tiny_model_dir, prompt_cache="prefix", prompt_cache_disk_mb=64,
                      prompt_cache_disk_dir=str(tmp_path))
    try:
        head = eng.tokenizer.encode(system)
        req = GenerationRequest(TokenPrompt(head + eng.tokenizer.encode(" Name a fruit.")), max_tokens=16,
                                cache_prefix_len=len(head))
        plain, cold = asyncio.run(run(eng, replace(req, speculation=OFF)))
        assert cold.cached_tokens == 0
        prediction = SpeculationRequest(corrupted(eng.tokenizer.encode(plain), 4), False)
        text, warm = asyncio.run(run(eng, replace(req, speculation=prediction)))
        assert warm.cached_tokens > 0 and text == plain and warm.accepted_prediction_tokens > 0
        # The conversation the speculating row stored goes on as plain decoding would.
        turn = req.prompt_tokens + eng.tokenizer.encode(plain) + eng.tokenizer.encode(" And another?")
        nxt = replace(req, prompt=TokenPrompt(turn))
        on, _ = asyncio.run(run(eng, replace(nxt, speculation=SpeculationRequest(prediction.prediction, False))))
        assert eng.finish_writes(30)
        eng.prompt_cache.trim_to(n_bytes=0)  # memory tier emptied: the next hit is the disk's
        restored, last = asyncio.run(run(eng, replace(nxt, speculation=SpeculationRequest(
            corrupted(eng.tokenizer.encode(on), 3), False))))
        assert last.cached_tokens > 0 and eng.stats().prompt_cache_tiers["disk"].hits >= 1
        cold_eng = make_engine(tiny_model_dir)
        try:
            assert restored == on == asyncio.run(run(cold_eng, replace(nxt, speculation=OFF)))[0]
        finally:
            cold_eng.worker.stop()
    finally:
        assert eng.finish_writes(30)
        eng.worker.stop()


def test_cancelled_mid_speculation_frees_the_row(engine):
    req = request(engine, PROMPTS[3], max_tokens=200)
    plain = ids(engine, replace(req, max_tokens=40))

    async def scenario():
        agen = engine.stream(replace(req, speculation=SpeculationRequest(tuple(plain) * 5, False)))
        for _ in range(6):
            await agen.__anext__()
        await agen.aclose()
        for _ in range(100):
            if engine.admission.running == 0:
                break
            await asyncio.sleep(0.02)

    asyncio.run(scenario())
    assert engine.admission.running == 0 and engine.admission.reserved == 0 and not engine._running
    again, _ = asyncio.run(run(engine, replace(req, max_tokens=40, speculation=OFF)))
    assert engine.tokenizer.encode(again) == plain


def test_seeded_sampling_is_the_same_with_speculation(engine):
    """A seeded row draws each token with its own key, split once per token: what it
    emits does not depend on what was proposed."""
    sampling = replace(GREEDY, temperature=0.8, top_k=8, seed=42)
    req = request(engine, PROMPTS[0], max_tokens=20, sampling=sampling)
    plain, _ = asyncio.run(run(engine, replace(req, speculation=OFF)))
    for prediction in (tuple(engine.tokenizer.encode(plain)), corrupted(engine.tokenizer.encode(plain), 3)):
        text, last = asyncio.run(run(engine, replace(req, speculation=SpeculationRequest(prediction, False))))
        assert text == plain and last.accepted_prediction_tokens > 0


def test_sampled_tokens_follow_the_models_distribution(engine):
    """Unseeded sampling: the first tokens' distribution with a prediction proposing is the
    one without (a two-sample chi-square test per position, fixed PRNG seeds)."""
    from scipy.stats import chi2_contingency

    sampling = replace(GREEDY, temperature=1.0, top_k=4)
    req = request(engine, PROMPTS[2], max_tokens=4, sampling=sampling)
    greedy = ids(engine, request(engine, PROMPTS[2], max_tokens=4))
    speculating = replace(req, speculation=SpeculationRequest(tuple(greedy), False))

    def sample(r, n, seed):
        mx.random.seed(seed)
        return [tuple(engine.tokenizer.encode(asyncio.run(run(engine, r))[0]))[:4] for _ in range(n)]

    n = 150
    plain, spec = sample(replace(req, speculation=OFF), n, 1), sample(speculating, n, 2)
    for pos in range(1, 3):
        a, b = Counter(s[pos] for s in plain if len(s) > pos), Counter(s[pos] for s in spec if len(s) > pos)
        keys = sorted(set(a) | set(b), key=lambda t: -(a[t] + b[t]))
        table = [[a[t] for t in keys], [b[t] for t in keys]]
        assert chi2_contingency(table).pvalue > 0.001, (pos, table)
    assert engine.stats().speculation["prediction"].accepted > 0


def test_speculating_rows_paused_for_interactive_work_resume_exactly(tiny_model_dir):
    """Background rows that speculate leave the batch with their KV when an interactive
    request arrives (a verify step's rollback left it exact) and come back to the output
    they have alone."""
    eng = free_engine(tiny_model_dir, max_num_seqs=4, prompt_cache="off")
    try:
        background = [request(eng, f"Background task number {i} writes a title", 60, priority="background")
                      for i in range(3)]
        alone = [asyncio.run(run(eng, replace(r, speculation=OFF)))[0] for r in background]
        background = [replace(r, speculation=SpeculationRequest(corrupted(eng.tokenizer.encode(t), 6), False))
                      for r, t in zip(background, alone)]
        chat = request(eng, "An interactive question " * 40, 4)

        async def rest(req, started):
            parts = []
            async for delta in eng.stream(req):
                parts.append(delta.text)
                started.set()
            return "".join(parts)

        async def mixed():
            events = [asyncio.Event() for _ in background]
            tasks = [asyncio.create_task(rest(r, e)) for r, e in zip(background, events)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
            await run(eng, chat)
            return await asyncio.gather(*tasks)

        before = eng.stats().background_pauses
        assert asyncio.run(mixed()) == alone
        assert eng.stats().background_pauses - before >= 2
        assert eng.stats().speculation["prediction"].accepted > 0
        assert eng.admission.reserved == 0 and not eng._running
    finally:
        eng.worker.stop()


class HotterSelf:
    """A draft source at the Protocol seam: the target model itself, sampled hotter (top 8
    at temperature 2), proposing with its log-probabilities, so rejection sampling (accept
    with min(1, p/q), else a draw from the residual) decides."""

    name = "draft"

    def __init__(self, model) -> None:
        self.model = model

    def open(self, prompt_tokens, k):
        return _HotterDrafter(self.model)


class _HotterDrafter:
    name = "draft"

    def __init__(self, model) -> None:
        self.model = model

    def propose(self, tokens, k):
        from mlx_lm.sample_utils import apply_top_k

        from app.engine.speculative import Proposal

        seq, logprobs = list(tokens), []
        for _ in range(k):
            logits = self.model(mx.array([seq]))[0, -1:]
            q = apply_top_k(logits - mx.logsumexp(logits, keepdims=True), 8) / 2.0
            q = q - mx.logsumexp(q, keepdims=True)
            seq.append(int(mx.random.categorical(q).item()))
            logprobs.append(q[0])
        return Proposal(self.name, tuple(seq[len(tokens):]), mx.stack(logprobs))

    def verified(self, proposal, accepted):
        pass

    def close(self):
        pass


@pytest.mark.slow  # its drafter recomputes the model over the whole sequence per token: a minute or two here
def test_a_sampled_draft_is_verified_by_rejection_sampling(tiny_model_dir):
    """A drafter that samples from its own q: the first tokens' distribution is still the
    target's (two-sample chi-square per position, fixed PRNG seeds)."""
    from scipy.stats import chi2_contingency

    from app.engine.batch.engine import TextEngine

    plain_eng = make_engine(tiny_model_dir)
    eng = TextEngine(plain_eng.worker, plain_eng.loaded, plain_eng.params, draft=HotterSelf(plain_eng.loaded.model))
    eng.speculator.adaptive.costs = FreeVerify()
    try:
        sampling = replace(GREEDY, temperature=1.0, top_k=4)
        req = request(eng, PROMPTS[1], max_tokens=4, sampling=sampling)

        def sample(engine, r, n, seed):
            mx.random.seed(seed)
            return [tuple(engine.tokenizer.encode(asyncio.run(run(engine, r))[0]))[:4] for _ in range(n)]

        n = 150
        plain = sample(plain_eng, replace(req, speculation=OFF), n, 3)
        spec = sample(eng, replace(req, speculation=SpeculationRequest(prompt_lookup=False)), n, 4)
        for pos in range(1, 3):
            a, b = Counter(s[pos] for s in plain if len(s) > pos), Counter(s[pos] for s in spec if len(s) > pos)
            keys = sorted(set(a) | set(b))
            assert chi2_contingency([[a[t] for t in keys], [b[t] for t in keys]]).pvalue > 0.001, (pos, a, b)
        counts = eng.stats().speculation["draft"]
        assert 0 < counts.accepted < counts.proposed  # some kept, some refused: both paths ran
    finally:
        eng.close()
        plain_eng.worker.stop()


def test_a_reasoning_budget_closes_where_it_would_without_speculation(tiny_ministral, demo_model_dir):
    """A row with a budget does not speculate while its budget could still force the closer
    (the budget processor reads its context token by token); its prediction is the model's
    unbudgeted thought, which the forced closer then departs from."""
    from tests.engine.test_reasoning_budget import ANSWER, THOUGHT_TOKENS, ministral_block
    from tests.fixtures.tiny_ministral import distinct_words

    words = distinct_words(demo_model_dir, THOUGHT_TOKENS, skip=("sunny",))
    script = f"[THINK]{''.join(words)}[/THINK]{ANSWER}"
    eng = free_engine(tiny_ministral(script), mem=256)
    try:
        tokens = eng.tokenizer.encode("<s>[INST]Weather in Paris?[/INST]", add_special_tokens=False)
        prediction = tuple(eng.tokenizer.encode(f"[THINK]{''.join(words[:30])}[/THINK]{ANSWER}",
                                                add_special_tokens=False))
        for budget in (3, 5, 8, 13, None):
            req = GenerationRequest(TokenPrompt(tokens), max_tokens=30, reasoning=ministral_block(eng, budget))
            plain, p_last = asyncio.run(run(eng, replace(req, speculation=OFF)))
            text, last = asyncio.run(run(eng, replace(req, speculation=SpeculationRequest(prediction, False))))
            assert text == plain and last.reasoning_tokens == p_last.reasoning_tokens
            if budget is None:  # no budget: nothing holds the row back
                assert last.accepted_prediction_tokens > 10
    finally:
        eng.worker.stop()


@pytest.mark.slow  # two 1,000-token rows, alone and together: about a minute here
def test_a_speculating_row_paused_for_memory_resumes_exactly(tmp_path_factory, demo_model_dir):
    """Two long rows that outgrow the KV budget while speculating: the newer one is paused
    (its KV, rolled back exact, to the prefix cache) and resumes to the output it has alone;
    the caches never hold more than the admission figure (``test_kv_accounting``'s check)."""
    from tests.engine.test_kv_accounting import CONFIG, MEM_MB, Sampler, prompt
    from tests.fixtures.tiny_llama import build_tiny_llama

    model_dir = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-kv"), demo_model_dir, CONFIG, seed=1)
    eng = free_engine(model_dir, mem=MEM_MB, max_num_seqs=4, prefill_chunk_size=128, prompt_cache="off",
                      prompt_cache_mem=8)
    try:
        reqs = [GenerationRequest(TokenPrompt(prompt(40 + i, 1 + i)), max_tokens=1000, speculation=OFF)
                for i in range(2)]
        alone = [asyncio.run(run(eng, r))[0] for r in reqs]
        specs = [replace(r, speculation=SpeculationRequest(corrupted(eng.tokenizer.encode(t), 9), False))
                 for r, t in zip(reqs, alone)]

        async def both():
            return await asyncio.gather(*(run(eng, r) for r in specs))

        with Sampler(eng) as sampler:
            out = asyncio.run(both())
        assert eng.memory_pauses >= 1
        assert [t for t, _ in out] == alone
        assert all(last.accepted_prediction_tokens > 0 for _, last in out)
        for held, figure, rows in sampler.samples:
            assert held <= figure <= MEM_MB * 2**20, (held, figure, rows)
    finally:
        eng.worker.stop()


def test_no_row_waits_for_its_first_token_behind_a_verify_step(engine):
    """Time to first token is what it is without speculation: the step in which an interactive
    row emits its first token carries no proposals, a verify step being dearer."""
    req = request(engine, PROMPTS[1], max_tokens=24)
    plain, _ = asyncio.run(run(engine, replace(req, speculation=OFF)))
    exact = replace(req, speculation=SpeculationRequest(tuple(engine.tokenizer.encode(plain)), False))
    steps: list[tuple[bool, bool]] = []
    propose = engine._propose

    def watched() -> None:
        propose()
        waiting = any(not s.prefilling and s.first_token is None for s in engine._running.values())
        steps.append((waiting, bool(engine._verify.planned())))

    engine._propose = watched
    try:
        async def staggered():
            first = asyncio.ensure_future(run(engine, exact))
            await asyncio.sleep(0.05)
            return await asyncio.gather(first, run(engine, replace(exact, prompt=TokenPrompt(
                engine.tokenizer.encode(PROMPTS[3])), speculation=OFF)))

        (text, _), _ = asyncio.run(staggered())
    finally:
        del engine._propose
    assert text == plain
    assert any(waiting for waiting, _ in steps) and any(proposed for _, proposed in steps)
    assert not any(waiting and proposed for waiting, proposed in steps)
