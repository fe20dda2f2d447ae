"""Encoders on real models: the embedded all-MiniLM-L6-v2, and a tiny random
ModernBERT cross-encoder (the one cross-encoder kind mlx-embeddings loads)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from app.config.schema import EncoderParams
from app.engine.models.builtin_models import (
    MARKER_NAME,
    ensure_builtin,
    ensure_minilm,
    minilm_dir,
)
from app.engine.models.encoder import Ranking, load_encoder, plan_batches
from app.engine.worker import MLXWorker
from app.errors import ConfigError, ContextLengthError, InvalidRequestError
from app.pipeline.request import RerankRequest
from app.pipeline.request import encoder_inputs as typed
from app.specs import encoder_limits
from tests.fixtures.tiny_reranker import build_tiny_reranker

SENTENCES = [
    "A cat sits on the mat.",
    "Dogs are loyal animals that love to play fetch in the park every single morning.",
    "The central bank raised interest rates again.",
    "Hi",
    "A kitten is sleeping on a rug in the warm afternoon sun, next to an old grey dog.",
    "Quantum computers use qubits.",
    "Tomato soup needs salt.",
]

# An embedding entry's limits with models.yaml's defaults.
DEFAULT_LIMITS = encoder_limits(EncoderParams())


@pytest.fixture(scope="module")
def minilm(minilm_dir: Path):
    # A small max_batch so that a request of SENTENCES spans several padded batches.
    return load_encoder(minilm_dir, name="minilm", limits=encoder_limits(EncoderParams(max_batch=3, max_inputs=16)))


@pytest.fixture(scope="module")
def wordpiece(minilm_dir: Path) -> Tokenizer:
    """MiniLM's own tokenizer, as a client would use it to send token ids."""
    tok = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return tok


def cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_matches_sentence_transformers_reference(minilm):
    # The similarity matrix printed in sentence-transformers' quickstart for this model.
    sentences = ["The weather is lovely today.", "It's so sunny outside!", "He drove to the stadium."]
    vectors = minilm.embed(typed(sentences)).vectors
    expected = np.array([[1.0, 0.6660, 0.1046], [0.6660, 1.0, 0.1411], [0.1046, 0.1411, 1.0]])
    np.testing.assert_allclose(vectors @ vectors.T, expected, atol=1e-3)


def test_batched_equals_single(minilm):
    batched = minilm.embed(typed(SENTENCES))
    assert batched.vectors.shape == (len(SENTENCES), 384) and batched.vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(batched.vectors, axis=1), 1.0, atol=1e-5)
    for i, sentence in enumerate(SENTENCES):
        alone = minilm.embed(typed(sentence))
        assert alone.token_counts == [batched.token_counts[i]]
        np.testing.assert_allclose(batched.vectors[i], alone.vectors[0], atol=1e-5)
    assert len(set(batched.token_counts)) > 3  # the batches really were padded


def test_similar_sentences_are_closer_than_unrelated(minilm):
    cat, dog, bank, _, kitten, *_ = minilm.embed(typed(SENTENCES)).vectors
    assert cos(cat, kitten) > cos(cat, bank) + 0.2
    assert cos(cat, dog) > cos(cat, bank)


def test_token_ids_equal_the_string(minilm, wordpiece):
    ids = [wordpiece.encode(s).ids for s in SENTENCES[:3]]
    from_ids = minilm.embed(typed(ids))
    from_text = minilm.embed(typed(SENTENCES[:3]))
    assert from_ids.token_counts == from_text.token_counts == [len(i) for i in ids]
    np.testing.assert_allclose(from_ids.vectors, from_text.vectors, atol=1e-6)
    # One flat list of ids is one input; strings and id lists may mix.
    np.testing.assert_allclose(minilm.embed(typed(ids[0])).vectors[0], from_text.vectors[0], atol=1e-6)
    mixed = minilm.embed(typed([SENTENCES[0], ids[1]]))
    np.testing.assert_allclose(mixed.vectors, from_text.vectors[:2], atol=1e-6)


def test_over_length_is_cut_by_default_and_counted(minilm):
    """models.yaml ``truncate`` is on unless an entry says otherwise: what was cut is counted."""
    assert minilm.limits.truncate
    out = minilm.embed(typed(["short", "word " * 300, "word " * 260]))
    assert out.token_counts == [3, 256, 256]
    assert (out.truncated_inputs, out.truncated_tokens) == (2, 302 - 256 + 262 - 256)
    whole = minilm.embed(typed(["short"]))
    assert (whole.truncated_inputs, whole.truncated_tokens) == (0, 0)


def test_over_length_is_refused_when_truncation_is_off(minilm):
    assert minilm.max_length == 256  # sentence-transformers' max_seq_length for this model
    with pytest.raises(ContextLengthError) as err:
        minilm.embed(typed(["short", "word " * 300]), truncate=False)
    assert err.value.status_code == 400 and err.value.param == "input"
    assert err.value.code == "context_length_exceeded"
    assert "input[1]" in err.value.message and "302 tokens" in err.value.message and "256" in err.value.message


def test_truncate_keeps_the_first_tokens(minilm, wordpiece):
    long_text = " ".join(f"w{i % 50}" for i in range(400))
    ids = wordpiece.encode(long_text).ids
    cut = minilm.embed(typed(long_text), truncate=True)
    assert cut.token_counts == [256]
    # A truncated string keeps its closing [SEP]; token ids are cut as given.
    expected = minilm.embed(typed(ids[:255] + [ids[-1]]))
    np.testing.assert_allclose(cut.vectors, expected.vectors, atol=1e-5)
    cut_ids = minilm.embed(typed([ids]), truncate=True)
    assert cut_ids.token_counts == [256]
    np.testing.assert_allclose(cut_ids.vectors, minilm.embed(typed(ids[:256])).vectors, atol=1e-6)


def test_a_megabyte_input_is_tokenized_by_its_head(minilm, wordpiece):
    """A 1 MB string costs the tokens that can be kept, and gives exactly what tokenizing
    all of it and truncating gives."""
    import time

    huge = " ".join(f"word{i % 97} and more" for i in range(70_000))  # ~1 MB, ~280k tokens
    started = time.perf_counter()
    full = wordpiece.encode(huge).ids
    whole_s = time.perf_counter() - started
    started = time.perf_counter()
    (ids,) = minilm.tokenize(typed(huge), truncate=True).ids
    head_s = time.perf_counter() - started
    assert ids == full[:255] + full[-1:]
    assert head_s < whole_s / 10, (head_s, whole_s)
    with pytest.raises(ContextLengthError) as err:
        minilm.tokenize(typed(huge), truncate=False)
    assert "has at least" in err.value.message and "256" in err.value.message
    # Mostly whitespace: the head holds too few tokens, so all of it is read.
    sparse = "cat" + " " * 50_000 + "dog"
    assert minilm.tokenize(typed(sparse), truncate=True).ids == [wordpiece.encode(sparse).ids]


def test_tokenize_from_many_threads_at_once(minilm):
    """Requests tokenize in a thread pool, concurrently, on one shared Tokenizer."""
    from concurrent.futures import ThreadPoolExecutor

    batches = [[f"{s} {i} " * 8 for s in SENTENCES] * 2 for i in range(16)]
    alone = [minilm.tokenize(typed(b)) for b in batches]
    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(minilm.tokenize, map(typed, batches))) == alone


@pytest.mark.parametrize(
    ("inputs", "fragment"),
    [
        ([], "must not be empty"),
        (None, "must be a string"),
        ("", "empty string"),
        (["ok", None], "input[1] is null"),
        (["ok", ""], "input[1] is an empty string"),
        ([[]], "empty list of token ids"),
        ([[101, -1]], "input[0][1] = -1"),
        ([101, 30522], "input[1] = 30522"),  # one input given as ids: the bad id's index
        ([[101, 30522]], "0 to 30521"),
        # LangChain's OpenAIEmbeddings sends tiktoken's cl100k ids unless told to send the text.
        ([[9906, 100256]], "another tokenizer's ids"),
        ([[9906, 100256]], "check_embedding_ctx_length=False"),
        ([[101, 1.5]], "input[0][1] = 1.5"),
        ([True, False], "input[0] must be a string or a list of token ids"),
        ([{"text": "x"}], "input[0] must be a string"),
        ({"input": "x"}, "must be a string, a list of strings"),
        (["x"] * 17, "17 items; at most 16"),
    ],
)
def test_bad_inputs_are_400s(minilm, inputs, fragment):
    """Shape errors come from building the request (``typed``), vocabulary and count ones from
    the encoder: the client sees one 400 either way."""
    with pytest.raises(InvalidRequestError) as err:
        minilm.embed(typed(inputs))
    assert err.value.status_code == 400 and err.value.param == "input"
    assert fragment in err.value.message


def test_rerank_puts_the_cat_document_first(minilm):
    docs = [
        "The stock market closed higher on Friday.",
        "Cats love to eat fish, and most cats enjoy chicken too.",
        "A recipe for tomato soup with basil.",
        "Dogs need a walk twice a day.",
    ]
    ranking = minilm.rerank("What food do cats like?", docs)
    assert isinstance(ranking, Ranking) and len(ranking.scores) == len(docs)
    best = ranking.top()
    assert best[0][0] == 1
    assert [s for _, s in best] == sorted(ranking.scores, reverse=True)
    assert ranking.top(2) == best[:2]
    # Cosine scores are the embeddings' own cosines.
    q, *d = minilm.embed(typed(["What food do cats like?", *docs])).vectors
    np.testing.assert_allclose(ranking.scores, [cos(q, v) for v in d], atol=1e-5)
    assert ranking.prompt_tokens == sum(minilm.embed(typed(["What food do cats like?", *docs])).token_counts)


@pytest.mark.parametrize(
    ("query", "documents", "param", "fragment"),
    [
        ("q", [], "documents", "must not be empty"),
        ("q", ["a", None], "documents", "documents[1] is null"),
        ("q", ["a", ""], "documents", "documents[1] is an empty string"),
        ("q", "just one string", "documents", "must be a list of strings"),
        ("", ["a"], "query", "query is an empty string"),
        (None, ["a"], "query", "query is null"),
        ("q", ["a"] * 17, "documents", "at most 16"),
        ("q", ["word " * 300], "documents", "302 tokens"),
    ],
)
def test_bad_rerank_requests_are_400s(minilm, query, documents, param, fragment):
    with pytest.raises(InvalidRequestError) as err:
        req = RerankRequest.of("minilm", query, documents, truncate=False)
        minilm.rerank(req.query, req.documents, truncate=req.truncate)
    assert err.value.param == param and fragment in err.value.message


def test_steps_run_on_the_worker_one_batch_at_a_time(minilm):
    worker = MLXWorker()
    worker.start()
    try:
        steps = []

        def counted():
            gen = minilm.embed_steps(typed(SENTENCES))
            result = yield from _count(gen, steps)
            return result

        result = worker.submit_steps(counted).result(timeout=60)
    finally:
        worker.stop()
    assert len(steps) == len(plan_batches(result.token_counts, minilm.limits)) == 3
    np.testing.assert_allclose(result.vectors, minilm.embed(typed(SENTENCES)).vectors, atol=1e-6)


def _count(gen, steps):
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value
        steps.append(1)
        yield


@pytest.mark.parametrize(("max_batch", "max_tokens"), [(1, 10_000), (3, 10_000), (32, 40), (4, 1)])
def test_plan_batches_respects_both_limits(max_batch, max_tokens):
    lengths = [5, 17, 3, 9, 9, 30, 1, 12, 8]
    batches = plan_batches(lengths, replace(DEFAULT_LIMITS, max_batch=max_batch, max_batch_tokens=max_tokens))
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        assert len(b) <= max_batch
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= max_tokens


# ---- cross-encoder -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, minilm_dir):
    out = build_tiny_reranker(tmp_path_factory.mktemp("tiny-reranker"), minilm_dir / "tokenizer.json")
    return load_encoder(out, name="tiny-reranker", limits=encoder_limits(EncoderParams(max_batch=2)))


def test_cross_encoder_scores_pairs_batched_as_alone(reranker):
    assert reranker.kind == "cross-encoder" and reranker.max_length == 64
    docs = ["cats sleep a lot", "the market fell sharply after the announcement today", "a", "dogs bark at night"]
    ranking = reranker.rerank("where do cats sleep?", docs)
    assert all(0.0 < s < 1.0 for s in ranking.scores)
    alone = [reranker.rerank("where do cats sleep?", [d]).scores[0] for d in docs]
    np.testing.assert_allclose(ranking.scores, alone, atol=1e-5)
    with pytest.raises(InvalidRequestError, match="is a reranker"):
        reranker.embed(typed("cats"))


def test_the_engine_runs_rerank_jobs_in_turns(reranker):
    """EncoderEngine on a real worker: two cross-encoder jobs at once, each as ``rerank`` scores
    it alone, their batches taking turns (max_batch 2: several batches each)."""
    import asyncio

    from app.engine.batch.encoder_engine import EncoderEngine

    docs = ["cats sleep a lot", "the market fell sharply", "a", "dogs bark at night", "rain", "sun and sea"]
    worker = MLXWorker()
    worker.start()
    try:
        engine = worker.submit(
            lambda: EncoderEngine(worker, reranker, max_queue=64, queue_timeout_s=120.0)
        ).result(timeout=30)

        async def both() -> list:
            jobs = [engine.encode(lambda q=q: reranker.prepare_rerank(q, docs)) for q in ("cats?", "weather?")]
            return [reranker.ranking(*r) for r in await asyncio.gather(*jobs)]

        rankings = asyncio.run(both())
        for query, ranking in zip(("cats?", "weather?"), rankings):
            np.testing.assert_allclose(ranking.scores, reranker.rerank(query, docs).scores, atol=1e-5)
        stats = engine.stats()
        assert stats.jobs == {"done": 2} and stats.running == stats.waiting == 0 and stats.batches >= 6
    finally:
        worker.stop()


def test_cross_encoder_over_length_pair(reranker):
    long_doc = "word " * 80
    with pytest.raises(ContextLengthError, match="query and document together have"):
        reranker.rerank("cats", ["short", long_doc], truncate=False)
    ranking = reranker.rerank("cats", ["short", long_doc])  # the model's default: cut
    assert ranking.prompt_tokens == 5 + 64  # [CLS] cats [SEP] short [SEP], then the cut pair
    assert ranking.truncated_inputs == 1 and ranking.truncated_tokens == (3 + 80 + 1) - 64  # the pair had 84


def test_bert_cross_encoder_is_refused_with_the_reason(tmp_path):
    config = {"model_type": "bert", "architectures": ["BertForSequenceClassification"], "id2label": {"0": "LABEL_0"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="sequence-classification head for ModernBERT only"):
        load_encoder(tmp_path, limits=DEFAULT_LIMITS)


def test_unknown_model_type_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="not a text embedding model"):
        load_encoder(tmp_path, limits=DEFAULT_LIMITS)


# ---- the builtin ---------------------------------------------------------------------------


def test_builtin_unpacks_once_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    leftover = tmp_path / "models" / ".all-minilm-l6-v2.partial-crashed"
    leftover.mkdir(parents=True)
    out = ensure_builtin("all-minilm-l6-v2", progress=False)
    assert out == minilm_dir() == tmp_path / "models" / "all-minilm-l6-v2"
    assert {"config.json", "model.safetensors", "tokenizer.json", MARKER_NAME} <= {p.name for p in out.iterdir()}
    assert not leftover.exists()
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert ensure_minilm(progress=False) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp  # not unpacked again
    (out / MARKER_NAME).write_text("{}")  # a stale or foreign copy is redone
    ensure_minilm(progress=False)
    assert json.loads((out / MARKER_NAME).read_text())["source"] == "model.zip"


def test_unknown_builtin_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown builtin model 'nope'"):
        ensure_builtin("nope")
