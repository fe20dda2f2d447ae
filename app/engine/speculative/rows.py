"""The text engine's speculative decoding: each row's drafters, asked before a step, told after.

    _insert          ``Speculator.open``: the row's drafters, from its request and the
                     model's settings: ``prediction`` when the request carries one,
                     ``prompt_lookup`` unless the model or request switch it off, ``draft``
                     when the model has a draft source and the request does not refuse it
    before a step    ``propose``: for each decoding row, the adaptive rule (``adaptive``)
                     says how many tokens each drafter may propose; the first drafter that
                     has a proposal gives it, cut where the row's grammar would refuse it;
                     the decode step (``app.engine.step``) gets them all
    after the step   ``settle``: each drafter told what was kept (``Drafter.verified``),
                     the row's acceptance and the model's per-drafter counts updated, the
                     step's time recorded under its proposal length
    the row's end    ``close``: its drafters closed

A row does not speculate while its reasoning budget could still force the closer (the
budget processor reads its context token by token and cannot be rolled back); a row
with a grammar does, the grammar rolled back over what the step rejected. Distributed
serving: this runs on rank 0 alone; the step's proposals go to the other ranks with the
step (``app.engine.step.mirror``), which verify the same ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from app.engine.params import SpeculativeParams
from app.engine.speculative import Drafter, DraftSource, Proposal
from app.engine.speculative.adaptive import Adaptive, RowRate, StepCosts
from app.engine.speculative.lookup import PredictionLookup, PromptLookup
from app.engine.step import DecodeBatch, RowProposal
from app.engine.step.reasoning import BudgetProcessor
from app.engine.types import DraftCounts, GenerationRequest, SpeculableConstraint

log = logging.getLogger("tandem.engine")


@dataclass(eq=False)
class RowDrafts:
    """One row's drafters and what they have done for it."""

    request_id: str
    drafters: list[Drafter]
    rates: dict[str, RowRate]
    budget: BudgetProcessor | None = None
    constraint: Any = None
    prediction_size: int = 0
    accepted_prediction: int = 0
    # Tokens the row may still emit after its next one (max_tokens): no proposal runs past them.
    remaining: int = 1 << 30
    # The proposal in this step: its drafter, the proposal, how many of its tokens went in.
    in_flight: tuple[Drafter, Proposal, int] | None = None
    closed: bool = field(default=False)

    @property
    def rejected_prediction(self) -> int:
        return max(0, self.prediction_size - self.accepted_prediction)


class Speculator:
    """Speculative decoding for one model's rows (see the module docstring)."""

    def __init__(self, name: str, params: SpeculativeParams, draft: DraftSource | None) -> None:
        self.name = name
        self.params = params
        self.draft = draft
        self.adaptive = Adaptive(params.tokens, StepCosts())
        self.counts: dict[str, DraftCounts] = {}
        self._in_flight: dict[int, RowDrafts] = {}

    def open(self, req: GenerationRequest, budget: BudgetProcessor | None, constraint: Any) -> RowDrafts | None:
        """The drafters for a new row, or None when it has none."""
        spec, k = req.speculation, self.params.tokens
        if k <= 0 or (constraint is not None and not isinstance(constraint, SpeculableConstraint)):
            return None
        drafters: list[Drafter] = []
        prediction = spec.prediction if spec is not None else ()
        if prediction:
            drafters.append(PredictionLookup(prediction, len(req.prompt_tokens)))
        lookup = spec.prompt_lookup if spec is not None else None
        if lookup if lookup is not None else self.params.prompt_lookup:
            drafters.append(PromptLookup())
        if self.draft is not None and not (spec is not None and spec.draft is False):
            try:
                drafters.append(self.draft.open(req.prompt_tokens, k))
            except Exception:  # noqa: BLE001 - the row decodes without its draft model
                log.exception("model %s: the draft model could not open a drafter for request %s", self.name,
                              req.request_id)
        if not drafters:
            return None
        rates = {d.name: RowRate.prior(d.name) for d in drafters}
        return RowDrafts(req.request_id, drafters, rates, budget, constraint, len(prediction))

    def propose(self, batch: DecodeBatch, rows: dict[int, RowDrafts]) -> None:
        """Ask each decoding row's drafters, and hand the batch their proposals."""
        asks: dict[int, list[tuple[Drafter, int]]] = {}
        for uid, row in rows.items():
            if row.budget is not None and not row.budget.settled:
                continue
            wanted = [(d, self.adaptive.tokens(row.rates[d.name], d.name, row.request_id)) for d in row.drafters]
            wanted = [(d, min(k, row.remaining)) for d, k in wanted if k and row.remaining > 0]
            if wanted:
                asks[uid] = wanted
        if not asks:
            return
        pending = batch.pending()
        proposals: dict[int, RowProposal] = {}
        for uid, wanted in asks.items():
            if uid not in pending:  # still in prefill
                continue
            row = rows[uid]
            tokens = batch.context(uid)
            tokens.append(pending[uid])
            try:
                proposal = self._ask(row, wanted, tokens)
            finally:
                tokens.pop()
            if proposal is not None:
                proposals[uid] = proposal
                self._in_flight[uid] = row
        batch.propose(proposals)

    def _ask(self, row: RowDrafts, wanted: list[tuple[Drafter, int]], tokens: list[int]) -> RowProposal | None:
        for drafter, k in wanted:
            try:
                proposal = drafter.propose(tokens, k)
            except Exception:  # noqa: BLE001 - a drafter's bug costs its row that drafter, no more
                log.exception("request %s: drafter %s failed; off for this request", row.request_id, drafter.name)
                row.drafters.remove(drafter)
                continue
            if proposal is None or not proposal.tokens:
                continue
            run = proposal.tokens[:k]
            if row.constraint is not None:
                run = run[:row.constraint.allowed(tokens, run)]
            if not run:
                drafter.verified(proposal, 0)
                continue
            row.in_flight = (drafter, proposal, len(run))
            rewind = row.constraint.rewind if row.constraint is not None else None
            q = proposal.logprobs[:len(run)] if proposal.logprobs is not None else None
            return RowProposal(tuple(run), rewind, q)
        return None

    def settle(self, batch: DecodeBatch, seconds: float, timed: bool) -> None:
        """After the step: what each proposal came to. ``timed``: the step only decoded, so
        its ``seconds`` are a fair measure of a step of its proposal length."""
        if timed:
            self.adaptive.costs.observe(batch.last_k, seconds)
        in_flight, self._in_flight = self._in_flight, {}
        for uid, row in in_flight.items():
            if row.in_flight is None:
                continue
            drafter, proposal, proposed = row.in_flight
            row.in_flight = None
            outcome = batch.outcomes.get(uid)
            accepted = outcome.accepted if outcome is not None else 0
            if outcome is None:  # the batch ignored the proposal (a step that could not verify)
                proposed = 0
            row.rates[drafter.name].update(proposed, accepted)
            counts = self.counts.setdefault(drafter.name, DraftCounts())
            counts.proposed += proposed
            counts.accepted += accepted
            counts.steps += bool(proposed)
            if drafter.name == "prediction":
                row.accepted_prediction += accepted
            if not row.closed:
                try:
                    drafter.verified(proposal, accepted)
                except Exception:  # noqa: BLE001
                    log.exception("request %s: drafter %s failed; off for this request", row.request_id,
                                  drafter.name)
                    row.drafters.remove(drafter)

    def drop_in_flight(self) -> None:
        """Forget this step's proposals (after a failure around them)."""
        for row in self._in_flight.values():
            row.in_flight = None
        self._in_flight = {}

    def close(self, row: RowDrafts) -> None:
        if row.closed:
            return
        row.closed = True
        for drafter in row.drafters:
            try:
                drafter.close()
            except Exception:  # noqa: BLE001
                log.exception("request %s: drafter %s failed to close", row.request_id, drafter.name)
