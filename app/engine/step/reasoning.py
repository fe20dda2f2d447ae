"""Thinking budgets: a row's reasoning block, counted token by token and closed by force.

A request may say how much the model should think (an effort level, or a budget
in tokens); the pipeline turns that into ``GenerationRequest.reasoning``, a
``ReasoningBlock`` with the model's own markers. Two readers share one state
machine, ``ReasoningTracker``, over the generated tokens::

    BEFORE --opener--> INSIDE --closer--> AFTER
    (started: the prompt opened the block, so output begins INSIDE)

- the engine feeds a tracker each token it emits (``BatchingEngine._on_token``),
  and reports ``spent`` on the final delta: ``usage``'s reasoning tokens;
- a row with a budget also gets a ``BudgetProcessor``, an mlx-lm logits processor
  with a tracker of its own, fed from the row's context (by length, like the
  grammar's processor, so a paused and re-inserted row catches up). Once
  ``spent`` reaches the budget it leaves only the closer's next token, one step
  per token of it: ``[/THINK]`` for Ministral, ``</think>`` for the ``<think>``
  families, as the model itself would write it. Then it steps aside; the answer
  continues within max_tokens, and a grammar (which lets the closer through at any
  point of the block) takes over after it as it does after a closer the model wrote.

Markers are found in the decoded text, not as id runs, so a closer the model
tokenized its own way (``"\\n</think>"`` merged) still ends the block. A closer of
several tokens is not counted as reasoning, once it is seen whole. In the batch the
processor runs after penalties and logit bias and before the constraint; distributed,
rank 0 runs it and its tokens reach the other ranks as every sampled token does
(``app.engine.step.mirror``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from enum import Enum

import mlx.core as mx
import numpy as np

from app.engine.types import ReasoningBlock

# A token id -> its text.
Piece = Callable[[int], str]


class Phase(Enum):
    BEFORE = "before"
    INSIDE = "inside"
    AFTER = "after"


class ReasoningTracker:
    """Where a generation stands relative to its reasoning block, and what it spent inside."""

    def __init__(self, block: ReasoningBlock, piece: Piece) -> None:
        self.block = block
        self._piece = piece
        self.phase = Phase.INSIDE if block.started else Phase.BEFORE
        # Tokens written inside the block, its markers aside.
        self.spent = 0
        # Texts of the latest tokens, enough to hold a marker split across them.
        self._recent: deque[str] = deque(maxlen=max(len(block.opener), len(block.closer)) + 1)

    def feed(self, token: int) -> None:
        if self.phase is Phase.AFTER:
            return
        self._recent.append(self._piece(token))
        text = "".join(self._recent)
        if self.phase is Phase.BEFORE:
            at = text.find(self.block.opener)
            if at >= 0:
                self.phase = Phase.INSIDE
                self._recent.clear()
                rest = text[at + len(self.block.opener):]
                if rest:  # the opener's token carried text on: reasoning, if more than a line break
                    self._recent.append(rest)
                    self.spent += bool(rest.strip())
                    self._close_if_in(rest, 1)
            return
        self.spent += 1
        self._close_if_in(text, len(self._recent))

    def _close_if_in(self, text: str, pieces: int) -> None:
        at = text.find(self.block.closer)
        if at < 0:
            return
        self.phase = Phase.AFTER
        # The tokens the closer spans are markers, not reasoning, unless one also carries
        # reasoning text before it ("done.</think>").
        end = len(text)
        for piece in list(self._recent)[-pieces:][::-1]:
            start = end - len(piece)
            if start < at and text[start:at].strip():
                break
            self.spent -= 1
            end = start
            if end <= at:
                break
        self.spent = max(0, self.spent)
        self._recent.clear()


class BudgetProcessor:
    """One row's budget: an mlx-lm logits processor ``(context, logits) -> logits`` that
    forces the closer once the row has reasoned ``block.budget`` tokens. Never raises."""

    def __init__(self, block: ReasoningBlock, piece: Piece, prompt_len: int) -> None:
        assert block.budget is not None and block.close_ids
        self._tracker = ReasoningTracker(block, piece)
        self._budget = block.budget
        self._close = block.close_ids
        self._start = prompt_len
        self._fed = 0
        # Closer tokens emitted since forcing began; None until it begins.
        self._forced: int | None = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        generated = tokens.shape[0] - self._start
        if generated > self._fed:
            new: list[int] = tokens[self._start + self._fed:].tolist()  # type: ignore[assignment]
            for token in new:
                self._tracker.feed(token)
                if self._forced is not None:
                    self._forced += 1
            self._fed = generated
        if self._tracker.phase is not Phase.INSIDE:
            return logits
        if self._forced is None:
            if self._tracker.spent < self._budget:
                return logits
            self._forced = 0
        if self._forced >= len(self._close):  # all forced; the text did not read as the closer
            return logits
        return force(logits, self._close[self._forced])

    @property
    def settled(self) -> bool:
        """Whether the block is behind the row (closed): from then on this processor changes
        nothing and keeps no state, so the row may speculate (``app.engine.step.verify``)."""
        return self._tracker.phase is Phase.AFTER

    @property
    def forcing(self) -> bool:
        """Whether the budget ran out (the closer is being, or was, forced)."""
        return self._forced is not None


def force(logits: mx.array, token: int) -> mx.array:
    """``logits`` where only ``token`` can win: the rest -inf, added as a bias (cheaper than
    ``mx.where`` on the CPU backend); the token keeps its logit, so logprobs stay finite."""
    bias = np.full((1, logits.shape[-1]), -np.inf, dtype=np.float32)
    bias[0, token] = 0
    return logits + mx.array(bias, dtype=logits.dtype)


def piece_reader(tokenizer: object) -> Piece:
    """Token id -> its text, remembered: markers are read one token at a time on the MLX thread."""
    cache: dict[int, str] = {}
    decode = tokenizer.decode  # type: ignore[attr-defined]

    def piece(token: int) -> str:
        text = cache.get(token)
        if text is None:
            text = cache[token] = str(decode([token]))
        return text

    return piece
