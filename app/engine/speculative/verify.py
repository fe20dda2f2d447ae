"""The speculative verify step: mlx-lm's generation step, owned for rows that carry proposals.

mlx-lm's ``BatchGenerator`` decodes one token per row per step, in its
``GenerationBatch``; it has no step that scores several tokens of a row at once. This
module's ``VerifyBatch`` is a ``GenerationBatch`` installed as the generator's own
(``install``): the generator ``extend``s every new generation batch into it, so it holds
every decoding row for the generator's life. Before a step the engine hands it the
proposals of the rows that speculate (``propose``); with none, its step is exactly
mlx-lm's (``super().next()``), so plain decoding is unchanged.

One verify step, for a batch where some rows carry proposals::

    row fed        x  d1 d2 d3         x: the token sampled last step (mlx-lm's
    row fed        x  .  .  .             ``_next_tokens``: drawn, not yet in the KV)
                   |  |  |  |          one forward pass over (B, k+1) tokens; a row
    distribution   p0 p1 p2 p3         without proposals is padded on the right
                                       (causality keeps its p0 what a plain step gives)

Each row's logits processors run position by position, on the context the position
sees (the row's tokens, x, then the proposed tokens before it), then the row draws its
own token at every position (``RowSampler.draw``: argmax at temperature 0, else the
Gumbel-max draw, seeded per token for seeded requests). A proposed token d(j+1) is
kept while it is the token drawn at position j; the first miss, or the position after
the last proposal, gives the model's own next token, which becomes the row's new
``_next_tokens`` (one step ahead, as mlx-lm keeps it). The row emits x and its kept
proposals, one ``Response`` each, in order: max_tokens and the stop tokens are checked
token by token, so a row ends inside its run exactly where a plain step would end it.
This is exact: the tokens emitted are the tokens plain decoding draws, and for an
unseeded row each is a fresh draw from the same distribution (the acceptance rule of
rejection sampling for a point-mass proposal, p(d), and on a miss a draw from p without
d). A drafter that sampled its tokens and gives their distribution q is verified, for an
unseeded sampling row, by rejection sampling proper (``RowSampler.verify_sampled``: keep
with min(1, p/q), else a draw from the residual max(0, p - q)). Logprobs come from the
target's processed distribution at each position.

The KV: the pass wrote k+1 positions for every row; row i keeps ``kept_i`` of them (x
and its accepted run, or up to its finishing token). mlx-lm's batch caches are
left-padded rectangles sharing one write index, so the rollback is: trim the common tail
to the longest kept run; roll each shorter row right by its surplus
(``prepare(right_padding=...)`` and ``finalize()``, as mlx-lm does after a right-padded
prefill: a dynamic roll, the offset and left padding moved with it); then shift off the
left padding every row now shares, so the rectangle is as wide as its longest row, as
``admission``'s footprint assumes. ``tokens[i]`` (what the KV holds; the prefix cache
stores it) gets exactly the kept tokens. The quantized batch cache (``kv_quant``)
implements the same protocol.

Rows whose caches are not plain or quantized batch KV (rotating windows, SSM state)
cannot be rolled back: the step ignores proposals for such a batch.

Distributed serving (``app.engine.distributed.mirror``): every rank runs this step with
rank 0's proposals (``planned``, replayed by ``propose``). Rank 0 alone draws with the
rows' samplers; ``agree`` then hands every rank rank 0's table of draws and acceptances
(one ``all_sum``, after the forward pass's own collectives), and everything after it
(the emitted tokens, the rollback, ``tokens``) follows from that table on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from app.engine.batch.sampling import RowSampler
from app.engine.kv.kv_quant import BatchQuantizedKVCache
from app.engine.mlx_internals import BatchKVCache, GenerationBatch, TokenBuffer


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


_ROLLBACK_CACHES = (BatchKVCache, BatchQuantizedKVCache)


class VerifyBatch(GenerationBatch):
    """mlx-lm's ``GenerationBatch`` with a verify step for rows that carry proposals."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._proposals: dict[int, RowProposal] = {}
        # Distributed serving: hands every rank rank 0's table of a verify step's draws and
        # acceptances (``mirror``: one all_sum); None in one process.
        self.agree: Callable[[mx.array], mx.array] | None = None
        # uid -> the last step's outcome, for rows that carried a proposal.
        self.outcomes: dict[int, Outcome] = {}
        # Proposal length of the last step (0: a plain step), and the rows in it.
        self.last_k = 0
        super().__init__(*args, **kwargs)

    # ---- what the engine calls between steps ----------------------------------------

    def pending(self) -> dict[int, int]:
        """uid -> the token each decoding row feeds next (sampled, not yet in the KV)."""
        if not self.uids or self._next_tokens is None:
            return {}
        tokens: list[int] = self._next_tokens.tolist()  # type: ignore[assignment]
        return dict(zip(self.uids, tokens, strict=True))

    def context(self, uid: int) -> list[int]:
        """The tokens row ``uid``'s KV holds."""
        return self.tokens[self.uids.index(uid)]

    def propose(self, proposals: dict[int, RowProposal]) -> None:
        """The proposals for the next step (rows not named decode plainly)."""
        self._proposals = {uid: p for uid, p in proposals.items() if p.tokens}

    def planned(self) -> dict[int, tuple[int, ...]]:
        """uid -> the tokens proposed for the next step (what distributed followers replay)."""
        return {uid: p.tokens for uid, p in self._proposals.items()}

    def speculable(self) -> bool:
        """Whether this batch's caches can be rolled back (every layer a batch KV)."""
        return all(isinstance(c, _ROLLBACK_CACHES) for c in self.prompt_cache)

    # ---- the step ------------------------------------------------------------------

    def next(self) -> list[Any]:
        proposals, self._proposals = self._proposals, {}
        self.outcomes = {}
        self.last_k = 0
        rows = {i: proposals[uid] for i, uid in enumerate(self.uids) if uid in proposals}
        if not rows or not self.speculable():
            return super().next()
        return self._verify(rows)

    def _verify(self, rows: dict[int, RowProposal]) -> list[Any]:
        B = len(self.uids)
        k = max(len(p.tokens) for p in rows.values())
        self.last_k = k
        x = self._next_tokens
        xs: list[int] = x.tolist()  # type: ignore[assignment]
        prev_logprobs = self._next_logprobs
        drafts = [list(rows[i].tokens) if i in rows else [] for i in range(B)]
        fed = mx.array([[xs[i], *d, *([xs[i]] * (k - len(d)))] for i, d in enumerate(drafts)], dtype=mx.uint32)
        logits = self.model(fed, cache=self.prompt_cache)  # (B, k+1, vocab)

        # Per row: the processed distribution at each position it needs, and its draws.
        logprobs: list[mx.array] = []
        draws: list[Any] = []
        keys: list[Any] = []
        for i in range(B):
            n = len(drafts[i]) + 1
            row = self._processed(i, logits[i, :n], [xs[i], *drafts[i]])
            lp = row - mx.logsumexp(row, axis=-1, keepdims=True)
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

        responses: list[Any] = []
        kept: list[int] = []
        next_tokens: list[int] = []
        next_logprobs: list[mx.array] = []
        finished: list[tuple[int, list[Any]]] = []
        for i in range(B):
            drawn, accepted = decided[i]
            emit = [xs[i], *drafts[i][:accepted]]
            emit_lp = [prev_logprobs[i], *(logprobs[i][j] for j in range(accepted))]
            row_responses, finish = self._respond(i, emit, emit_lp)
            n = len(row_responses)
            kept.append(n)
            self._commit_draw(i, keys[i], n if finish is None else n - 1)
            if i in rows:
                self.outcomes[self.uids[i]] = Outcome(len(drafts[i]), min(accepted, n - 1), n)
            next_tokens.append(drawn[accepted])
            next_logprobs.append(logprobs[i][accepted])
            responses.append(row_responses)
            if finish is not None:
                finished.append((i, row_responses))

        self._rollback(kept, k + 1)
        for i in range(B):
            self.tokens[i].extend([xs[i], *drafts[i]][:kept[i]])
            if self.logits_processors and self.logits_processors[i]:
                self._token_context[i] = TokenBuffer(self.tokens[i])
            rewind = rows[i].rewind if i in rows else None
            if rewind is not None:
                rewind(len(self.tokens[i]))
        self._current_tokens, self._current_logprobs = x, prev_logprobs  # type: ignore[assignment]
        self._next_tokens = mx.array(next_tokens, dtype=mx.uint32)
        self._next_logprobs = next_logprobs

        for i, row_responses in finished:  # the finishing response carries the row's KV
            last = row_responses[-1]
            last.prompt_cache, last.all_tokens = self.extract_cache(i), self.tokens[i]
        if finished:
            done = {i for i, _ in finished}
            self.filter([i for i in range(B) if i not in done])
        return [r for row in responses for r in row]

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
        processors = self.logits_processors[i] if self.logits_processors else ()
        if not processors:
            return logits
        base = self.tokens[i]
        context = mx.array([*base, *fed], dtype=mx.int32)
        out = []
        for j in range(len(fed)):
            row = logits[j:j + 1]
            ctx = context[: len(base) + j + 1]
            for processor in processors:
                row = processor(ctx, row)
            out.append(row)
        return mx.concatenate(out, axis=0)

    def _rejection(self, i: int, proposal: RowProposal | None, logprobs: mx.array) -> tuple[int, int] | None:
        """(kept, next token) by rejection sampling, for a sampling row whose drafter sampled."""
        if proposal is None or proposal.logprobs is None:
            return None
        sampler = self.samplers[i] if self.samplers else None
        if not isinstance(sampler, RowSampler):
            return None
        return sampler.verify_sampled(logprobs, list(proposal.tokens), proposal.logprobs)

    def _draw(self, i: int, logprobs: mx.array) -> tuple[mx.array, list[Any]]:
        sampler = self.samplers[i] if self.samplers else None
        sampler = sampler or self.fallback_sampler
        draw = getattr(sampler, "draw", None)
        if draw is not None:
            return draw(logprobs)
        # mlx-lm's own sampler (greedy, or a row's closure): one call per position.
        return mx.concatenate([sampler(logprobs[j:j + 1]).reshape(-1) for j in range(logprobs.shape[0])]), []

    def _commit_draw(self, i: int, keys: list[Any], emitted_draws: int) -> None:
        sampler = self.samplers[i] if self.samplers else None
        commit = getattr(sampler, "commit", None)
        # Every emitted token but x was a draw of this step, and so is the next token.
        if commit is not None:
            commit(keys, emitted_draws)

    def _respond(self, i: int, emit: list[int], emit_lp: list[mx.array]) -> tuple[list[Any], str | None]:
        """Responses for row ``i``'s emitted tokens, cut at the first that finishes it."""
        out = []
        for token, lp in zip(emit, emit_lp, strict=True):
            finish = None
            self._num_tokens[i] += 1
            if self._num_tokens[i] >= self.max_tokens[i]:
                finish = "length"
            if self._matchers[i].advance(token):
                finish = "stop"
            out.append(self.Response(uid=self.uids[i], token=token, logprobs=lp, finish_reason=finish,
                                     prompt_cache=None, all_tokens=None))
            if finish is not None:
                return out, finish
        return out, None

    def _rollback(self, kept: list[int], fed: int) -> None:
        """Each row keeps its first ``kept[i]`` of the ``fed`` positions just written."""
        longest = max(kept)
        surplus = [longest - n for n in kept]
        for c in self.prompt_cache:
            if fed > longest:
                c.trim(fed - longest)
            if any(surplus):
                c.prepare(right_padding=surplus)
                c.finalize()
                shared = int(c.left_padding.min().item())
                if shared > 0:
                    _shift_left(c, shared)


def _shift_left(c: Any, n: int) -> None:
    """Drop the ``n`` left-padding columns every row of batch cache ``c`` has."""
    cut = lambda x: x[..., n:, :]  # noqa: E731
    if isinstance(c.keys, tuple):  # quantized: (codes, scales, biases)
        c.keys, c.values = tuple(map(cut, c.keys)), tuple(map(cut, c.values))
    else:
        c.keys, c.values = cut(c.keys), cut(c.values)
    c._idx -= n
    c.left_padding = c.left_padding - n


def install(batch_generator: Any, agree: Callable[[mx.array], mx.array] | None = None) -> VerifyBatch:
    """Give ``batch_generator`` a ``VerifyBatch`` as its generation batch (while it has no
    decoding rows: right after it is made); the generator extends it from then on.
    ``agree``: how the ranks of a distributed launch agree on each verify step (``VerifyBatch.agree``)."""
    current = batch_generator._generation_batch
    if not isinstance(current, VerifyBatch):
        if len(current):
            raise RuntimeError("a VerifyBatch is installed before any row decodes")
        current = VerifyBatch.empty(batch_generator.model, batch_generator.sampler)
        batch_generator._generation_batch = current
    current.agree = agree
    return current
