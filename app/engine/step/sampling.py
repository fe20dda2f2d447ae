"""Per-request samplers and logits processors, built from mlx-lm's own pieces, and the
logprobs a request sees of what its sampler drew from."""

from __future__ import annotations

import time
from collections import deque
from typing import Any

import mlx.core as mx
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
)

from app.engine.types import GREEDY, SamplingParams, TokenLogprob


def build_sampler(p: SamplingParams) -> RowSampler:
    """One row's sampler (``RowSampler``): mlx-lm's own filters and temperature, the draw
    made by the Gumbel-max trick; with a seed, randomness that is the request's own."""
    if p.temperature == 0:
        return _GREEDY  # one object: mlx-lm samples a batch of greedy rows in one call
    return RowSampler(p)


class RowSampler:
    """A row's sampler: ``(logprobs) -> token``, mlx-lm's sampler contract, and ``draw``
    for the speculative verify step (``app.engine.step.verify``), which scores several
    positions of one row at once.

    A token is drawn as ``argmax(shaped + gumbel)``: ``shaped`` is the row's
    log-probabilities after top_p, min_p and top_k (mlx-lm's ``apply_*``, in
    ``make_sampler``'s order) and divided by the temperature; the Gumbel-max trick makes
    that an exact draw from softmax(shaped). Verifying a proposal then needs no sampler of
    its own: the proposed token is kept when it is the token the row draws at its position
    (probability p(d), what rejection sampling of a point-mass proposal gives), and on a
    miss the draw is already the residual's. A seeded request gets its own key, split once
    per token, so its output is the same with speculation or without, and whatever else
    runs in the batch; others use the global PRNG. Temperature 0 is the argmax.
    """

    def __init__(self, p: SamplingParams) -> None:
        self.params = p
        self.greedy = p.temperature == 0
        self._key = mx.random.key(p.seed) if p.seed is not None and not self.greedy else None

    def shape(self, logprobs: mx.array) -> mx.array:
        """The logits a draw is made from: filtered, over the temperature (rows, vocab)."""
        p = self.params
        if 0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p > 0:
            logprobs = apply_min_p(logprobs, p.min_p)
        if p.top_k > 0:
            logprobs = apply_top_k(logprobs, p.top_k)
        return logprobs * (1.0 / p.temperature)

    def __call__(self, logprobs: mx.array) -> mx.array:
        tokens, keys = self.draw(logprobs)
        self.commit(keys, 1)
        return tokens

    def draw(self, logprobs: mx.array) -> tuple[mx.array, list[Any]]:
        """The token drawn at each of ``logprobs``' rows (consecutive positions of this one
        sequence), and the keys used: ``commit`` how many of the tokens were kept."""
        if self.greedy:
            return mx.argmax(logprobs, axis=-1), []
        shaped = self.shape(logprobs)
        if self._key is None:
            return mx.argmax(shaped + mx.random.gumbel(shaped.shape), axis=-1), []
        keys, noise, key = [], [], self._key
        for _ in range(shaped.shape[0]):
            key, sub = mx.random.split(key)
            keys.append(key)
            noise.append(mx.random.gumbel(shaped.shape[1:], key=sub))
        return mx.argmax(shaped + mx.stack(noise), axis=-1), keys

    def verify_sampled(self, logprobs: mx.array, draft: list[int], q: mx.array) -> tuple[int, int] | None:
        """Rejection sampling of a drafter's sampled tokens ``draft``, drawn from ``q`` (their
        log-probabilities, (len(draft), vocab)), against this row's distribution p at each
        of ``logprobs``' positions (len(draft) + 1 of them): each is kept with probability
        min(1, p(d) / q(d)); the first refused is replaced by a draw from the residual
        max(0, p - q), renormalised; all kept, the next token is drawn from p. Returns (kept,
        next token). None for a greedy or seeded row: those keep a proposed token when it is
        their own draw (exact too, and a seeded row's output then never depends on proposals)."""
        if self.greedy or self._key is not None:
            return None
        n = len(draft)
        shaped = self.shape(logprobs)
        p = mx.softmax(shaped, axis=-1)
        vocab = p.shape[-1]
        if q.shape[-1] < vocab:
            q = mx.concatenate([q, mx.full((n, vocab - q.shape[-1]), -mx.inf, dtype=q.dtype)], axis=-1)
        q = mx.exp(q[:, :vocab].astype(p.dtype))
        ids = mx.array(draft)[:, None]
        pd = mx.take_along_axis(p[:n], ids, axis=-1).reshape(-1)
        qd = mx.take_along_axis(q, ids, axis=-1).reshape(-1)
        keep = mx.random.uniform(shape=(n,)) * qd < pd
        residual = mx.maximum(p[:n] - q, 0)
        # Where p <= q everywhere (only when p == q) a refusal cannot happen; guard the log anyway.
        fixes = mx.random.categorical(mx.log(residual + 1e-30), axis=-1)
        last = mx.random.categorical(shaped[n:n + 1], axis=-1)
        mx.eval(keep, fixes, last)
        kept_list: list[bool] = keep.tolist()  # type: ignore[assignment]
        accepted = next((j for j, k in enumerate(kept_list) if not k), n)
        token: list[int] = fixes.tolist() if accepted < n else last.tolist()  # type: ignore[assignment]
        return accepted, token[accepted if accepted < n else 0]

    def commit(self, keys: list[Any], kept: int) -> None:
        """``kept`` tokens of a ``draw`` were emitted: a seeded row's key moves past them."""
        if self._key is not None and kept:
            self._key = keys[kept - 1]


_GREEDY = RowSampler(GREEDY)


def reset_random_state() -> None:
    """A fresh global PRNG key, after a failed batch step.

    mlx-lm's samplers are ``mx.compile``d with ``mx.random.state`` as input and
    output; one that raises while being traced (``apply_top_k`` refuses a top_k
    at or above the vocabulary size) leaves a tracer in that state, and every
    later unseeded sample fails with "eval an array without a primitive".
    """
    mx.random.seed(time.time_ns() % 2**64)


def build_logits_processors(p: SamplingParams) -> list:
    """Logit bias and the repetition, presence and frequency penalties (only those switched on)."""
    return make_logits_processors(
        logit_bias=dict(p.logit_bias) or None,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty != 1.0 else None,
        presence_penalty=p.presence_penalty or None,
        frequency_penalty=p.frequency_penalty or None,
    )


def sampling_processor(sampler):
    """``sampler`` as a logits processor: it samples the row's token itself and
    leaves logits that only that token can win (0 there, -inf elsewhere).

    For batch generators with one batch-wide sampler (mlx-vlm's): each request
    keeps its own temperature, top-p and seed, and the batch's argmax picks
    the token this request sampled.
    """

    def process(tokens: mx.array, logits: mx.array) -> mx.array:
        token = sampler(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        chosen = mx.arange(logits.shape[-1]) == token.reshape(-1, 1)
        return mx.where(chosen, mx.array(0.0, logits.dtype), mx.array(-mx.inf, logits.dtype))

    return process


def logprob_tap(drawn_from: deque[mx.array]):
    """A logits processor that changes nothing and appends to ``drawn_from`` the
    log-probabilities of the logits it sees (one row): the distribution the row's
    token is drawn from when it comes after every processor that shapes it (logit
    bias, penalties, a constraint) and before a ``sampling_processor``, which leaves
    only the drawn token for the batch's own logprobs. One entry per token the
    batch draws, in order."""

    def tap(tokens: mx.array, logits: mx.array) -> mx.array:
        drawn_from.append((logits - mx.logsumexp(logits, axis=-1, keepdims=True)).reshape(-1))
        return logits

    return tap


def token_logprob(token: int, logprobs: Any, top: int) -> TokenLogprob:
    """The sampled token's log-probability in the distribution the sampler drew from (after
    logit bias, penalties and constraints), and the ``top`` most likely tokens of that
    distribution."""
    alternatives: tuple[tuple[int, float], ...] = ()
    if top:
        ids = mx.argpartition(-logprobs, top - 1)[:top]
        values = logprobs[ids]
        order = mx.argsort(-values)
        alternatives = tuple(zip(ids[order].tolist(), values[order].tolist(), strict=True))  # type: ignore[arg-type]
    return TokenLogprob(token, float(logprobs[token].item()), alternatives)
