"""How many tokens a row proposes: only as many as pay, on this machine, for this row.

A verify step of k proposed tokens costs ``t(k)``; a plain step ``t(0)``. On a GPU or
Metal the two are close (decoding is bound by reading the weights); on a small CPU a
k-token pass costs more, nearly k times at worst. A row whose drafter's tokens are kept
with probability ``a`` each emits on average ``E(k) = (1 - a^(k+1)) / (1 - a)`` tokens
per verify step (its accepted run, then the model's own token), so speculating at k is
worth ``E(k) * t(0) / t(k)`` plain steps. The rule: propose the k (1..max) that
maximises that, and only when it beats ``1 + MARGIN``; otherwise the drafter is off for
the row (a debug log says why) and is probed again after a pause that doubles each
time it still does not pay.

``StepCosts`` measures t(k) per model: the engine times each decode step (steps that
also prefill are not counted) under the k it ran with, against the plain steps of the
moment. A k not measured yet is guessed from the measured ones' cost per token (before
any, ``PRIOR_SLOPE`` per token: optimistic enough that speculation gets tried).
``RowRate`` keeps one row's acceptance for one drafter: each verified position is a
trial (the accepted run, and the miss that ended it), decayed so it follows the text.
A probe of an off drafter costs its verify step's surplus over a plain step, so the pause
before it is counted in plain steps times that cost: where a verify is dear (a small CPU)
probes are rare, and together they stay within the margin.

``Costs`` is the seam for what a step costs: ``StepCosts`` measures it; ``FreeVerify``
takes a verify step to cost what a plain one does (the bandwidth-bound ideal), which
tests use so that every proposal is verified whatever this machine's timings.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger("tandem.engine")

# Speculation must beat plain decoding by this much to be used: noise in the timings
# must not turn it on where it only breaks even.
MARGIN = 0.05
# Until t(k) is measured: t(k) = t(0) * (1 + PRIOR_SLOPE * k).
PRIOR_SLOPE = 0.1
# Weight of the newest step time in the running mean.
TIME_ALPHA = 0.1
# Each verify outcome's weight in a row's acceptance, against the decayed past.
RATE_DECAY = 0.8
# What a drafter is presumed to keep until its row shows otherwise (weight PRIOR_TRIALS): a
# client's prediction is the answer it expects; an n-gram of the prompt is a guess.
PRIOR_RATES = {"prediction": 0.8, "prompt_lookup": 0.5, "draft": 0.6}
PRIOR_TRIALS = 2.0
# Steps a drafter that did not pay stays off for its row, first and at most (in plain steps;
# longer where a probe costs more than PROBE_SHARE of them), and a probe's proposal length.
BACKOFF_FIRST, BACKOFF_MAX = 16, 512
PROBE_SHARE = 0.02
PROBE_K = 2


class Costs(Protocol):
    """What a verify step of k proposed tokens costs, in plain steps."""

    def observe(self, k: int, seconds: float) -> None: ...

    def ratio(self, k: int) -> float: ...


class FreeVerify:
    """Costs where a verify step costs what a plain one does, whatever k."""

    def observe(self, k: int, seconds: float) -> None:
        pass

    def ratio(self, k: int) -> float:
        return 1.0


class StepCosts:
    """What a verify step costs on this model, in plain steps, by proposal length.

    A plain step's seconds are a running mean; each verify step is measured against the
    plain mean of its moment, so a machine whose load changes (other work on a shared CPU)
    does not compare a verify timed under load with a plain step timed without."""

    def __init__(self) -> None:
        self._plain: float | None = None
        self._ratio: dict[int, float] = {}
        self._seen: set[int] = set()

    def observe(self, k: int, seconds: float) -> None:
        if k not in self._seen:  # the first step of a shape pays for setting it up: not a measure
            self._seen.add(k)
            return
        if k == 0:
            old = self._plain
            self._plain = seconds if old is None else old + TIME_ALPHA * (seconds - old)
            return
        if self._plain is None or self._plain <= 0:
            return
        ratio, old = seconds / self._plain, self._ratio.get(k)
        self._ratio[k] = ratio if old is None else old + TIME_ALPHA * 2 * (ratio - old)

    def ratio(self, k: int) -> float:
        """t(k) / t(0): what a k-token verify step costs in plain steps."""
        if k == 0:
            return 1.0
        measured = self._ratio.get(k)
        if measured is not None:
            return max(measured, 1e-3)
        # Not measured at this k: the slope the measured ones show (the dearest), else the prior's.
        slopes = [(r - 1.0) / j for j, r in self._ratio.items()]
        return 1.0 + max(slopes, default=PRIOR_SLOPE) * k

    def measured(self) -> dict[int, float]:
        """The plain step's seconds (0) and each measured k's ratio to it."""
        return {**({0: self._plain} if self._plain is not None else {}), **self._ratio}


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a verify step of ``k`` proposals emits on average, each kept with ``rate``."""
    if rate >= 1.0:
        return k + 1.0
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


@dataclass
class RowRate:
    """One row's acceptance for one drafter, and whether the drafter is on for it."""

    kept: float
    trials: float = PRIOR_TRIALS
    # Steps left before an off drafter is probed again, and the next pause's length.
    off_for: int = 0
    backoff: int = BACKOFF_FIRST

    @property
    def rate(self) -> float:
        return self.kept / self.trials

    @classmethod
    def prior(cls, drafter: str) -> RowRate:
        """A new row's: its first proposal is a probe (the prior alone does not decide)."""
        return cls(PRIOR_RATES.get(drafter, 0.5) * PRIOR_TRIALS, off_for=1)

    def update(self, proposed: int, accepted: int) -> None:
        self.kept = self.kept * RATE_DECAY + accepted
        self.trials = self.trials * RATE_DECAY + accepted + (accepted < proposed)


class Adaptive:
    """The rule for one model: how many tokens each row's drafter proposes this step."""

    def __init__(self, max_k: int, costs: Costs | None = None) -> None:
        self.max_k = max_k
        self.costs: Costs = costs or StepCosts()

    def best(self, rate: float) -> tuple[int, float]:
        """The k worth most at acceptance ``rate``, and its worth in plain steps per step."""
        best_k, best = 0, 1.0
        for k in range(1, self.max_k + 1):
            worth = expected_tokens(rate, k) / self.costs.ratio(k)
            if worth > best:
                best_k, best = k, worth
        return best_k, best

    def tokens(self, row: RowRate, drafter: str, request_id: str) -> int:
        """How many tokens to ask the drafter for this step (0: none)."""
        if row.off_for > 0:
            row.off_for -= 1
            if row.off_for:
                return 0
            # A probe: what it showed before counts for less now.
            row.kept, row.trials = row.kept / 2, row.trials / 2
            return min(PROBE_K, self.max_k)
        k, worth = self.best(row.rate)
        if k and worth > 1.0 + MARGIN:
            row.backoff = BACKOFF_FIRST if worth > 1.0 + 2 * MARGIN else row.backoff
            return k
        # Off for long enough that the next probe's surplus cost is a small share of the steps.
        surplus = max(0.0, self.costs.ratio(min(PROBE_K, self.max_k)) - 1.0)
        row.off_for = max(2, round(row.backoff * max(1.0, surplus / PROBE_SHARE / BACKOFF_FIRST)))
        row.backoff = min(row.backoff * 2, BACKOFF_MAX)
        log.debug("request %s: %s off for %d steps: it keeps %.0f%% of its tokens, worth %.2fx plain "
                  "decoding at best (k=%d; verify/plain step time %s)", request_id, drafter, row.off_for,
                  100 * row.rate, worth, k, {k: round(self.costs.ratio(k), 2) for k in range(1, self.max_k + 1)})
        return 0
