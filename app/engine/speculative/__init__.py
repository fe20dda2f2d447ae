"""Speculative decoding: drafters propose tokens, the batch verifies them in one pass.

Decoding is bound by memory bandwidth: scoring k proposed tokens in one forward pass
costs about what producing one does (on a GPU or Metal; on a small CPU it does not,
and the adaptive rule below keeps speculation from costing a row speed). Each
decoding row of the batch may carry a ``Proposal``; the verify step
(``app.engine.batch.verify``, behind the private-API fence) scores every row's
proposal in one forward pass, keeps each row's longest accepted run plus the model's
own next token, and rolls the rejected positions back out of the KV cache. Rows
without a proposal decode as before in the same step.

Who proposes (``Drafter``), per model (models.yaml ``speculative``) and per request
(``SpeculationRequest``):

    prediction      OpenAI's Predicted Outputs: the client's predicted text, matched
                    against the output so far (``lookup``)
    prompt_lookup   n-gram matching against the prompt and the output so far (``lookup``)
    draft           another chat model of models.yaml, run ahead k tokens (``draft_model``)

Exactness: at temperature 0 the output is token for token the output without
speculation; with sampling, rejection sampling (accept a proposed token with
min(1, p/q), else draw from the residual max(0, p - q)) keeps the model's own
distribution. A deterministic drafter's q is a point mass at its token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# The drafters by name, as models.yaml, /metrics and /health spell them.
DRAFTERS = ("prediction", "prompt_lookup", "draft")


@dataclass(frozen=True)
class Proposal:
    """Tokens a drafter proposes to follow a row's tokens so far."""

    drafter: str
    tokens: tuple[int, ...]
    # The drafter's distribution at each proposed position (an ``mx.array`` of shape
    # (len(tokens), vocab), log-probabilities), when it sampled them; None when it proposes
    # deterministically (a point mass at each token: lookup, or a greedy draft).
    logprobs: Any = None


class Drafter(Protocol):
    """One row's source of proposals. Lives with its row (its sequence), on the MLX thread."""

    @property
    def name(self) -> str:
        """One of ``DRAFTERS``."""

    def propose(self, tokens: Sequence[int], k: int) -> Proposal | None:
        """Up to ``k`` tokens likely to follow ``tokens`` (the row's prompt and its output so
        far, every token of which is in the target's KV cache or is the next one fed);
        None when it has nothing worth verifying."""

    def verified(self, proposal: Proposal, accepted: int) -> None:
        """The verify step kept the first ``accepted`` tokens of ``proposal`` (a drafter with
        state of its own, a draft model's KV, rolls the rest back)."""

    def close(self) -> None:
        """The row ended: give back what the drafter holds."""


@dataclass
class DraftCounts:
    """Proposed and accepted tokens, for one drafter of one model (/metrics, /health)."""

    proposed: int = 0
    accepted: int = 0
    # Verify steps that carried this drafter's proposals.
    steps: int = 0


def resolve(proposal: Sequence[int]) -> tuple[int, ...]:
    """A proposal's tokens as the tuple ``Proposal`` holds."""
    return tuple(int(t) for t in proposal)
