"""Tandem's decode step: continuous batching over the model's public call.

mlx-lm and mlx-vlm give the models, their loaders and their cache classes; the step that
runs a batch of sequences through a model is this one. Each call of ``next()`` is one
step of every row:

    queue        rows inserted since the last step (``insert_segments``), waiting for room
    prefill      one chunk of every prefilling row (``prefill_step_size`` tokens each, in
                 one forward pass; shorter chunks right-padded and rolled left after),
                 stopping at each of a row's segment ends so the engine can take its KV
                 there; a row's last prompt token is held back for its first decode step
    score        rows that only score their prompt's tail (``ScoreSpec``): one forward
                 pass over every such row that reached its tail
    decode       one forward pass over every decoding row: each feeds the token it drew
                 last step (a row just out of prefill: its held-back prompt token), its
                 processors shape the logits, it draws its next token; or, for rows that
                 carry proposals (speculative decoding), a verify pass (``verify``)

The decode pass is pipelined as mlx-lm's is: the next tokens are computed asynchronously
while the host turns this step's tokens into responses.

Rows' caches are mlx-lm's per-layer caches, one kind per layer (``app.engine.kv.layers``):
plain and quantized KV, sliding windows, recurrent state, lists of these. The step works
the same for every kind; where a layer cannot trim (windows, recurrent state), the
verify step snapshots it and replays what a row kept, and a prefilling row's state is
checkpointed at its segment ends and where its prompt ends, for the prefix cache.

This is the surface the text engine drives (``app.engine.batch.engine``): the same calls
mlx-lm's ``BatchGenerator`` took, plus the verify step's (``propose``, ``pending``,
``context``, ``outcomes``) and score rows. One thread (the MLX thread) calls it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from app.engine.kv.layers import SeqCache, nbytes
from app.engine.mlx_internals import TokenBuffer, make_prompt_cache
from app.engine.step.phase import Phase
from app.engine.step.rows import (
    Drawn,
    Feed,
    LogitsProcessor,
    PromptResponse,
    Response,
    Row,
    RowInputs,
    Sampler,
    ScoreResponse,
    ScoreSpec,
    normalize_processors,
)
from app.engine.step.verify import Outcome, RowProposal, Verifier

# The model's call: (tokens (B, L), the batch caches, what each row feeds) -> logits (B, L, vocab).
# A text model's is ``model(tokens, cache=cache)``; a VLM's adapter builds its inputs
# (embeddings, positions) from the rows' ``RowInputs`` and the ``Feed``.
Forward = Callable[[mx.array, list[Any], Feed], mx.array]


# The step's own stream, one per thread (MLX streams are thread-local; the MLX thread uses it).
_STREAM = mx.new_thread_local_stream(mx.default_device())


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


class DecodeBatch:
    """Continuous batching over one model: see the module docstring."""

    def __init__(self, model: Any, *, stop_tokens: Sequence[int], prefill_step_size: int,
                 prefill_batch_size: int, completion_batch_size: int, forward: Forward | None = None,
                 make_cache: Callable[[], list[Any]] | None = None, checkpoints: bool = False,
                 sampler: Sampler = greedy) -> None:
        self.model = model
        self.stop_tokens = frozenset(stop_tokens)
        self.prefill_step_size = prefill_step_size
        self.prefill_batch_size = prefill_batch_size
        self.completion_batch_size = max(completion_batch_size, prefill_batch_size)
        self.fallback_sampler = sampler
        self._forward: Forward = forward or (lambda tokens, cache, _: model(tokens, cache=cache))
        self._make_cache = make_cache or (lambda: make_prompt_cache(model))
        # Keep each prefilling row's untrimmable state at its segment ends and its prompt's end.
        self.checkpoints = checkpoints
        self._uids = 0
        self._queue: deque[Row] = deque()
        self._prefill = Phase()
        self._decode = Phase()
        # The decode phase's rows, as the pipelined step keeps them (row i of each).
        self._next: mx.array | None = None  # the token each row feeds next (drawn, not yet in the KV)
        self._next_lp: Any = None  # the distributions those tokens were drawn from
        self._contexts: list[TokenBuffer | None] = []  # what each row's processors see
        # Rows whose next token is their held-back prompt token: it is fed, not emitted.
        self._fresh: set[int] = set()
        # Score rows whose prefill reached their tail this step, and their batch cache.
        self._scoring: tuple[list[Row], list[Any]] | None = None
        self.verifier = Verifier(self)
        self._stream = _STREAM
        self._wired = _wire()

    # ---- inserting, taking out -------------------------------------------------------------

    def insert_segments(self, segments: list[list[list[int]]], *, max_tokens: list[int],
                        caches: list[list[Any] | None] | None = None, all_tokens: list[list[int]] | None = None,
                        samplers: list[Sampler | None] | None = None,
                        logits_processors: list[Sequence[LogitsProcessor] | None] | None = None,
                        scores: list[ScoreSpec | None] | None = None,
                        inputs: list[RowInputs | None] | None = None,
                        drawn: list[Drawn | None] | None = None) -> list[int]:
        """Queue sequences: each one's prompt in ``segments`` (the tokens after what its
        ``caches`` hold, which ``all_tokens`` names), its budget and sampling. Returns their uids."""
        n = len(segments)
        uids = []
        for i in range(n):
            parts = [list(s) for s in segments[i] if s]
            if not parts:
                raise ValueError("a sequence with an empty prompt")
            if max_tokens[i] <= 0 and not (scores and scores[i]):
                raise ValueError("max_tokens must be > 0")
            score = scores[i] if scores else None
            # Held back from prefill: the last prompt token (fed by the first decode step), or a
            # score row's tail and the token before it (fed by its score pass).
            held = 1 + (score.tail if score is not None else 0)
            parts = _hold_back(parts, held)
            held = len(parts[-1])
            given = caches[i] if caches else None
            cache = given if given is not None else self._make_cache()
            row = Row(uid=self._uids, segments=parts, tokens=list(all_tokens[i]) if all_tokens else [],
                      max_tokens=max_tokens[i], sampler=samplers[i] if samplers else None,
                      processors=normalize_processors(logits_processors[i] if logits_processors else None),
                      cache=list(cache), score=score, held=held, inputs=inputs[i] if inputs else None,
                      drawn=drawn[i] if drawn else None)
            row.total = len(row.tokens) + row.left
            row.done = row.base = len(row.tokens)
            self._uids += 1
            self._queue.append(row)
            uids.append(row.uid)
        return uids

    def _find(self, uid: int) -> tuple[str, int] | None:
        for name, phase in (("decode", self._decode), ("prefill", self._prefill)):
            i = phase.index(uid)
            if i is not None:
                return name, i
        for i, row in enumerate(self._queue):
            if row.uid == uid:
                return "queue", i
        return None

    def extract_cache(self, uids: list[int]) -> dict[int, tuple[SeqCache, list[int]]]:
        """Each row's KV now (a copy, with the checkpoints it took) and the tokens it holds."""
        out = {}
        for uid in uids:
            where = self._find(uid)
            if where is None:
                continue
            name, i = where
            if name == "queue":
                row = self._queue[i]
                out[uid] = (SeqCache(row.cache or [], row.checkpoints), list(row.tokens))
            else:
                phase = self._decode if name == "decode" else self._prefill
                row = phase.rows[i]
                out[uid] = (SeqCache(phase.extract(i), row.checkpoints), list(row.tokens))
        return out

    def checkpoints_of(self, uid: int) -> list[tuple[int, list[Any]]]:
        """The checkpoints a row has taken so far (prefix caching of untrimmable layers)."""
        where = self._find(uid)
        if where is None:
            return []
        name, i = where
        phase = {"decode": self._decode, "prefill": self._prefill}.get(name)
        return list((phase.rows[i] if phase is not None else self._queue[i]).checkpoints)

    def remove(self, uids: list[int], return_prompt_caches: bool = False) -> dict[int, tuple[SeqCache, list[int]]]:
        """Take rows out; with ``return_prompt_caches``, each one's KV and tokens."""
        caches = self.extract_cache(uids) if return_prompt_caches else {}
        gone = set(uids)
        self._queue = deque(r for r in self._queue if r.uid not in gone)
        self._prefill.filter([i for i, r in enumerate(self._prefill.rows) if r.uid not in gone])
        keep = [i for i, r in enumerate(self._decode.rows) if r.uid not in gone]
        self._filter_decode(keep)
        return caches

    @property
    def prompt_cache_nbytes(self) -> int:
        """Bytes of every cache the step holds: queued, prefilling and decoding rows'."""
        queued = sum(nbytes(r.cache) for r in self._queue)
        return queued + self._prefill.nbytes + self._decode.nbytes

    def close(self) -> None:
        """Give back the wired-memory limit (Metal) the step set."""
        if self._wired is not None:
            mx.synchronize(self._stream)
            mx.set_wired_limit(self._wired)
            self._wired = None

    # ---- speculative decoding (``app.engine.step.verify``) -----------------------------------

    def pending(self) -> dict[int, int]:
        """uid -> the token each decoding row feeds next (drawn, not yet in its KV)."""
        if not self._decode.rows or self._next is None:
            return {}
        tokens: list[int] = self._next.tolist()  # type: ignore[assignment]
        return {r.uid: t for r, t in zip(self._decode.rows, tokens, strict=True) if r.uid not in self._fresh}

    def pending_of(self, uid: int) -> tuple[int, Any] | None:
        """A decoding row's drawn token not yet fed (nor emitted), and the distribution it was
        drawn from; None for a row not decoding, or one whose next token is from its prompt."""
        i = self._decode.index(uid)
        if i is None or uid in self._fresh or self._next is None:
            return None
        token: int = self._next[i].tolist()  # type: ignore[assignment]
        return token, self._next_lp[i] if self._next_lp is not None else None

    def context(self, uid: int) -> list[int]:
        """The tokens row ``uid``'s KV holds (the list itself)."""
        i = self._decode.index(uid)
        assert i is not None
        return self._decode.rows[i].tokens

    def propose(self, proposals: dict[int, RowProposal]) -> None:
        self.verifier.propose(proposals)

    def planned(self) -> dict[int, tuple[int, ...]]:
        return self.verifier.planned()

    def speculable(self) -> bool:
        """Every cache kind rolls back (trimmed, or restored and replayed)."""
        return True

    @property
    def outcomes(self) -> dict[int, Outcome]:
        return self.verifier.outcomes

    @property
    def last_k(self) -> int:
        return self.verifier.last_k

    @property
    def agree(self) -> Any:
        return self.verifier.agree

    @agree.setter
    def agree(self, fn: Any) -> None:
        self.verifier.agree = fn

    # ---- the step ---------------------------------------------------------------------------

    def next(self) -> tuple[list[PromptResponse], list[Response | ScoreResponse]]:
        """One step of every row (see the module docstring)."""
        with mx.stream(self._stream):
            prompt_responses = self._step_prefill()
            scored = self._step_score()
            generated = self._step_decode()
        return prompt_responses, [*scored, *generated]

    def _admit(self) -> None:
        """Queued rows into the prefill phase, as the phases' sizes allow."""
        room = min(self.prefill_batch_size - len(self._prefill),
                   self.completion_batch_size - len(self._decode) - len(self._prefill))
        rows = [self._queue.popleft() for _ in range(min(room, len(self._queue)))]
        self._prefill.add(rows)

    def _step_prefill(self) -> list[PromptResponse]:
        if len(self._decode) >= self.completion_batch_size:
            return []
        self._admit()
        phase = self._prefill
        if not phase.rows:
            return []
        chunks = [[] if _ready(row) else row.segments[0][: self.prefill_step_size] for row in phase.rows]
        if any(chunks):
            self._run_chunk(phase, chunks)
        responses: list[PromptResponse] = []
        for i, (row, chunk) in enumerate(zip(phase.rows, chunks, strict=True)):
            end_of_segment = False
            if chunk:
                row.segments[0] = row.segments[0][len(chunk):]
                row.tokens.extend(chunk)
                row.done += len(chunk)
                if not row.segments[0]:
                    row.segments.pop(0)
                    end_of_segment = True
            ready = _ready(row)
            if self.checkpoints and chunk and (end_of_segment or ready):
                row.checkpoints.append((len(row.tokens), phase.checkpoint(i)))
            if chunk or ready:
                progress = (row.total if ready else row.done, row.total)
                responses.append(PromptResponse(row.uid, progress, end_of_segment or ready,
                                                 ready and row.score is None, len(row.tokens)))
        ready_uids = [r.uid for r in phase.rows if _ready(r)]
        scoring = [r.uid for r in phase.rows if r.uid in ready_uids and r.score is not None]
        if scoring:
            self._scoring = phase.take(scoring)
        decoding = [uid for uid in ready_uids if uid not in scoring]
        if decoding:
            self._join_decode(*phase.take(decoding))
        return responses

    def _run_chunk(self, phase: Phase, chunks: list[list[int]]) -> None:
        """One forward pass of every row's chunk: right-padded to the longest, the padding
        rolled out to the left after (each layer's ``prepare`` / ``finalize``)."""
        lengths = [len(c) for c in chunks]
        width = max(lengths)
        padding = [width - n for n in lengths]
        tokens = mx.array([c + [0] * p for c, p in zip(chunks, padding, strict=True)], dtype=mx.uint32)
        if max(padding):
            for c in phase.cache:
                c.prepare(lengths=lengths, right_padding=padding)
        self._forward(tokens, phase.cache, self.feed(phase.rows, lengths))
        mx.eval([c.state for c in phase.cache])
        if max(padding):
            for c in phase.cache:
                c.finalize()
            mx.eval([c.state for c in phase.cache])

    def _step_score(self) -> list[ScoreResponse]:
        """Score rows whose prefill reached their tail: one forward pass over all their tails
        (right-padded: a causal model's logits at a real position never see the padding)."""
        if self._scoring is None:
            return []
        rows, cache = self._scoring
        self._scoring = None
        tails = [row.segments[0] for row in rows]
        width = max(len(t) for t in tails)
        tokens = mx.array([t + [0] * (width - len(t)) for t in tails], dtype=mx.uint32)
        logits = self._forward(tokens, cache, self.feed(rows, [len(t) for t in tails])).astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picks = []
        for i, (row, tail) in enumerate(zip(rows, tails, strict=True)):
            assert row.score is not None
            n = len(tail)
            scored = logprobs[i, mx.arange(n - 1), mx.array(tail[1:], dtype=mx.int32)] if n > 1 else mx.zeros((0,))
            nxt = logprobs[i, n - 1, mx.array(list(row.score.next_tokens), dtype=mx.int32)] \
                if row.score.next_tokens else mx.zeros((0,))
            picks.append((scored, nxt))
        mx.eval(picks)
        return [ScoreResponse(row.uid, tuple(a.tolist()), tuple(b.tolist()))  # type: ignore[arg-type]
                for row, (a, b) in zip(rows, picks, strict=True)]

    def _join_decode(self, rows: list[Row], cache: list[Any]) -> None:
        """Rows out of prefill into the decode phase: each feeds its held-back token next (a
        prompt token, fed not emitted; or, resuming, a token it drew before: emitted)."""
        last = [row.segments[0][0] for row in rows]
        for row in rows:
            row.segments = []
            if row.drawn is None:
                self._fresh.add(row.uid)
        self._decode.add(rows, cache)
        self._contexts.extend(TokenBuffer(r.tokens) if r.processors else None for r in rows)
        new = mx.array(last, dtype=mx.uint32)
        self._next = new if self._next is None or not len(self._decode.rows) - len(rows) else \
            mx.concatenate([self._next, new])
        # A fresh row's fed token was not drawn: no distribution goes with it.
        pad = [r.drawn.logprobs if r.drawn is not None else None for r in rows]
        self._next_lp = pad if self._next_lp is None or len(self._decode.rows) == len(rows) else \
            [*_as_list(self._next_lp), *pad]

    def _filter_decode(self, keep: list[int]) -> None:
        if len(keep) == len(self._decode.rows):
            return
        gone = {r.uid for i, r in enumerate(self._decode.rows) if i not in set(keep)}
        self._fresh -= gone
        self._decode.filter(keep)
        self._contexts = [self._contexts[i] for i in keep]
        if not keep:
            self._next, self._next_lp = None, None
            return
        assert self._next is not None
        self._next = self._next[mx.array(keep)]
        self._next_lp = [_as_list(self._next_lp)[i] for i in keep]

    def _step_decode(self) -> list[Response]:
        phase = self._decode
        if not phase.rows:
            return []
        if self.verifier.ready():
            return self.verifier.step()
        rows = phase.rows
        current = self._next
        assert current is not None
        current_lp = self._next_lp
        logits = self._forward(current[:, None], phase.cache, self.feed(rows, [1] * len(rows), decode=True))[:, -1, :]
        logits, contexts = self._process(logits, current)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        self._next = self._sample(logprobs)
        self._next_lp = logprobs
        mx.async_eval(self._next, logprobs, contexts)
        fed: list[int] = current.tolist()  # type: ignore[assignment]
        return self._emit(rows, fed, current_lp)

    @staticmethod
    def feed(rows: list[Row], lengths: list[int], *, decode: bool = False) -> Feed:
        """What a pass over ``rows`` feeds: each row's next ``lengths`` tokens (see ``Feed``).
        A fresh row's held-back prompt token is the last of its prompt, fed by a decode pass."""
        return Feed(rows, [len(r.tokens) - r.base for r in rows], lengths, decode)

    def _process(self, logits: mx.array, fed: mx.array) -> tuple[mx.array, list[mx.array]]:
        """Each row's processors, in row order, on the context the row sees (its tokens and
        the token just fed); the rows without any keep their logits."""
        rows = self._decode.rows
        if not any(r.processors for r in rows):
            return logits, []
        out, contexts = [], []
        for i, row in enumerate(rows):
            row_logits = logits[i:i + 1]
            buffer = self._contexts[i]
            if row.processors and buffer is not None:
                context = buffer.update_and_fetch(fed[i:i + 1])
                contexts.append(context)
                for processor in row.processors:
                    row_logits = processor(context, row_logits)
            out.append(row_logits)
        return mx.concatenate(out, axis=0), contexts

    def _sample(self, logprobs: mx.array) -> mx.array:
        """One batched call when every row shares a sampler (mlx-lm's rule, which the
        distributed token sync relies on), else one call per row, in row order."""
        samplers = [r.sampler or self.fallback_sampler for r in self._decode.rows]
        if all(s is samplers[0] for s in samplers):
            return samplers[0](logprobs)
        return mx.concatenate([s(logprobs[i:i + 1]).reshape(-1) for i, s in enumerate(samplers)], axis=0)

    def _emit(self, rows: list[Row], fed: list[int], sources: Any) -> list[Response]:
        """The tokens fed this step, as responses: appended to each row's tokens, counted,
        checked against max_tokens and the stop tokens; finished rows leave with their KV."""
        responses: list[Response] = []
        keep: list[int] = []
        for i, (row, token) in enumerate(zip(rows, fed, strict=True)):
            row.tokens.append(token)
            if row.uid in self._fresh:
                self._fresh.discard(row.uid)
                keep.append(i)
                continue
            row.generated += 1
            finish = None
            if row.generated >= row.max_tokens:
                finish = "length"
            if token in self.stop_tokens:
                finish = "stop"
            r = Response(row.uid, token, finish, source=sources, index=i)
            if finish is not None:
                r.prompt_cache, r.all_tokens = SeqCache(self._decode.extract(i), row.checkpoints), row.tokens
            else:
                keep.append(i)
            responses.append(r)
        if len(keep) < len(rows):
            self._filter_decode(keep)
        return responses


def _hold_back(parts: list[list[int]], held: int) -> list[list[int]]:
    """The segments with their last ``held`` tokens as a segment of their own."""
    flat_tail: list[int] = []
    while parts and len(flat_tail) < held:
        last = parts[-1]
        need = held - len(flat_tail)
        flat_tail = last[-need:] + flat_tail
        rest = last[:-need] if need < len(last) else []
        parts = parts[:-1] + ([rest] if rest else [])
    return [*parts, flat_tail]


def _ready(row: Row) -> bool:
    """A prefilling row whose only segment left is what it holds back."""
    return len(row.segments) == 1 and len(row.segments[0]) == row.held


def _as_list(x: Any) -> list[Any]:
    return x if isinstance(x, list) else [x[i] for i in range(x.shape[0])]


def _wire() -> int | None:
    """Metal: wire the recommended working set, as mlx-lm's generators do; the old limit back on close."""
    size = mx.device_info().get("max_recommended_working_set_size") if hasattr(mx, "device_info") else None
    if not size:
        return None
    return int(mx.set_wired_limit(int(size)))
