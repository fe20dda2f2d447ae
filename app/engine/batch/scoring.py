"""Prefill-only rows: a prompt's log-probabilities read, nothing generated.

A ``GenerationRequest`` with ``score`` set (a ``ScoreRequest``) asks what the model makes
of its prompt's last ``tail`` tokens, each given all before it, and of a few candidate
``next_tokens`` after the whole prompt. The decisions pipeline (``app.pipeline.decisions.reading``)
reads answers so, from the model's distribution, never from generated text. The text
engine admits such a row like any other (it reserves its prompt's KV), hands it here
instead of to its BatchGenerator (``Scorer.add``), and after that loop turn's batch step
``Scorer.run`` scores every row admitted in it, as one job between two batch steps:

    groups   rows with the same prefix-cache scope and the same declared shared prefix
             (``cache_prefix_len``: a decision's input, which every question's row starts
             with); a row that declares none is a group of its own
    prefix   the group's shared prefix, its KV taken from the prefix cache (memory, then
             disk), the rest prefilled once in chunks and stored back (``cache_write_tokens``
             on the final delta): the rows a later turn admits, and a later request about
             the same input, start from it
    stems    each row's tokens up to the ones it reads; rows with the same stem (one
             question's options, scored as whole sequences) share one. The distinct stems
             are prefilled together, a batch over the prefix's KV merged once per stem (the
             cache classes' ``merge``), right-padded and then rolled as mlx-lm's own prompt
             batches are (``prepare`` / ``finalize``)
    scores   the batch expanded to one row per request (``filter``), and every row's last
             ``tail + 1`` tokens in one forward pass: the log-softmax read at the positions
             asked

Nothing here touches the BatchGenerator or its rows, so a chat row's tokens are what they
would be without scoring beside it. A group that fails fails its rows alone. The logits a
forward pass materializes stay within ``LOGITS_BUDGET_BYTES``: stems are prefilled in
column chunks sized to it, and a group with more rows than one pass can hold is scored in
several (one question's options then span passes).

While the text engine's step is being rewritten (issue 29), a job runs whole between two
steps, so a long shared prefix holds the decoding rows back for its prefill. The contract
(``ScoreRequest`` in, ``ScoreResult`` on the final delta, ``tokens`` 0, finish reason
``"scored"``) is what a step that takes score rows itself keeps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import mlx.core as mx

from app.engine.batch.batching import Seq
from app.engine.kv.prefix_cache import PrefixCache
from app.engine.types import ScoreRequest, ScoreResult, TokenDelta
from app.errors import EngineError, InvalidRequestError

log = logging.getLogger("tandem.engine")
S = TypeVar("S", bound=Seq)

# The most logits one forward pass may materialize (rows x columns x vocabulary, float32).
LOGITS_BUDGET_BYTES = 256 * 2**20
# A row's finish reason, and its generation's outcome.
SCORED = "scored"


def check_score(score: ScoreRequest, prompt_len: int, vocab_size: int | None) -> None:
    """Refuse a score request that cannot be read: nothing asked, a tail that leaves no token
    before it, a candidate token outside the vocabulary."""
    if score.tail < 0 or (score.tail == 0 and not score.next_tokens):
        raise InvalidRequestError("a score request reads a tail of the prompt or candidate next tokens")
    if score.tail >= prompt_len:
        raise InvalidRequestError(f"a score tail of {score.tail} tokens needs a longer prompt than {prompt_len}")
    if vocab_size and any(not 0 <= t < vocab_size for t in score.next_tokens):
        raise InvalidRequestError(f"a candidate next token is not a token id of this model (0..{vocab_size - 1})")


@dataclass(eq=False)
class _Row(Generic[S]):
    """One admitted score row: its request's tokens and what it reads."""

    seq: S
    tokens: list[int]
    score: ScoreRequest

    @property
    def stem_end(self) -> int:
        """Where its read tokens' context ends: the token before the tail is the last one fed
        before the final pass."""
        return len(self.tokens) - self.score.tail - 1


@dataclass
class _Prefix:
    """A group's shared prefix: its KV, and how many of its tokens came from the cache."""

    cache: list[Any]
    length: int
    fetched: int
    written: int


class Scorer(Generic[S]):
    """Score rows admitted in one loop turn, scored together after its batch step."""

    def __init__(self, model: Any, prompt_cache: PrefixCache, new_cache: Callable[[], list[Any]], *,
                 cache_key: Callable[[str], str], chunk: int, min_tokens: int, cache_on: bool,
                 vocab_size: int | None, replicated: bool = False) -> None:
        self.model = model
        self.prompt_cache = prompt_cache
        # An empty per-layer cache for this model (plain, or quantized when its KV is).
        self._new_cache = new_cache
        self._cache_key = cache_key
        self.chunk = chunk
        # Shared prefixes shorter than this are not stored (the engine's cache_min_tokens).
        self.min_tokens = min_tokens
        # models.yaml prompt_cache is not "off" (a row's share_prefix uses it anyway).
        self.cache_on = cache_on
        self.vocab_size = vocab_size
        # Distributed: the other ranks replay the batch's calls; these would not be replayed.
        self.replicated = replicated
        self.pending: list[S] = []
        self._failed: list[tuple[S, TokenDelta]] = []

    def add(self, seq: S) -> None:
        """An admitted score row, scored at this turn's ``run``."""
        score = seq.req.score
        assert score is not None
        try:
            if self.replicated:
                raise InvalidRequestError("this model is served across ranks; it cannot score prompts yet")
            check_score(score, seq.prompt_len, self.vocab_size)
        except InvalidRequestError as exc:
            self._failed.append((seq, TokenDelta(error=exc)))
            return
        self.pending.append(seq)

    def run(self) -> list[tuple[S, TokenDelta]]:
        """Score every pending row; each row's final delta (or its error), to be sent."""
        rows = [_Row(s, list(s.req.prompt_tokens), s.req.score) for s in self.pending
                if not s.done and s.req.score is not None]
        out, self._failed, self.pending = self._failed, [], []
        groups: dict[Any, list[_Row[S]]] = {}
        for row in rows:
            groups.setdefault(self._group_key(row), []).append(row)
        for group in groups.values():
            try:
                out += self._score_group(group)
            except Exception as exc:  # noqa: BLE001 - one group fails alone; the batch goes on
                log.exception("scoring %d rows failed", len(group))
                out += [(r.seq, TokenDelta(error=EngineError(f"scoring failed: {exc}"))) for r in group]
        if rows:
            mx.clear_cache()
        return out

    def _group_key(self, row: _Row[S]) -> Any:
        req = row.seq.req
        declared = req.cache_prefix_len
        if not declared:
            return id(row)
        return self._cache_key(req.cache_namespace), tuple(row.tokens[:declared])

    def _uses_cache(self, row: _Row[S]) -> bool:
        return self.cache_on or row.seq.req.share_prefix

    def _score_group(self, rows: list[_Row[S]]) -> list[tuple[S, TokenDelta]]:
        declared = rows[0].seq.req.cache_prefix_len or len(rows[0].tokens)
        length = min(declared, min(r.stem_end for r in rows), _common_length([r.tokens for r in rows]))
        prefix = self._prefix(rows[0], rows[0].tokens[:length])
        out: list[tuple[S, TokenDelta]] = []
        owner = True
        for batch in self._batches(rows):
            out += self._score_batch(batch, prefix, owner)
            owner = False
        return out

    def _prefix(self, row: _Row[S], tokens: list[int]) -> _Prefix:
        """The KV of ``tokens``: from the prefix cache as far as it has them, the rest prefilled
        here and stored back."""
        key = self._cache_key(row.seq.req.cache_namespace)
        use_cache = self._uses_cache(row) and bool(tokens)
        cache, rest = None, tokens
        if use_cache:
            cache, rest, _ = self.prompt_cache.fetch(key, tokens)
        if cache is None:
            cache, rest = self._new_cache(), tokens
        for i in range(0, len(rest), self.chunk):
            self.model(mx.array([rest[i:i + self.chunk]]), cache=cache)
            mx.eval([c.state for c in cache])
        written = 0
        if rest:
            cache = _exact(cache)
        if use_cache and rest and len(tokens) >= self.min_tokens:
            self.prompt_cache.insert_cache(key, tokens, cache, cache_type="system")
            written = len(rest)
        return _Prefix(cache, len(tokens), len(tokens) - len(rest), written)

    def _batches(self, rows: list[_Row[S]]) -> list[list[_Row[S]]]:
        """The rows, in their order (a request's rows come together), in forward passes whose
        logits stay within the budget."""
        width = max(r.score.tail + 1 for r in rows)
        most = max(1, LOGITS_BUDGET_BYTES // (width * self._vocab_guess() * 4))
        batches: list[list[_Row[S]]] = [[]]
        for row in rows:
            if len(batches[-1]) >= most:
                batches.append([])
            batches[-1].append(row)
        return batches

    def _vocab_guess(self) -> int:
        return self.vocab_size or 2**17

    def _score_batch(self, rows: list[_Row[S]], prefix: _Prefix, owner: bool) -> list[tuple[S, TokenDelta]]:
        stems: dict[tuple[int, ...], int] = {}
        row_stem = [stems.setdefault(tuple(r.tokens[prefix.length:r.stem_end]), len(stems)) for r in rows]
        batch = [c.merge([c] * len(stems)) for c in prefix.cache]
        self._prefill(batch, list(stems))
        if row_stem != list(range(len(stems))):
            for c in batch:
                c.filter(row_stem)
        finals = [r.tokens[r.stem_end:] for r in rows]
        width = max(map(len, finals))
        logits = self.model(mx.array([f + [0] * (width - len(f)) for f in finals]), cache=batch)
        logprobs = self._read(logits, rows, finals)
        now = time.monotonic()
        out: list[tuple[S, TokenDelta]] = []
        seen: set[int] = set()
        for i, (row, read) in enumerate(zip(rows, logprobs)):
            first = i == 0 and owner
            stem_owned = row_stem[i] not in seen
            seen.add(row_stem[i])
            cached = (prefix.fetched if first else prefix.length) + (0 if stem_owned else row.stem_end - prefix.length)
            seq = row.seq
            seq.cached_tokens, seq.first_token = cached, now
            tail, nexts = read[:row.score.tail], read[row.score.tail:]
            out.append((seq, TokenDelta(tokens=0, finish_reason=SCORED, prompt_tokens=seq.prompt_len,
                                        cached_tokens=cached, cache_write_tokens=prefix.written if first else 0,
                                        scores=ScoreResult(tuple(tail), tuple(nexts)))))
        return out

    def _prefill(self, batch: list[Any], stems: Sequence[tuple[int, ...]]) -> None:
        """Each stem's tokens into its row of ``batch``, right-padded, then rolled so every
        row ends at the same column (mlx-lm's prompt batches do the same)."""
        lengths = [len(s) for s in stems]
        longest = max(lengths)
        if not longest:
            return
        padding = [longest - n for n in lengths]
        padded = mx.array([list(s) + [0] * p for s, p in zip(stems, padding)])
        if max(padding):
            for c in batch:
                c.prepare(lengths=lengths, right_padding=padding)
        columns = max(1, min(self.chunk, LOGITS_BUDGET_BYTES // (len(stems) * self._vocab_guess() * 4)))
        for start in range(0, longest, columns):
            self.model(padded[:, start:start + columns], cache=batch)
            mx.eval([c.state for c in batch])
        if max(padding):
            for c in batch:
                c.finalize()
            mx.eval([c.state for c in batch])

    @staticmethod
    def _read(logits: mx.array, rows: list[_Row[S]], finals: list[list[int]]) -> list[list[float]]:
        """Per row: the log-probability of each tail token given all before it, then of each
        candidate next token given the whole prompt."""
        where: list[tuple[int, int, int]] = []
        for i, (row, final) in enumerate(zip(rows, finals)):
            where += [(i, k, final[k + 1]) for k in range(row.score.tail)]
            where += [(i, row.score.tail, t) for t in row.score.next_tokens]
        at_rows, at_cols, tokens = (mx.array(v) for v in zip(*where))
        logits = logits.astype(mx.float32)
        norm = mx.logsumexp(logits, axis=-1)
        values: list[float] = (logits[at_rows, at_cols, tokens] - norm[at_rows, at_cols]).tolist()  # type: ignore[assignment]
        out: list[list[float]] = [[] for _ in rows]
        for (i, _, _), value in zip(where, values):
            out[i].append(value)
        return out


def _exact(cache: list[Any]) -> list[Any]:
    """``cache`` holding its tokens and no more: a prefill leaves room behind them for the next
    chunk (``KVCache.step`` at a time), which the prefix cache would count as held. Copied
    through the batch-cache protocol (``merge`` of one, ``extract``); a layer without it stays."""
    out = []
    for c in cache:
        try:
            out.append(c.merge([c]).extract(0))
        except (AttributeError, NotImplementedError, ValueError):
            out.append(c)
    return out


def _common_length(sequences: list[list[int]]) -> int:
    """How many leading tokens every sequence shares."""
    first, n = sequences[0], min(map(len, sequences))
    for other in sequences[1:]:
        n = next((i for i in range(n) if other[i] != first[i]), n)
    return n
