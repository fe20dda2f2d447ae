"""Encoder models on mlx-embeddings: sentence embeddings and reranking.

A model directory loads as one of two kinds (``Encoder.kind``):

    embedding      a bi-encoder (BERT, XLM-RoBERTa, ModernBERT, Qwen3, ... as
                   mlx-embeddings knows them): text -> one L2-normalised float32
                   vector. Serves embeddings, and reranking by the cosine
                   similarity of the query's vector and each document's.
    cross-encoder  a ``ModernBertForSequenceClassification`` checkpoint with one
                   label (e.g. gte-reranker-modernbert-base): (query, document)
                   -> sigmoid relevance in [0, 1]. Serves reranking only.
                   mlx-embeddings 0.1.0 has no classification head for BERT or
                   XLM-R, so their cross-encoders (ms-marco-MiniLM, bge-reranker)
                   are refused at load with a ConfigError.

Inputs are ``EncoderInputs`` (``encoder_inputs.py``): strings (tokenized with the
model's special tokens) or token ids (used exactly as given), shape-checked where
the request was built. A request is sorted by length and cut into
batches of at most ``max_batch`` inputs and ``max_batch_tokens`` padded tokens;
each batch is right-padded under an attention mask, so an input's vector does
not depend on its neighbours beyond float32 rounding.

Two halves, two threads. ``prepare_embed`` / ``prepare_rerank`` check and
tokenize a request: plain Python and the Rust tokenizer (which releases the
GIL and is never reconfigured once loaded), so a server runs them in a worker
thread, never on the MLX thread. ``forward`` runs one batch and belongs on the
MLX-owner thread; ``app.engine.batch.encoder_engine`` schedules a request's batches
there between chat steps. ``embed`` / ``rerank`` do both in one go, in process
(tests, benchmarks).

An input longer than ``max_length`` is cut to it when the model's ``truncate``
(``EncoderLimits``, models.yaml) or the request says so, else refused; ``Tokenized``
carries how many tokens were cut from each input, for the answer's usage and /metrics.
A string far longer than the model takes is tokenized by a prefix cut at a
word boundary (``_head``): a 1 MB input costs the tokens that can be kept, not
a megabyte of tokenizing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.utils import tree_flatten
from tokenizers import Tokenizer

from app.engine.mlx_internals import load_embedding_model
from app.engine.models.encoder_inputs import EncoderInputs, check_count, check_token_ids, over_length
from app.engine.params import EncoderLimits
from app.errors import ConfigError, EngineError, InvalidRequestError

log = logging.getLogger("tandem.engine")

# Tokens beyond max_length a prefix of a long string must hold for its cut to be invisible.
HEAD_MARGIN = 16

# Bi-encoders whose forward is (input_ids, attention_mask=) -> text_embeds (batch, dim).
EMBEDDING_TYPES = frozenset({"bert", "xlm_roberta", "modernbert", "qwen3", "gemma3_text", "llama_bidirec"})
# Types whose last_hidden_state is per token, so sentence-transformers' pooling
# config (1_Pooling/config.json) can be applied to it; the others pool inside the model.
_POOLABLE_TYPES = frozenset({"bert", "xlm_roberta"})
_POOLING_MODES = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_lasttoken": "lasttoken",
}
_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


@dataclass(frozen=True)
class Tokenized:
    """A request's token ids, one list per input (or per query-document pair), and how many
    tokens truncation cut from each (0: whole). A string far longer than the model takes
    is tokenized only by its head (``Encoder._head``): its count is what was cut from that."""

    ids: list[list[int]]
    cut: list[int]

    @property
    def truncated_inputs(self) -> int:
        return sum(1 for n in self.cut if n)

    @property
    def truncated_tokens(self) -> int:
        return sum(self.cut)


@dataclass(frozen=True)
class Embeddings:
    """The vectors of one request, in input order, and what each input cost."""

    vectors: np.ndarray  # (inputs, dim) float32, each row of L2 norm 1
    token_counts: list[int]
    # Inputs truncation cut, and the tokens it cut from them (``Tokenized``).
    truncated_inputs: int = 0
    truncated_tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        return sum(self.token_counts)


@dataclass(frozen=True)
class Ranking:
    """One relevance score per document, in document order."""

    scores: list[float]
    prompt_tokens: int
    truncated_inputs: int = 0
    truncated_tokens: int = 0

    def top(self, n: int | None = None) -> list[tuple[int, float]]:
        """``(document index, score)``, best first (ties: lower index first), at most ``n``."""
        order = sorted(range(len(self.scores)), key=lambda i: (-self.scores[i], i))
        return [(i, self.scores[i]) for i in order[: n if n is not None else len(order)]]


class Encoder:
    """A loaded embedding model or cross-encoder with its tokenizer (``load_encoder``)."""

    def __init__(
        self, name: str, model: nn.Module, tokenizer: Tokenizer, *, kind: str, model_type: str,
        max_length: int, vocab_size: int, pad_id: int, pooling: str, limits: EncoderLimits,
    ) -> None:
        self.name = name
        self.kind = kind
        self.model_type = model_type
        self.max_length = max_length
        self.vocab_size = vocab_size
        self.limits = limits
        self._model = model
        self._pad_id = pad_id
        self._pooling = pooling
        self._tokenizer = tokenizer
        # A second copy truncates; a Tokenizer is never reconfigured once shared.
        self._truncating = Tokenizer.from_str(tokenizer.to_str())
        self._truncating.enable_truncation(max_length)
        # A string longer than this many characters holds more tokens than max_length (plus a
        # margin) unless it is mostly whitespace: it is tokenized by a prefix (``_head``).
        longest = max(map(len, tokenizer.get_vocab()), default=1)
        self._head_chars = 2 * (max_length + HEAD_MARGIN) * (longest + 1)
        self.dim = 0 if kind == "cross-encoder" else int(self._embed_batch([[pad_id]]).shape[1])

    @property
    def weight_bytes(self) -> int:
        """Bytes of the loaded weights, for a memory budget."""
        leaves = cast("list[tuple[str, mx.array]]", tree_flatten(self._model.parameters()))
        return sum(int(v.nbytes) for _, v in leaves)

    def tokenize(self, inputs: EncoderInputs, *, truncate: bool | None = None) -> Tokenized:
        """Token ids for each input. Any thread.

        Raises ``InvalidRequestError`` for too many inputs or a token id outside the
        vocabulary. An input longer than ``max_length`` is cut to its first ``max_length``
        tokens (a string keeps its closing special token) when ``truncate`` is on (None:
        the model's setting, ``EncoderLimits.truncate``), else a ``ContextLengthError``.
        """
        truncate = self.limits.truncate if truncate is None else truncate
        check_count(inputs, max_inputs=self.limits.max_inputs)
        items, param = inputs.items, inputs.param
        # Token ids are used as given, if the vocabulary has them; texts are tokenized below.
        out: list[list[int]] = [[] if isinstance(s, str) else check_token_ids(s, inputs.where(i), self.vocab_size)
                                for i, s in enumerate(items)]
        # Index -> (the text tokenized, whether it is a cut prefix of the input).
        texts = {i: self._head(s) for i, s in enumerate(items) if isinstance(s, str)}
        encoded = self._tokenizer.encode_batch([t for t, _ in texts.values()])
        for (i, (_, cut)), enc in zip(list(texts.items()), encoded):
            out[i] = enc.ids
            if cut and len(enc.ids) <= self.max_length + HEAD_MARGIN:  # mostly whitespace: all of it
                texts[i] = (cast(str, items[i]), False)
                out[i] = self._tokenizer.encode(texts[i][0]).ids
        dropped = [0] * len(out)
        for i, ids in enumerate(out):
            if len(ids) <= self.max_length:
                continue
            text, cut = texts.get(i, ("", False))
            if not truncate:
                where = f"{param}[{i}]" if len(items) > 1 else param
                raise over_length(self.name, where, len(ids), self.max_length, at_least=cut)
            dropped[i] = len(ids) - self.max_length
            # A prefix's first max_length tokens are the whole string's (it ends at a word boundary).
            out[i] = self._truncating.encode(text).ids if i in texts else ids[: self.max_length]
        return Tokenized(out, dropped)

    def _head(self, text: str) -> tuple[str, bool]:
        """``text``, or a prefix of it ending at whitespace, and whether it was cut."""
        if len(text) <= self._head_chars:
            return text, False
        head = text[: self._head_chars]
        space = max(head.rfind(c) for c in " \n\t")
        if space < len(head) // 2:  # no word boundary to cut at: the whole string
            return text, False
        return head[:space], True

    def check_size(self, inputs: EncoderInputs) -> None:
        """Refuse a request with more inputs than ``max_inputs`` at once, before it waits or
        is tokenized (the rest of the checks come with ``tokenize``)."""
        check_count(inputs, max_inputs=self.limits.max_inputs)

    def prepare_embed(self, inputs: EncoderInputs, *, truncate: bool | None = None) -> Tokenized:
        """The token ids to embed for ``inputs`` (any thread)."""
        if self.kind != "embedding":
            raise InvalidRequestError(f"model {self.name!r} is a reranker; it gives no embeddings", param="model")
        return self.tokenize(inputs, truncate=truncate)

    def prepare_rerank(self, query: str, documents: Sequence[str], *, truncate: bool | None = None) -> Tokenized:
        """The token ids ``forward`` scores for a rerank (any thread): for a cross-encoder one
        (query, document) pair per document; for an embedding model the query, then each document."""
        docs = EncoderInputs(tuple(documents), "documents")
        check_count(docs, max_inputs=self.limits.max_inputs)
        truncate = self.limits.truncate if truncate is None else truncate
        if self.kind == "cross-encoder":
            return self._pair_tokens(query, list(documents), truncate)
        q = self.tokenize(EncoderInputs((query,), "query", bare=True), truncate=truncate)
        d = self.tokenize(docs, truncate=truncate)
        return Tokenized(q.ids + d.ids, q.cut + d.cut)

    def ranking(self, tokens: Tokenized, result: np.ndarray) -> Ranking:
        """The ``Ranking`` of what ``forward`` gave for ``prepare_rerank``'s tokens."""
        used, cut = sum(len(t) for t in tokens.ids), (tokens.truncated_inputs, tokens.truncated_tokens)
        if self.kind == "cross-encoder":
            return Ranking([float(s) for s in result], used, *cut)
        # Unit vectors: the dot product is the cosine.
        return Ranking([float(s) for s in result[1:] @ result[0]], used, *cut)

    def forward(self, batch: list[list[int]]) -> np.ndarray:
        """One batch through the model: unit vectors (embedding) or scores (cross-encoder). MLX thread."""
        return self._score_batch(batch) if self.kind == "cross-encoder" else self._embed_batch(batch)

    @property
    def out_shape(self) -> tuple[int, ...]:
        """The shape of one input's result from ``forward``."""
        return () if self.kind == "cross-encoder" else (self.dim,)

    def embed(self, inputs: EncoderInputs, *, truncate: bool | None = None) -> Embeddings:
        """``embed_steps`` run to its end in one go."""
        return _drain(self.embed_steps(inputs, truncate=truncate))

    def embed_steps(self, inputs: EncoderInputs, *, truncate: bool | None = None
                    ) -> Generator[None, None, Embeddings]:
        """Embed ``inputs``, one batch per step; returns their ``Embeddings``."""
        tokens = self.prepare_embed(inputs, truncate=truncate)
        vectors = yield from self._steps(tokens.ids)
        return self.embeddings(tokens, vectors)

    @staticmethod
    def embeddings(tokens: Tokenized, vectors: np.ndarray) -> Embeddings:
        """The ``Embeddings`` of what ``forward`` gave for ``prepare_embed``'s tokens."""
        return Embeddings(vectors, [len(t) for t in tokens.ids], tokens.truncated_inputs, tokens.truncated_tokens)

    def rerank(self, query: str, documents: Sequence[str], *, truncate: bool | None = None) -> Ranking:
        """``rerank_steps`` run to its end in one go."""
        return _drain(self.rerank_steps(query, documents, truncate=truncate))

    def rerank_steps(
        self, query: str, documents: Sequence[str], *, truncate: bool | None = None
    ) -> Generator[None, None, Ranking]:
        """Score each document against ``query``, one batch per step.

        An embedding model scores by cosine similarity (-1 to 1); a cross-encoder
        by its classifier's sigmoid (0 to 1). Higher is more relevant.
        """
        tokens = self.prepare_rerank(query, documents, truncate=truncate)
        result = yield from self._steps(tokens.ids)
        return self.ranking(tokens, result)

    def _pair_tokens(self, query: str, docs: list[str], truncate: bool) -> Tokenized:
        # Cut texts keep more tokens than the pair can hold: the truncated pair is the same.
        (query, q_cut), heads = self._head(query), [self._head(d) for d in docs]
        pairs = [enc.ids for enc in self._tokenizer.encode_batch([(query, d) for d, _ in heads])]
        dropped = [0] * len(pairs)
        for i, ids in enumerate(pairs):
            if len(ids) > self.max_length:
                if not truncate:
                    cut = q_cut or heads[i][1]
                    raise over_length(self.name, f"documents[{i}]", len(ids), self.max_length, pair=True,
                                      at_least=cut)
                dropped[i] = len(ids) - self.max_length
                pairs[i] = self._truncating.encode(query, heads[i][0]).ids
        return Tokenized(pairs, dropped)

    def _steps(self, tokens: list[list[int]]) -> Generator[None, None, np.ndarray]:
        out = np.empty((len(tokens), *self.out_shape), dtype=np.float32)
        for batch in plan_batches([len(t) for t in tokens], self.limits):
            out[batch] = self.forward([tokens[i] for i in batch])
            yield
        return out

    def _padded(self, batch: list[list[int]]) -> tuple[mx.array, mx.array]:
        """Right-padded ids and the mask (1 for tokens, 0 for padding)."""
        width = max(len(t) for t in batch)
        ids = np.full((len(batch), width), self._pad_id, dtype=np.int32)
        mask = np.zeros((len(batch), width), dtype=np.float32)
        for row, t in enumerate(batch):
            ids[row, : len(t)] = t
            mask[row, : len(t)] = 1.0
        return mx.array(ids), mx.array(mask)

    def _score_batch(self, batch: list[list[int]]) -> np.ndarray:
        ids, mask = self._padded(batch)
        # mlx-embeddings' ModernBERT classifier puts the sigmoid of its one logit in pooler_output.
        return self._run(lambda: self._model(ids, attention_mask=mask).pooler_output[:, 0])

    def _embed_batch(self, batch: list[list[int]]) -> np.ndarray:
        ids, mask = self._padded(batch)

        def forward() -> mx.array:
            out = self._model(ids, attention_mask=mask)
            pooled = out.text_embeds if self._pooling == "model" else _pool(out.last_hidden_state, mask, self._pooling)
            pooled = pooled.astype(mx.float32)
            # Normalised again in float32: a half-precision model's own norm is coarser.
            return pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)

        return self._run(forward)

    def _run(self, forward: Any) -> np.ndarray:
        try:
            result = forward()
            mx.eval(result)
            return np.array(result, dtype=np.float32)
        except (RuntimeError, ValueError) as exc:
            raise EngineError(f"model {self.name!r} failed on a batch: {exc}") from exc


def plan_batches(lengths: list[int], limits: EncoderLimits) -> list[list[int]]:
    """Input indices cut into batches of similar length.

    Each batch has at most ``max_batch`` inputs and at most ``max_batch_tokens``
    tokens once padded to its longest input; an input longer than that goes alone.
    """
    batches: list[list[int]] = []
    current: list[int] = []
    for i in sorted(range(len(lengths)), key=lengths.__getitem__):
        # Sorted ascending: input i is the longest of the batch it joins.
        full = len(current) >= limits.max_batch
        if current and (full or (len(current) + 1) * lengths[i] > limits.max_batch_tokens):
            batches.append(current)
            current = []
        current.append(i)
    return batches + ([current] if current else [])


def _pool(hidden: mx.array, mask: mx.array, mode: str) -> mx.array:
    """sentence-transformers pooling of per-token states under the padding mask."""
    if mode == "cls":
        return hidden[:, 0]
    if mode == "lasttoken":
        last = mask.sum(axis=1).astype(mx.int32) - 1
        return mx.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
    if mode == "max":
        return mx.where(mask[..., None] > 0, hidden, mx.finfo(hidden.dtype).min).max(axis=1)
    weights = mask[..., None].astype(hidden.dtype)
    return (hidden * weights).sum(axis=1) / mx.maximum(weights.sum(axis=1), 1e-9)


def _drain(steps: Generator[None, None, Any]) -> Any:
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def load_encoder(
    path: str | Path, *, limits: EncoderLimits, name: str | None = None, dtype: str | None = None
) -> Encoder:
    """Load an embedding model or cross-encoder directory with mlx-embeddings. MLX thread only.

    ``dtype`` ("float16", "bfloat16", "float32") casts floating-point weights;
    None keeps the checkpoint's. Raises ``ConfigError`` for a directory that is
    missing, unreadable, or a model kind that cannot be served.
    """
    path = Path(path).expanduser()
    name = name or path.name
    config = _read_json(path / "config.json", name, required=True)
    model_type = str(config.get("model_type", "")).replace("-", "_")
    kind = _kind(config, model_type, name)
    pooling = _pooling_mode(path, model_type, name)
    overrides = {"classifier_pooling": pooling} if model_type == "modernbert" and pooling in ("cls", "mean") else {}
    try:
        model = load_embedding_model(path, overrides)
    except Exception as exc:  # any load failure is a config problem for the user
        raise ConfigError(f"model {name!r}: cannot load {path} with mlx-embeddings: {exc}") from exc
    if dtype is not None:
        model.set_dtype(_DTYPES[dtype], predicate=lambda d: mx.issubdtype(d, mx.floating))
        mx.eval(model.parameters())
    tokenizer = _tokenizer(path, name)
    vocab = int(config.get("vocab_size") or tokenizer.get_vocab_size())
    pad = tokenizer.padding["pad_id"] if tokenizer.padding else config.get("pad_token_id")
    tokenizer.no_padding()
    tokenizer.no_truncation()
    encoder = Encoder(
        name, model, tokenizer, kind=kind, model_type=model_type, max_length=_max_length(path, config, limits),
        vocab_size=vocab, pad_id=int(pad or 0), pooling=pooling if model_type in _POOLABLE_TYPES else "model",
        limits=limits,
    )
    log.info("loaded %s %s (%s, max %d tokens)", kind, name, model_type, encoder.max_length)
    return encoder


def _kind(config: dict[str, Any], model_type: str, name: str) -> str:
    classifier = [a for a in config.get("architectures") or [] if str(a).endswith("ForSequenceClassification")]
    if not classifier:
        if model_type not in EMBEDDING_TYPES:
            raise ConfigError(
                f"model {name!r}: model_type {model_type!r} is not a text embedding model Tandem serves "
                f"(supported: {', '.join(sorted(EMBEDDING_TYPES))})"
            )
        return "embedding"
    if model_type != "modernbert":
        raise ConfigError(
            f"model {name!r}: {classifier[0]} cross-encoders cannot be loaded: mlx-embeddings has a "
            "sequence-classification head for ModernBERT only. Serve an embedding model under "
            "role: rerank (cosine similarity), or a ModernBERT reranker such as gte-reranker-modernbert-base."
        )
    labels = config.get("num_labels") or len(config.get("id2label") or {})
    if labels != 1:
        raise ConfigError(f"model {name!r}: a reranker has one output label; this classifier has {labels}")
    return "cross-encoder"


def _pooling_mode(path: Path, model_type: str, name: str) -> str:
    pooling = _read_json(path / "1_Pooling" / "config.json", name)
    modes = [mode for key, mode in _POOLING_MODES.items() if pooling.get(key)]
    if len(modes) > 1 and model_type in _POOLABLE_TYPES:
        raise ConfigError(f"model {name!r}: combined pooling modes {modes} are not supported")
    return modes[0] if modes else "mean"


def _max_length(path: Path, config: dict[str, Any], limits: EncoderLimits) -> int:
    """The configured limit, else sentence-transformers' max_seq_length, else the tokenizer's, within positions."""
    positions = int(config.get("max_position_embeddings") or 512)
    if config.get("model_type") in ("xlm-roberta", "xlm_roberta"):
        positions -= 2  # RoBERTa positions start after the padding index
    st_len = _read_json(path / "sentence_bert_config.json", "").get("max_seq_length")
    tok_len = _read_json(path / "tokenizer_config.json", "").get("model_max_length")
    tok_len = tok_len if isinstance(tok_len, int) and tok_len < 1_000_000 else None
    return min(limits.max_length or st_len or tok_len or positions, positions)


def _tokenizer(path: Path, name: str) -> Tokenizer:
    try:
        return Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception as exc:  # the tokenizers library raises bare Exception
        raise ConfigError(f"model {name!r}: cannot read {path / 'tokenizer.json'}: {exc}") from exc


def _read_json(path: Path, name: str, *, required: bool = False) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if required:
            raise ConfigError(f"model {name!r}: {path} not found") from None
        return {}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model {name!r}: cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}
