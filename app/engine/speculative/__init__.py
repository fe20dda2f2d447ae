"""Speculative decoding: drafters propose tokens, the batch verifies them in one pass.

Decoding is bound by memory bandwidth: scoring k proposed tokens in one forward pass
costs about what producing one does (on a GPU or Metal; on a small CPU it does not,
and the adaptive rule below keeps speculation from costing a row speed). Each
decoding row of the batch may carry a ``Proposal``; the verify step
(``app.engine.step.verify``, part of Tandem's decode step) scores every row's
proposal in one forward pass, keeps each row's longest accepted run plus the model's
own next token, and rolls the rejected positions back out of the KV cache. Rows
without a proposal decode as before in the same step.

Who proposes (``Drafter``), per model (models.yaml ``speculative``) and per request
(``SpeculationRequest``):

    prediction      OpenAI's Predicted Outputs: the client's predicted text, matched
                    against the output so far (``lookup``)
    prompt_lookup   n-gram matching against the prompt and the output so far (``lookup``)
    draft           another chat model of models.yaml, run ahead k tokens (``draft_model``)

The package: ``lookup`` (the prediction and prompt-lookup drafters), ``draft_model`` (a
draft model), ``adaptive`` (how many tokens pay), ``rows`` (the text engine's per-row
drafters around each step). The verify step is the decode step's (``app.engine.step.verify``).

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


class DraftSource(Protocol):
    """Where a row's Drafter comes from when it is not the request's own data: a draft model
    (``draft_model``), shared by every row of the target it drafts for.

    The engine (``TextEngine``, MLX thread) calls ``open`` once per row, when the row is first
    inserted into the batch (``_insert``; not again when a paused row resumes: the Drafter
    lives with the row's sequence), for every request that does not switch the source off
    (``SpeculationRequest.draft is False``). The Drafter it returns is then, for that row:

    - asked ``propose(tokens, k)`` before a decode step, ``tokens`` being the row's whole
      sequence so far (the prompt, then every token generated, the last of which is the one
      the target feeds next: not yet in the target's KV), and ``k`` at most the ``k`` given
      to ``open`` (the adaptive rule asks for fewer, and some steps not at all). Between two
      calls ``tokens`` grows by the accepted tokens plus the target's own next token, but a
      drafter must not rely on it: it keeps the tokens it has fed itself, and when ``tokens``
      does not extend them (a row resumed, a grammar cut) it rolls its own state back to the
      common prefix and feeds the rest. ``tokens`` is the engine's own list, valid during the
      call only: copy what is kept. It returns at most ``k`` tokens, or None;
    - told ``verified(proposal, accepted)`` after the step that verified ``proposal``
      (0 <= accepted <= len(proposal.tokens)); a proposal cut short before verifying (a
      grammar refused its tail) is reported with the tokens actually verified;
    - ``close()``d once when the row ends however it ends (finished, stopped, cancelled,
      failed): the drafter gives back its KV and reservation there.

    Proposals may be greedy (``Proposal.logprobs`` None: the target keeps token d when it is
    the token the row draws there: probability p(d), or d the argmax at temperature 0) or
    sampled, with the drafter's log-probabilities over the whole vocabulary at each proposed
    position (``logprobs``: (len(tokens), vocab), its distribution after its own
    temperature): an unseeded sampling row then keeps d with min(1, p/q) and draws a refused
    one's replacement from the residual max(0, p - q); greedy and seeded rows verify it as a
    greedy proposal. Either way the output is exact. Sampled proposals only pay when q is
    close to the row's p; a greedy draft is simplest.

    A Drafter that raises is switched off for its row (logged); the row decodes on. Distributed
    serving: only rank 0 opens and asks drafters; the other ranks replay the verify step from
    the proposals rank 0 sends."""

    @property
    def name(self) -> str:
        """One of ``DRAFTERS`` (``"draft"`` for a draft model)."""

    def open(self, prompt_tokens: Sequence[int], k: int) -> Drafter:
        """A Drafter for one row whose prompt is ``prompt_tokens``, asked for at most ``k``
        tokens a step. It may prefill the prompt now or on its first ``propose``."""


def resolve(proposal: Sequence[int]) -> tuple[int, ...]:
    """A proposal's tokens as the tuple ``Proposal`` holds."""
    return tuple(int(t) for t in proposal)
