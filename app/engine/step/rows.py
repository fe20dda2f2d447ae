"""A row of the decode step, and what a step says about its rows.

A row is one sequence: its prompt still to prefill (in segments), what its KV holds
(``tokens``), how it samples and what it may still emit. It lives first in the step's
queue, then in the prefill phase, then in the decode phase; its per-layer caches are its
own until it joins a phase, whose batch caches then hold it (``app.engine.step.phase``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


@dataclass(frozen=True)
class ScoreSpec:
    """A prefill-only row: the log-probabilities of its prompt's last ``tail`` tokens (each
    given every token before it) and of each of ``next_tokens`` after the whole prompt."""

    tail: int = 0
    next_tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class RowInputs:
    """A row's prompt as more than token ids (a VLM's rows): whatever the model's forward
    adapter (``app.engine.step.batch.Forward``) needs to feed its prompt tokens, beyond
    the ids: the embeddings of every prompt token after its cached prefix (image
    features merged in), and per-row extras (positions). The step never reads them; it
    tells the adapter which of the row's prompt tokens each pass feeds (``Feed``)."""

    embeddings: Any = None
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Drawn:
    """A resumed row's held-back token is one it drew before it was paused, not a prompt
    token: its first decode step feeds it and emits it (as it would have), with
    ``logprobs``, the distribution it was drawn from. So a paused row resumes on any cache
    kind without dropping a token from its KV."""

    logprobs: Any = None


@dataclass(eq=False)
class Row:
    """One sequence in the decode step."""

    uid: int
    # The prompt tokens still to prefill, in segments: the step stops at each segment's end
    # (a prompt response with ``end_of_segment``), where the engine may take the KV so far.
    segments: list[list[int]]
    # What the row's KV holds (its cached prefix, then every token fed since).
    tokens: list[int]
    max_tokens: int
    sampler: Sampler | None
    processors: tuple[LogitsProcessor, ...]
    # Its own caches, until it joins a phase (then the phase's batch caches hold it).
    cache: list[Any] | None = None
    # Prompt tokens prefilled so far, and the prompt's whole length (the progress reported).
    done: int = 0
    total: int = 0
    # Tokens emitted so far.
    generated: int = 0
    score: ScoreSpec | None = None
    # Beyond token ids, for a VLM's rows (``RowInputs``); and how many tokens its cache held
    # when it was inserted (its inputs begin there).
    inputs: RowInputs | None = None
    base: int = 0
    drawn: Drawn | None = None
    # Prompt tokens held back from prefill (the last one, fed by the first decode step; a
    # score row's tail and the token before it, fed by its score pass).
    held: int = 1
    # Checkpoints taken as it prefilled: (position, each untrimmable layer's state there).
    checkpoints: list[tuple[int, list[Any]]] = field(default_factory=list)

    @property
    def left(self) -> int:
        """Prompt tokens not yet prefilled."""
        return sum(len(s) for s in self.segments)


@dataclass(frozen=True)
class Feed:
    """What one forward pass feeds each row, for a forward adapter that needs more than the
    token ids (``Forward``): the rows in batch order, where each row's tokens of this pass
    begin (counted from its ``base``: an index into its ``RowInputs``), and how many it
    feeds (the rest of the pass's width is right padding)."""

    rows: Sequence[Row]
    starts: Sequence[int]
    lengths: Sequence[int]
    # A decode or verify pass (tokens drawn by the model), not a prefill chunk of the prompt.
    decode: bool = False


@dataclass
class PromptResponse:
    """A prefilling row's progress after a step."""

    uid: int
    # (prompt tokens prefilled, the prompt's length).
    progress: tuple[int, int]
    end_of_segment: bool
    end_of_prompt: bool
    # Tokens in its KV now (where a segment ended, the length of the prefix it completed).
    held: int = 0


@dataclass
class Response:
    """One token a decoding row emitted; the last of a row carries its KV (a ``SeqCache``: its
    checkpoints with it) and the tokens the KV holds."""

    uid: int
    token: int
    finish_reason: str | None
    prompt_cache: list[Any] | None = None
    all_tokens: list[int] | None = None
    # The distribution the token was drawn from (log-probabilities, after the row's
    # processors): read only for rows that asked for logprobs (``logprobs``).
    source: Any = None
    index: int = 0

    @property
    def logprobs(self) -> mx.array:
        """The token's distribution: a row of ``source`` (built when first read)."""
        if isinstance(self.source, list):
            return self.source[self.index]
        return self.source[self.index]


@dataclass
class ScoreResponse:
    """What a score row's forward pass gave: its tail's and its next tokens' log-probabilities.
    It ends the row (``finish_reason`` "score": the engine's ``SCORED``); no token is generated."""

    uid: int
    tail: tuple[float, ...]
    next: tuple[float, ...]
    token: int = -1
    finish_reason: str = "score"
    prompt_cache: list[Any] | None = None
    all_tokens: list[int] | None = None


def normalize_processors(processors: Sequence[LogitsProcessor] | None) -> tuple[LogitsProcessor, ...]:
    return tuple(processors) if processors else ()
