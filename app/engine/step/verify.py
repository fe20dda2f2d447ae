"""The verify step: every decoding row's proposed tokens scored in one forward pass.

Before a step the engine hands the batch the proposals of the rows that speculate
(``propose``); a step with none is a plain decode step. One verify step::

    row fed        x  d1 d2 d3         x: the token the row drew last step (not yet in
    row fed        x  .  .  .             its KV); a row without proposals is padded on
                   |  |  |  |             the right (causality keeps its p0 what a plain
    distribution   p0 p1 p2 p3            step gives)

Each row's logits processors run position by position, on the context the position
sees (the row's tokens, x, then the proposed tokens before it), then the row draws its
own token at every position (``RowSampler.draw``: argmax at temperature 0, else the
Gumbel-max draw, seeded per token for seeded requests). A proposed token d(j+1) is kept
while it is the token drawn at position j; the first miss, or the position after the
last proposal, gives the model's own next token, which the row feeds next step. The row
emits x and its kept proposals, one ``Response`` each, in order: max_tokens and the stop
tokens are checked token by token, so a row ends inside its run exactly where a plain
step would end it. This is exact: the tokens emitted are the tokens plain decoding
draws, and for an unseeded row each is a fresh draw from the same distribution (the
acceptance rule of rejection sampling for a point-mass proposal, p(d), and on a miss a
draw from p without d). A drafter that sampled its tokens and gives their distribution q
is verified, for an unseeded sampling row, by rejection sampling proper
(``RowSampler.verify_sampled``: keep with min(1, p/q), else a draw from the residual
max(0, p - q)). Logprobs come from the target's processed distribution at each position.

The rollback: the pass wrote k+1 positions for every row, and row i keeps ``kept_i`` of
them. Where every layer trims exactly (plain and quantized KV), the batch caches are
trimmed to the longest kept run, each shorter row is rolled right by its surplus
(``prepare(right_padding=)`` and ``finalize()``, as after a right-padded prefill) and
the left padding every row shares is dropped, so the rectangle stays as wide as its
longest row. Where a layer cannot trim (a sliding window, a recurrent state: Qwen3.5's
gated delta-net, Mamba, LFM2's convolutions, Gemma's and gpt-oss's windows), every such
layer was snapshotted before the pass (``app.engine.kv.layers.snapshot``): the trimmable
layers are trimmed back by k+1, the others restored, and the kept tokens replayed in one
right-padded forward pass. Either way, each row's KV holds exactly its kept tokens.

Distributed serving (``app.engine.step.mirror``): every rank runs this step with
rank 0's proposals (``planned``). Rank 0 alone draws with the rows' samplers; ``agree``
then hands every rank rank 0's table of draws and acceptances (one ``all_sum``, after the
forward pass's own collectives), and everything after it follows from that table.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from app.engine.kv.layers import SeqCache, restore, snapshot, trims
from app.engine.mlx_internals import TokenBuffer
from app.engine.step.rows import Response
from app.engine.step.sampling import RowSampler

if TYPE_CHECKING:
    from app.engine.step.batch import DecodeBatch


@dataclass(frozen=True)
class RowProposal:
    """What one row asks the verify step to check."""

    tokens: tuple[int, ...]
    # The row's context length after the step: how its constraint rolls back what was rejected.
    rewind: Callable[[int], None] | None = None
    # The drafter's log-probabilities at each proposed position, when it sampled them
    # (``Proposal.logprobs``): a sampling row then verifies by rejection sampling.
    logprobs: Any = None


@dataclass(frozen=True)
class Outcome:
    """What the verify step made of one row's proposal."""

    proposed: int
    # Proposed tokens kept (the model drew them too).
    accepted: int
    # Tokens the row emitted this step (x, its kept proposals, cut at a finish).
    emitted: int


class Verifier:
    """The decode phase's verify step (see the module docstring)."""

    def __init__(self, batch: DecodeBatch) -> None:
        self.batch = batch
        self._proposals: dict[int, RowProposal] = {}
        # Distributed serving: hands every rank rank 0's table of a verify step's draws and
        # acceptances (``mirror``: one all_sum); None in one process.
        self.agree: Callable[[mx.array], mx.array] | None = None
        # uid -> the last step's outcome, for rows that carried a proposal.
        self.outcomes: dict[int, Outcome] = {}
        # Proposal length of the last step (0: a plain step).
        self.last_k = 0

    def propose(self, proposals: dict[int, RowProposal]) -> None:
        """The proposals for the next step (rows not named decode plainly)."""
        self._proposals = {uid: p for uid, p in proposals.items() if p.tokens}

    def planned(self) -> dict[int, tuple[int, ...]]:
        """uid -> the tokens proposed for the next step (what distributed followers replay)."""
        return {uid: p.tokens for uid, p in self._proposals.items()}

    def ready(self) -> bool:
        """Whether the next step verifies (some decoding row carries a proposal); resets the
        last step's figures either way."""
        self.outcomes, self.last_k = {}, 0
        if not self._proposals:
            return False
        uids = {r.uid for r in self.batch._decode.rows} - self.batch._fresh
        self._proposals = {uid: p for uid, p in self._proposals.items() if uid in uids}
        return bool(self._proposals)

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[Response]:
        b = self.batch
        phase = b._decode
        proposals, self._proposals = self._proposals, {}
        rows = {i: proposals[r.uid] for i, r in enumerate(phase.rows) if r.uid in proposals}
        B = len(phase.rows)
        k = max(len(p.tokens) for p in rows.values())
        self.last_k = k
        assert b._next is not None
        xs: list[int] = b._next.tolist()  # type: ignore[assignment]
        prev = b._next_lp
        drafts = [list(rows[i].tokens) if i in rows else [] for i in range(B)]
        fed = mx.array([[xs[i], *d, *([xs[i]] * (k - len(d)))] for i, d in enumerate(drafts)], dtype=mx.uint32)
        snaps = None if phase.trims else [None if trims(c) else snapshot(c) for c in phase.cache]
        logits = b._forward(fed, phase.cache, b.feed(phase.rows, [k + 1] * B, decode=True))  # (B, k+1, vocab)

        # Per row: the processed distribution at each position it needs, and its draws.
        logprobs: list[mx.array] = []
        draws: list[Any] = []
        keys: list[Any] = []
        for i in range(B):
            n = len(drafts[i]) + 1
            processed = self._processed(i, logits[i, :n], [xs[i], *drafts[i]])
            lp = processed - mx.logsumexp(processed, axis=-1, keepdims=True)
            logprobs.append(lp)
            tokens, used = self._draw(i, lp)
            draws.append(tokens)
            keys.append(used)
        mx.eval(draws, logprobs)

        # Per row: the token drawn at each position, and how many proposed tokens it keeps.
        decided: list[tuple[list[int], int]] = []
        for i in range(B):
            drawn: list[int] = draws[i].tolist()
            accepted = 0
            while accepted < len(drafts[i]) and drafts[i][accepted] == drawn[accepted]:
                accepted += 1
            sampled = self._rejection(i, rows.get(i), logprobs[i])
            if sampled is not None:  # a sampled draft: rejection sampling decides
                accepted = sampled[0]
                drawn[accepted] = sampled[1]
            decided.append((drawn, accepted))
        if self.agree is not None:
            decided = self._agreed(decided, k)

        responses: list[Response] = []
        kept: list[int] = []
        next_tokens: list[int] = []
        next_logprobs: list[mx.array] = []
        finished: list[int] = []
        for i, row in enumerate(phase.rows):
            drawn, accepted = decided[i]
            fresh = row.uid in b._fresh
            emit = [xs[i], *drafts[i][:accepted]]
            emit_lp = [None if fresh else prev[i], *(logprobs[i][j] for j in range(accepted))]
            row_responses, finish = self._respond(i, emit, emit_lp, fresh)
            n = len(row_responses) + fresh
            kept.append(n)
            self._commit_draw(i, keys[i], n if finish is None else n - 1)
            if i in rows:
                self.outcomes[row.uid] = Outcome(len(drafts[i]), min(accepted, n - 1), n)
            next_tokens.append(drawn[accepted])
            next_logprobs.append(logprobs[i][accepted])
            responses.extend(row_responses)
            if finish is not None:
                finished.append(i)
            b._fresh.discard(row.uid)

        self._rollback([[xs[i], *drafts[i]][:kept[i]] for i in range(B)], k + 1, snaps)
        for i, row in enumerate(phase.rows):
            row.tokens.extend([xs[i], *drafts[i]][:kept[i]])
            if row.processors:
                b._contexts[i] = TokenBuffer(row.tokens)
            rewind = rows[i].rewind if i in rows else None
            if rewind is not None:
                rewind(len(row.tokens))
        b._next = mx.array(next_tokens, dtype=mx.uint32)
        b._next_lp = next_logprobs

        by_uid = {r.uid: r for r in responses if r.finish_reason is not None}
        for i in finished:  # the finishing response carries the row's KV
            row = phase.rows[i]
            last = by_uid[row.uid]
            last.prompt_cache, last.all_tokens = SeqCache(phase.extract(i), row.checkpoints), row.tokens
        if finished:
            done = set(finished)
            b._filter_decode([i for i in range(B) if i not in done])
        return responses

    def _agreed(self, decided: list[tuple[list[int], int]], k: int) -> list[tuple[list[int], int]]:
        """Every rank's copy of the step's draws and acceptances: one ``agree`` call over a
        (rows, k + 2) table (each row's draws, zero-padded, then its accepted count)."""
        assert self.agree is not None
        table = mx.array([[*drawn, *[0] * (k + 1 - len(drawn)), accepted] for drawn, accepted in decided],
                         dtype=mx.uint32)
        agreed: list[list[int]] = self.agree(table).tolist()  # type: ignore[assignment]
        return [(row[:len(drawn)], row[k + 1]) for row, (drawn, _) in zip(agreed, decided, strict=True)]

    def _processed(self, i: int, logits: mx.array, fed: Sequence[int]) -> mx.array:
        """Row ``i``'s logits at each fed position after its processors, each position
        seeing the row's tokens and the fed tokens up to itself."""
        row = self.batch._decode.rows[i]
        if not row.processors:
            return logits
        base = row.tokens
        context = mx.array([*base, *fed], dtype=mx.int32)
        out = []
        for j in range(len(fed)):
            position = logits[j:j + 1]
            ctx = context[: len(base) + j + 1]
            for processor in row.processors:
                position = processor(ctx, position)
            out.append(position)
        return mx.concatenate(out, axis=0)

    def _rejection(self, i: int, proposal: RowProposal | None, logprobs: mx.array) -> tuple[int, int] | None:
        """(kept, next token) by rejection sampling, for a sampling row whose drafter sampled."""
        if proposal is None or proposal.logprobs is None:
            return None
        sampler = self.batch._decode.rows[i].sampler
        if not isinstance(sampler, RowSampler):
            return None
        return sampler.verify_sampled(logprobs, list(proposal.tokens), proposal.logprobs)

    def _draw(self, i: int, logprobs: mx.array) -> tuple[mx.array, list[Any]]:
        sampler = self.batch._decode.rows[i].sampler or self.batch.fallback_sampler
        draw = getattr(sampler, "draw", None)
        if draw is not None:
            return draw(logprobs)
        # A plain sampler (greedy, or a closure): one call per position.
        return mx.concatenate([sampler(logprobs[j:j + 1]).reshape(-1) for j in range(logprobs.shape[0])]), []

    def _commit_draw(self, i: int, keys: list[Any], emitted_draws: int) -> None:
        commit = getattr(self.batch._decode.rows[i].sampler, "commit", None)
        # Every emitted token but x was a draw of this step, and so is the next token.
        if commit is not None:
            commit(keys, emitted_draws)

    def _respond(self, i: int, emit: list[int], emit_lp: list[Any], fresh: bool) -> tuple[list[Response], str | None]:
        """Responses for row ``i``'s emitted tokens, cut at the first that finishes it (a
        fresh row's x is its held-back prompt token: fed, not emitted)."""
        row = self.batch._decode.rows[i]
        out: list[Response] = []
        for j, (token, lp) in enumerate(zip(emit, emit_lp, strict=True)):
            if j == 0 and fresh:
                continue
            row.generated += 1
            finish = None
            if row.generated >= row.max_tokens:
                finish = "length"
            if token in self.batch.stop_tokens:
                finish = "stop"
            out.append(Response(row.uid, token, finish, source=[lp], index=0))
            if finish is not None:
                return out, finish
        return out, None

    def _rollback(self, kept: list[list[int]], fed: int, snaps: list[Any] | None) -> None:
        """Each row's KV holds exactly its ``kept`` tokens of the ``fed`` positions just written."""
        lengths = [len(t) for t in kept]
        longest = max(lengths)
        if min(lengths) == fed:
            return
        cache = self.batch._decode.cache
        if snaps is None:  # every layer trims: cut the tail, roll shorter rows right
            surplus = [longest - n for n in lengths]
            for c in cache:
                if fed > longest:
                    c.trim(fed - longest)
                if any(surplus):
                    c.prepare(right_padding=surplus)
                    c.finalize()
                    shared = int(c.left_padding.min().item())
                    if shared > 0:
                        _shift_left(c, shared)
            return
        # Windows and recurrent state: back to before the pass, then the kept tokens again.
        for c, s in zip(cache, snaps, strict=True):
            if s is None:
                c.trim(fed)
            else:
                restore(c, s)
        padding = [longest - n for n in lengths]
        tokens = mx.array([t + [0] * p for t, p in zip(kept, padding, strict=True)], dtype=mx.uint32)
        if max(padding):
            for c in cache:
                c.prepare(lengths=lengths, right_padding=padding)
        self.batch._forward(tokens, cache, self.batch.feed(self.batch._decode.rows, lengths, decode=True))
        mx.eval([c.state for c in cache])
        if max(padding):
            for c in cache:
                c.finalize()
            mx.eval([c.state for c in cache])


def _shift_left(c: Any, n: int) -> None:
    """Drop the ``n`` left-padding columns every row of batch cache ``c`` has."""
    cut = lambda x: x[..., n:, :]  # noqa: E731
    if isinstance(c.keys, tuple):  # quantized: (codes, scales, biases)
        c.keys, c.values = tuple(map(cut, c.keys)), tuple(map(cut, c.values))
    else:
        c.keys, c.values = cut(c.keys), cut(c.values)
    c._idx -= n
    c.left_padding = c.left_padding - n
