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
    make_sampler,
)

from app.engine.types import SamplingParams, TokenLogprob


def build_sampler(p: SamplingParams):
    """mlx-lm's sampler; with a seed, one whose randomness is the request's own.

    mlx-lm samples from the global PRNG, which every sequence in a batch
    shares; a seeded request gets its own key, split at every step, so its
    output does not depend on what else is running.
    """
    if p.temperature == 0 or p.seed is None:
        return make_sampler(p.temperature, p.top_p, p.min_p, top_k=p.top_k)
    key = mx.random.key(p.seed)

    def sampler(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, sub = mx.random.split(key)
        if 0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p > 0:
            logprobs = apply_min_p(logprobs, p.min_p)
        if p.top_k > 0:
            logprobs = apply_top_k(logprobs, p.top_k)
        return mx.random.categorical(logprobs * (1.0 / p.temperature), key=sub)

    return sampler


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
