"""Prefill-only score rows (the step's score rows, through the engine) on a real tiny model: the scores are
the model's own log-probabilities, read at the right positions, whatever batch they ran in."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest

from app.engine.prompt import TokenPrompt
from app.engine.types import GenerationRequest, ScoreRequest
from app.errors import InvalidRequestError
from tests.engine.engines import make_engine, run


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = make_engine(tiny_model_dir, max_num_seqs=8)
    yield eng
    eng.worker.stop()


def tokens(engine, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text, add_special_tokens=False))


def direct(engine, ids: list[int]) -> mx.array:
    """The model's log-probabilities at every position of ``ids``, one plain forward pass."""

    def forward() -> list[list[float]]:
        logits = engine.loaded.model(mx.array([ids]))[0].astype(mx.float32)
        return (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).tolist()

    return engine.worker.submit(forward).result()


def expected(engine, ids: list[int], score: ScoreRequest) -> tuple[list[float], list[float]]:
    lp = direct(engine, ids)
    n = len(ids)
    tail = [lp[p - 1][ids[p]] for p in range(n - score.tail, n)]
    return tail, [lp[n - 1][t] for t in score.next_tokens]


def score_req(ids: list[int], score: ScoreRequest, prefix: int | None = None, **kw) -> GenerationRequest:
    return GenerationRequest(TokenPrompt(ids), max_tokens=0, score=score, cache_prefix_len=prefix, **kw)


def test_a_row_reads_the_model_own_log_probabilities(engine):
    ids = tokens(engine, "The quick brown fox jumps over the lazy dog")
    score = ScoreRequest(tail=3, next_tokens=(5, 17, 300))
    text, last = asyncio.run(run(engine, score_req(ids, score)))
    assert text == "" and last.finish_reason == "scored" and last.completion_tokens == 0
    assert last.prompt_tokens == len(ids)
    tail, nexts = expected(engine, ids, score)
    assert last.scores is not None
    assert last.scores.tail == pytest.approx(tail, abs=1e-4)
    assert last.scores.next_tokens == pytest.approx(nexts, abs=1e-4)
    assert engine.admission.reserved == 0 and engine.admission.running == 0


def test_rows_of_one_request_share_the_prefix_and_each_reads_its_own(engine):
    """A decision's rows: one shared input, questions of different lengths, and one question's
    options as whole sequences (the same stem): every score is what the model gives each
    prompt alone, and the input's KV is computed once, then served from the prefix cache."""
    head = tokens(engine, "A long shared input about cats and dogs and the weather in Paris today. " * 3)
    q1, q2 = tokens(engine, " Is it sunny?"), tokens(engine, " Which animal is mentioned first, or at all?")
    blue_whale, blue_jay = tokens(engine, " blue whale"), tokens(engine, " blue jay")
    rows = [
        (head + q1, ScoreRequest(next_tokens=(10, 20))),
        (head + q2, ScoreRequest(next_tokens=(30,))),
        (head + q2 + blue_whale, ScoreRequest(tail=len(blue_whale))),
        (head + q2 + blue_jay, ScoreRequest(tail=len(blue_jay))),
    ]
    reqs = [score_req(ids, s, prefix=len(head), share_prefix=True, cache_namespace="rows") for ids, s in rows]

    async def together():
        return await asyncio.gather(*(run(engine, r) for r in reqs))

    results = [last for _, last in asyncio.run(together())]
    for (ids, score), last in zip(rows, results):
        tail, nexts = expected(engine, ids, score)
        assert last.scores.tail == pytest.approx(tail, abs=1e-4)
        assert last.scores.next_tokens == pytest.approx(nexts, abs=1e-4)
    # One row computed the input and wrote it to the cache; the others waited for it and read it
    # (the rows about q2 then prefill their stems side by side, in one batch).
    assert sum(last.cache_write_tokens for last in results) == len(head)
    assert [last.cached_tokens for last in results] == [0, len(head), len(head), len(head)]
    # A later request about the same input starts from the cached input.
    _, again = asyncio.run(run(engine, reqs[0]))
    assert again.cached_tokens == len(head) and again.cache_write_tokens == 0
    assert again.scores.next_tokens == pytest.approx(results[0].scores.next_tokens, abs=1e-4)


def test_chat_beside_scoring_is_its_lone_answer(engine):
    chat = GenerationRequest(TokenPrompt(tokens(engine, "Tell me a story about a fox")), max_tokens=12)
    lone, _ = asyncio.run(run(engine, chat))
    scores = [score_req(tokens(engine, f"Statement {i}: the fox is red."), ScoreRequest(next_tokens=(1, 2)))
              for i in range(5)]

    async def together():
        return await asyncio.gather(run(engine, chat), *(run(engine, s) for s in scores))

    beside = asyncio.run(together())
    assert beside[0][0] == lone
    assert all(last.finish_reason == "scored" for _, last in beside[1:])


@pytest.mark.parametrize("score", [ScoreRequest(), ScoreRequest(tail=50), ScoreRequest(next_tokens=(10**9,))])
def test_a_row_that_cannot_be_read_fails_alone(engine, score):
    ids = tokens(engine, "Short prompt here")
    with pytest.raises(InvalidRequestError):
        asyncio.run(run(engine, score_req(ids, score)))
    assert engine.in_flight == 0 and engine.admission.reserved == 0
    _, ok = asyncio.run(run(engine, score_req(ids, ScoreRequest(next_tokens=(1,)))))
    assert ok.finish_reason == "scored"


def test_rows_score_over_a_quantized_kv_cache(tmp_path_factory, demo_model_dir):
    """kv_cache_bits: the prefix cache holds quantized KV, and the score rows' batch is
    merged, padded, rolled and expanded over it (kv_quant's batch cache); the scores are the
    model's own, within what 8-bit KV changes."""
    from tests.fixtures.tiny_llama import build_tiny_llama

    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64, "rms_norm_eps": 1e-5,
              "vocab_size": 49152, "rope_theta": 10000.0, "max_position_embeddings": 2048,
              "tie_word_embeddings": True}
    path = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-q"), demo_model_dir, config)
    eng = make_engine(path, kv_cache_bits=8)
    try:
        head = tokens(eng, "A shared input about the weather in Paris and in Rome. " * 2)
        rows = [(head + tokens(eng, " Sunny?"), ScoreRequest(next_tokens=(10, 20))),
                (head + tokens(eng, " Which city is first?") + tokens(eng, " Paris"), ScoreRequest(tail=1)),
                (head + tokens(eng, " Which city is first?") + tokens(eng, " Rome"), ScoreRequest(tail=1))]

        async def together():
            return await asyncio.gather(*(run(eng, score_req(ids, s, prefix=len(head), share_prefix=True))
                                          for ids, s in rows))

        for (ids, score), (_, last) in zip(rows, asyncio.run(together())):
            tail, nexts = expected(eng, ids, score)
            assert last.scores.tail == pytest.approx(tail, abs=0.05)
            assert last.scores.next_tokens == pytest.approx(nexts, abs=0.05)
        assert eng.prompt_cache.nbytes > 0  # the input, kept (quantized) for later requests
    finally:
        eng.worker.stop()
