"""The batch and prompt-cache operations TextEngine makes, run here or on every rank.

``TextEngine`` never makes its decode step (``app.engine.step``), its prefix cache's
memory tier or a quantized cache directly; it calls a ``BatchOps``:

- ``LocalOps`` (one process) makes each call as it is;
- ``MirrorOps`` (rank 0 of a distributed launch) makes each call here and records it,
  and before every batch step sends the record to the other ranks (``control``), whose
  ``Follower`` replays it on its own decode step and prefix cache, over its own shard
  of the model. So every rank runs the same batch steps in lockstep, and rank 0 alone
  decides: admission, priorities, cancellations, stop strings, what is cached.

Caches cross ranks by name: every cache rank 0 gets (a prefix-cache hit, a new
quantized cache, a paused or finished sequence's KV) is a ``TrackedCache``, a list with
a ``handle``; the follower keeps its own cache under the same handle, until rank 0's
copy is garbage (a ``weakref.finalize`` records the drop).

Tokens: every rank samples the same token because rank 0 chooses it and an
``all_sum`` inside the step hands it to the others (rank 0 adds its tokens, the others
0; ``TokenSync``). Followers need no sampler, logits processor or random state of their own, and a
different chip's rounding on another Mac cannot make them drift.

Speculative decoding: rank 0's drafters propose (they run there alone, as does the
adaptive rule that says how many tokens); the step's record carries the proposals
(``propose``), which each follower hands its own verify batch
(``app.engine.step.verify``) before replaying the step, so every rank runs the same
verify forward pass. Rank 0 draws each row's token at each position with the row's own
sampler (``TokenSync.draw``), decides what each row keeps, and one ``all_sum`` of that
(rows, k + 2) table (``TokenSync.agree``; followers add zeros) gives every rank the same
acceptance, emitted tokens, KV rollback and context. The step's ``check`` then compares
every emitted token, as for a plain step.

Prefix cache eviction: a rank's cache holds its own shard, so byte counts differ between
ranks (pipeline stages hold different layer counts), and only rank 0 knows what its
requests hold or share; both caches see the same inserts in the same order, so an
entry has the same ``serial`` on both, and rank 0 sends the serials it evicts.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import mlx.core as mx

from app.engine.kv.kv_quant import make_quantized_prompt_cache
from app.engine.kv.layers import SeqCache
from app.engine.kv.memory_tier import MemoryTier
from app.engine.step import DecodeBatch, Drawn, RowProposal, ScoreSpec, new_decode_batch

log = logging.getLogger("tandem.distributed")

# Seconds without a step after which pending drops go out on their own.
IDLE_FLUSH_S = 0.2


class BatchOps(Protocol):
    """What TextEngine asks of mlx-lm's batching and caching, as one seam."""

    # True when every cache handed out is replayed on other ranks by name: then nothing may
    # make caches of its own around these calls (a disk tier of the prefix cache stays off).
    replicated: bool

    def new_batch(self, model: Any, tokenizer: Any, **settings: Any) -> Any:
        """A decode step (``app.engine.step.new_decode_batch``'s settings)."""

    def prompt_cache(self) -> Any:
        """The prefix cache's memory tier (``app.engine.kv.memory_tier.MemoryTier``)."""

    def quantized_cache(self, model: Any, bits: int, group_size: int, plain: bool = False) -> list[Any]:
        """An empty quantized per-sequence cache (``plain``: handed back dequantized)."""

    def verify_batch(self, batch: Any) -> DecodeBatch:
        """``batch`` (a ``new_batch``) as the decode step that takes proposals each step
        (``DecodeBatch.propose``), the ranks agreeing on each verify step when mirrored."""


class StepWatch(Protocol):
    """Who times each step on rank 0 (the distributed watchdog)."""

    def begin_step(self) -> None: ...

    def end_step(self) -> None: ...


class LocalOps:
    """One process: every call as it is."""

    replicated = False

    def new_batch(self, model: Any, tokenizer: Any, **settings: Any) -> Any:
        return new_decode_batch(model, tokenizer, **settings)

    def prompt_cache(self) -> Any:
        return MemoryTier()

    def quantized_cache(self, model: Any, bits: int, group_size: int, plain: bool = False) -> list[Any]:
        return make_quantized_prompt_cache(model, bits, group_size, plain=plain)

    def verify_batch(self, batch: Any) -> DecodeBatch:
        return batch


LOCAL_OPS = LocalOps()


class DesyncError(RuntimeError):
    """A follower's batch no longer matches rank 0's: it cannot go on."""


class TrackedCache(SeqCache):
    """A per-sequence cache on rank 0 (its checkpoints with it), named on every rank by ``handle``."""

    handle: int


def _handle(cache: Any) -> int:
    handle = getattr(cache, "handle", None)
    if handle is None:
        raise DesyncError("a cache that did not come through MirrorOps reached it (distributed mode "
                          "mirrors every cache it hands out; see app/engine/step/mirror.py)")
    return int(handle)


Sampler = Callable[[mx.array], mx.array]


class TokenSync:
    """Rank 0's sampler for the whole batch: each row's token, by the row's own sampler, then
    one all_sum that hands every token to every rank.

    Every row gets this same object as its sampler (so mlx-lm samples the batch in one call)
    and, as its last logits processor, ``row(sampler)``: mlx-lm runs the rows' processors in
    row order just before sampling, in the same step, so the batch call finds the rows'
    samplers in order. One collective per step, whatever the batch size.

    A speculative verify step (``VerifyBatch``) runs each row's processors once per position,
    then draws that row's tokens (``draw``: the marks name the row's sampler), row by row, and
    hands its decisions to every rank in one collective (``agree``).
    """

    def __init__(self) -> None:
        self._rows: list[Sampler] = []

    def row(self, sampler: Sampler) -> Callable[[mx.array, mx.array], mx.array]:
        def mark(tokens: mx.array, logits: mx.array) -> mx.array:
            self._rows.append(sampler)
            return logits

        return mark

    def __call__(self, logprobs: mx.array) -> mx.array:
        rows, self._rows = self._rows, []
        if len(rows) != logprobs.shape[0]:
            raise DesyncError(f"{len(rows)} row samplers for a batch of {logprobs.shape[0]} (mlx-lm's sampling "
                              "order changed?)")
        tokens = [sample(logprobs[e:e + 1]).reshape(-1) for e, sample in enumerate(rows)]
        return mx.distributed.all_sum(mx.concatenate(tokens).astype(mx.uint32))

    # ---- the speculative verify step (``VerifyBatch``) ---------------------------------------

    def draw(self, logprobs: mx.array) -> tuple[mx.array, list[Any]]:
        """One row's tokens at each of its positions in a verify step, by the row's own sampler,
        on rank 0 only: ``agree`` hands them on once for the whole step. The verify step runs a
        row's processors once per position, then draws: its marks are all that was recorded."""
        rows, self._rows = self._rows, []
        if len(rows) != logprobs.shape[0] or any(r is not rows[0] for r in rows):
            raise DesyncError(f"{len(rows)} row samplers for {logprobs.shape[0]} positions of one row in a verify "
                              "step")
        sampler = rows[0]
        draw = getattr(sampler, "draw", None)
        if draw is not None:
            tokens, keys = draw(logprobs)
            return tokens, [sampler, keys]
        tokens = mx.concatenate([sampler(logprobs[j:j + 1]).reshape(-1) for j in range(logprobs.shape[0])])
        return tokens, [sampler, []]

    def commit(self, keys: list[Any], kept: int) -> None:
        """``kept`` of a ``draw``'s tokens were emitted: the row's sampler told (a seeded row's key)."""
        sampler, inner = keys
        commit = getattr(sampler, "commit", None)
        if commit is not None:
            commit(inner, kept)

    @staticmethod
    def agree(table: mx.array) -> mx.array:
        """Rank 0's verify table to every rank (the followers add zeros: ``follower_agree``)."""
        return mx.distributed.all_sum(table)


class FollowerSampler:
    """A follower's part of ``TokenSync``: 0 for every row, computed from the logits so that
    the all_sum comes after the model's own collectives in the step, as on rank 0."""

    def __call__(self, logprobs: mx.array) -> mx.array:
        return mx.distributed.all_sum(mx.argmax(logprobs, axis=-1).astype(mx.uint32) * 0)

    def draw(self, logprobs: mx.array) -> tuple[mx.array, list[Any]]:
        """A verify step's draws: zeros, and no collective (``follower_agree`` is the step's one)."""
        return mx.argmax(logprobs, axis=-1).astype(mx.uint32) * 0, []


follower_sampler = FollowerSampler()


def follower_agree(table: mx.array) -> mx.array:
    """A follower's part of ``TokenSync.agree``: zeros, so the sum is rank 0's table. The verify
    step evaluated its forward pass before (the model's collectives come first, as on rank 0)."""
    return mx.distributed.all_sum(table * 0)


class MirrorOps:
    """Rank 0: make each call, record it, send the record before every batch step."""

    replicated = True

    def __init__(self, send: Callable[[dict[str, Any]], None], watch: StepWatch) -> None:
        self._send = send
        self._watch = watch
        self._ops: list[list[Any]] = []
        # Appended from any thread (finalizers); drained by the MLX thread at each send.
        self._drops: deque[int] = deque()
        self._handles = itertools.count(1)
        self.token_sync = TokenSync()
        self._last_send = time.monotonic()
        self.failed = False

    # ---- BatchOps ------------------------------------------------------------------------

    def new_batch(self, model: Any, tokenizer: Any, **settings: Any) -> Any:
        if self.failed:
            raise DesyncError("a batch step failed on rank 0; the ranks can no longer be kept in step")
        self._ops.append(["batch", settings])
        return _MirroredBatch(self, new_decode_batch(model, tokenizer, **settings))

    def prompt_cache(self) -> Any:
        return _MirroredPromptCache(self, MemoryTier())

    def quantized_cache(self, model: Any, bits: int, group_size: int, plain: bool = False) -> list[Any]:
        cache = self.track(make_quantized_prompt_cache(model, bits, group_size, plain=plain))
        self._ops.append(["qcache", cache.handle, bits, group_size, plain])
        return cache

    def verify_batch(self, batch: Any) -> DecodeBatch:
        if not isinstance(batch, _MirroredBatch):
            raise DesyncError("a batch that did not come through MirrorOps.new_batch")
        batch.bg.agree = self.token_sync.agree
        batch.verify = batch.bg
        self._ops.append(["verify"])
        return batch.bg

    # ---- recording and sending -----------------------------------------------------------

    def track(self, cache: list[Any]) -> TrackedCache:
        tracked = TrackedCache(cache)
        tracked.handle = next(self._handles)
        weakref.finalize(tracked, self._drops.append, tracked.handle)
        return tracked

    def record(self, op: list[Any]) -> None:
        self._ops.append(op)

    def step(self, batch: Any) -> tuple[list[Any], list[Any]]:
        """Send the record, then run one batch step here while every follower runs it.
        MLX thread only. A failure leaves the followers' state unknown: no fresh batch
        can be made to match it (``failed``), so the engine stops."""
        self._watch.begin_step()
        try:
            self._send_record(step=True)
            return batch.next()
        except BaseException:
            self.failed = True
            raise
        finally:
            self._watch.end_step()

    def flush_idle(self) -> bool:
        """A worker stepper: between requests, send what was recorded since the last step
        (mostly drops, so followers free those caches' memory). Never busy."""
        if (self._ops or self._drops) and time.monotonic() - self._last_send > IDLE_FLUSH_S:
            self._watch.begin_step()
            try:
                self._send_record(step=False)
            finally:
                self._watch.end_step()
        return False

    def _send_record(self, *, step: bool) -> None:
        ops, self._ops = self._ops, []
        # After taking the ops: a drop drained here names a cache whose making is in them or sent before.
        drops = [self._drops.popleft() for _ in range(len(self._drops))]
        if drops:
            ops.append(["drop", drops])
        self._send({"t": "step", "ops": ops, "step": step})
        self._last_send = time.monotonic()


class _MirroredBatch:
    """Rank 0's decode step: the calls TextEngine makes, each made and recorded."""

    def __init__(self, ops: MirrorOps, bg: Any) -> None:
        self._ops = ops
        self.bg = bg
        # Its speculative verify batch (``MirrorOps.verify_batch``): each step sends its proposals.
        self.verify: DecodeBatch | None = None

    def insert_segments(self, segments: list[list[list[int]]], *, max_tokens: list[int],
                        caches: list[Any] | None, all_tokens: list[list[int]], samplers: list[Any],
                        logits_processors: list[Any], drawn: list[Drawn | None] | None = None,
                        scores: list[ScoreSpec | None] | None = None, inputs: list[Any] | None = None) -> list[int]:
        if inputs is not None and any(i is not None for i in inputs):
            raise DesyncError("a VLM's rows are never split across ranks")
        handles = [None if c is None else _handle(c) for c in caches] if caches is not None else None
        plain = [None if c is None else list(c) for c in caches] if caches is not None else None
        uids = self.bg.insert_segments(segments, max_tokens=max_tokens, caches=plain, all_tokens=all_tokens,
                                       samplers=[self._ops.token_sync] * len(samplers),
                                       logits_processors=[[*procs, self._ops.token_sync.row(sample)]
                                                          for procs, sample in zip(logits_processors, samplers,
                                                                                   strict=True)],
                                       drawn=drawn, scores=scores)
        # Followers need only whether a row resumes with a drawn token (rank 0 alone samples)
        # and what a score row scores.
        marks = [d is not None for d in drawn] if drawn else None
        spec = [None if sc is None else [sc.tail, list(sc.next_tokens)] for sc in scores] if scores else None
        self._ops.record(["insert", segments, max_tokens, handles, all_tokens, uids, marks, spec])
        return list(uids)

    def remove(self, uids: list[int], return_prompt_caches: bool = False) -> dict[int, Any]:
        caches = self.bg.remove(uids, return_prompt_caches=return_prompt_caches)
        tracked = self._track(caches)
        self._ops.record(["remove", uids, [[uid, c.handle] for uid, (c, _) in tracked.items()]
                          if return_prompt_caches else None])
        return tracked

    def extract_cache(self, uids: list[int]) -> dict[int, Any]:
        tracked = self._track(self.bg.extract_cache(uids))
        self._ops.record(["extract", [[uid, c.handle] for uid, (c, _) in tracked.items()]])
        return tracked

    def next(self) -> tuple[list[Any], list[Any]]:
        """One batch step on every rank."""
        ops = self._ops
        # A batch that cannot roll back ignores its proposals (``VerifyBatch.next``): none sent.
        planned = self.verify.planned() if self.verify is not None and self.verify.speculable() else {}
        if planned:
            ops.record(["propose", [[uid, list(tokens)] for uid, tokens in planned.items()]])
        prompt_responses, gen_responses = ops.step(self.bg)
        finished = []
        for r in gen_responses:
            if r.finish_reason is not None and r.prompt_cache is not None:
                r.prompt_cache = ops.track(r.prompt_cache)
                finished.append([r.uid, r.prompt_cache.handle])
        ops.record(["check", [[r.uid, r.token, r.finish_reason] for r in gen_responses]])
        if finished:
            ops.record(["finished", finished])
        return prompt_responses, gen_responses

    def close(self) -> None:
        self.bg.close()

    def pending_of(self, uid: int) -> tuple[int, Any] | None:
        """A decoding row's drawn token not yet fed: the same on every rank (rank 0's draws reach
        every rank through the step's all_sum), so nothing is recorded."""
        return self.bg.pending_of(uid)

    @property
    def prompt_cache_nbytes(self) -> int:
        return int(self.bg.prompt_cache_nbytes)

    @property
    def prefill_step_size(self) -> int:
        return int(self.bg.prefill_step_size)

    @prefill_step_size.setter
    def prefill_step_size(self, chunk: int) -> None:
        """The next steps' prefill chunk (``pacing``), on every rank: the ranks must prefill alike."""
        self.bg.prefill_step_size = chunk
        self._ops.record(["chunk", chunk])

    def _track(self, caches: dict[int, Any]) -> dict[int, Any]:
        return {uid: (self._ops.track(cache), tokens) for uid, (cache, tokens) in caches.items()}


class _MirroredPromptCache:
    """Rank 0's memory tier: lookups, inserts and evictions, each made and recorded. Both ranks
    insert in the same order, so an entry has the same ``serial`` on both; evictions travel
    as serials (rank 0 alone knows the order it evicts in)."""

    def __init__(self, ops: MirrorOps, cache: Any) -> None:
        self._ops = ops
        self._cache = cache

    @property
    def nbytes(self) -> int:
        return int(self._cache.nbytes)

    def __len__(self) -> int:
        return len(self._cache)

    def nearest(self, key: str, tokens: list[int]) -> Any:
        return self._cache.nearest(key, tokens)

    def entries(self) -> Any:
        return self._cache.entries()

    def pin(self, key: str, tokens: list[int], until: float) -> bool:
        return bool(self._cache.pin(key, tokens, until))

    def fetch_nearest_cache(self, key: str, tokens: list[int]) -> tuple[Any, list[int]]:
        cache, rest = self._cache.fetch_nearest_cache(key, tokens)
        if cache is None:  # a miss here is a miss on every rank: nothing to send
            return None, rest
        tracked = self._ops.track(cache)
        self._ops.record(["fetch", tracked.handle, key, list(tokens), len(rest)])
        return tracked, rest

    def insert_cache(self, key: str, tokens: list[int], cache: Any, *, cache_type: str = "assistant",
                     owner: str = "", pinned_until: float = 0.0) -> None:
        before = self._cache.serials()
        self._cache.insert_cache(key, tokens, SeqCache(cache), cache_type=cache_type, owner=owner,
                                 pinned_until=pinned_until)
        self._ops.record(["store", key, list(tokens), _handle(cache), cache_type])
        self._record_evictions(before - self._cache.serials())

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None, order: Any = None) -> None:
        before = self._cache.serials()
        self._cache.trim_to(n_sequences=n_sequences, n_bytes=n_bytes, order=order)
        self._record_evictions(before - self._cache.serials())

    def _record_evictions(self, gone: set[int]) -> None:
        if gone:
            self._ops.record(["evict", sorted(gone)])


class Follower:
    """A follower rank's batch and prompt cache, replaying rank 0's record. MLX thread only."""

    def __init__(self, model: Any, tokenizer: Any, sampler: Sampler = follower_sampler,
                 agree: Callable[[mx.array], mx.array] = follower_agree) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self._sampler = sampler  # every row's: one call, one all_sum per step (TokenSync)
        self._agree = agree  # a verify step's one all_sum (TokenSync.agree)
        self.batch: Any = None
        self.verify: DecodeBatch | None = None
        # Unbounded: rank 0 says how many entries to keep.
        self.prompt_cache = MemoryTier()
        self.caches: dict[int, list[Any]] = {}
        self.steps = 0
        self._finished: dict[int, list[Any]] = {}
        self._last: list[list[Any]] = []

    def apply(self, msg: dict[str, Any]) -> None:
        """One message from rank 0: its ops in order, then the batch step it asks for."""
        for op in msg["ops"]:
            getattr(self, "_op_" + op[0])(*op[1:])
        if msg["step"]:
            self._step()

    def _step(self) -> None:
        if self.batch is None:
            raise DesyncError("rank 0 asked for a batch step before making a batch")
        _, gen = self.batch.next()
        self.steps += 1
        self._finished = {r.uid: r.prompt_cache for r in gen if r.finish_reason is not None}
        self._last = [[r.uid, r.token, r.finish_reason] for r in gen]

    def _op_batch(self, settings: dict[str, Any]) -> None:
        if self.batch is not None:
            self.batch.close()
        self.batch = new_decode_batch(self.model, self.tokenizer, **settings)
        self.verify = None

    def _op_verify(self) -> None:
        self.batch.agree = self._agree
        self.verify = self.batch

    def _op_propose(self, rows: list[list[Any]]) -> None:
        if self.verify is None:
            raise DesyncError("rank 0 sent proposals for a batch that does not speculate here")
        missing = {uid for uid, _ in rows} - set(self.verify.pending())
        if missing:
            raise DesyncError(f"rank 0 proposed for rows this rank cannot verify ({sorted(missing)} not decoding)")
        self.verify.propose({uid: RowProposal(tuple(tokens)) for uid, tokens in rows})

    def _op_chunk(self, chunk: int) -> None:
        self.batch.prefill_step_size = chunk

    def _op_fetch(self, handle: int, key: str, tokens: list[int], n_rest: int) -> None:
        cache, rest = self.prompt_cache.fetch_nearest_cache(key, tokens)
        if cache is None or len(rest) != n_rest:
            raise DesyncError(f"prefix cache lookup differs from rank 0's (rest {len(rest)} vs {n_rest} tokens)")
        self.caches[handle] = cache

    def _op_qcache(self, handle: int, bits: int, group_size: int, plain: bool = False) -> None:
        self.caches[handle] = make_quantized_prompt_cache(self.model, bits, group_size, plain=plain)

    def _op_insert(self, segments: list[list[list[int]]], max_tokens: list[int], handles: list[int | None] | None,
                   all_tokens: list[list[int]], uids: list[int], marks: list[bool] | None = None,
                   spec: list[Any] | None = None) -> None:
        caches = [None if h is None else self._cache(h) for h in handles] if handles is not None else None
        drawn = [Drawn() if m else None for m in marks] if marks else None
        scores = [None if sc is None else ScoreSpec(sc[0], tuple(sc[1])) for sc in spec] if spec else None
        got = self.batch.insert_segments(segments, max_tokens=max_tokens, caches=caches, all_tokens=all_tokens,
                                         samplers=[self._sampler] * len(segments), drawn=drawn, scores=scores)
        if list(got) != uids:
            raise DesyncError(f"sequence ids differ from rank 0's ({list(got)} vs {uids})")

    def _op_remove(self, uids: list[int], handles: list[list[int]] | None) -> None:
        caches = self.batch.remove(uids, return_prompt_caches=handles is not None)
        for uid, handle in handles or ():
            self.caches[handle] = caches[uid][0]

    def _op_extract(self, handles: list[list[int]]) -> None:
        caches = self.batch.extract_cache([uid for uid, _ in handles])
        for uid, handle in handles:
            self.caches[handle] = caches[uid][0]

    def _op_finished(self, handles: list[list[int]]) -> None:
        for uid, handle in handles:
            self.caches[handle] = self._finished[uid]

    def _op_check(self, expected: list[list[Any]]) -> None:
        if expected != self._last:
            raise DesyncError(f"step {self.steps} differs from rank 0's: {self._last[:4]} vs {expected[:4]}")

    def _op_store(self, key: str, tokens: list[int], handle: int, cache_type: str) -> None:
        self.prompt_cache.insert_cache(key, tokens, SeqCache(self._cache(handle)), cache_type=cache_type)

    def _op_evict(self, serials: list[int]) -> None:
        self.prompt_cache.evict_serials(set(serials))

    def _op_drop(self, handles: list[int]) -> None:
        for handle in handles:
            self.caches.pop(handle, None)

    def _cache(self, handle: int) -> list[Any]:
        try:
            return self.caches[handle]
        except KeyError:
            raise DesyncError(f"rank 0 named cache {handle}, which this rank does not hold") from None

    def close(self) -> None:
        if self.batch is not None:
            self.batch.close()
        self.caches.clear()
        self.prompt_cache.trim_to(n_sequences=0)
