"""The text engine: Tandem's decode step (``app.engine.step``) driven from the MLX-owner thread.

The request lifecycle is ``BatchingEngine``'s (``app.engine.batch.batching``): the
inbox, admission against the KV budget (``admission``: what MLX will really
allocate), cancellations, queue expiry, stop strings, one ``GenerationRecord``
to the listeners per generation, failing one request or one batch step alone.
What is this engine's own:

    _insert          an admitted request gets the KV of its longest cached prefix
                     from the prefix cache (``prefix_cache``: memory, then disk; taken
                     before admission made room for it, if it had to), its sampler,
                     logits processors and constraint, and is inserted into the step,
                     its prompt split where a prefix is to be cached (``_store_points``:
                     the prefix ``cache_prefix_len`` names, and each cache breakpoint a
                     client set), each cached when prefill reaches it, a breakpoint's
                     pinned for its TTL; one cached already is pinned again
    shared prefixes  a request whose cacheable prefix a running row is prefilling waits
                     for it (``_held``) and then reads it from the cache: concurrent
                     requests with one system prompt, a decision's questions about one
                     input, compute it once
    score rows       prefill-only rows (``GenerationRequest.score``: a decision's
                     options) are the step's score rows; their answer is the final delta
    each token       logprobs from the step's responses; a finished conversation's KV
                     (with its checkpoints, where its layers cannot trim) goes to the
                     prefix cache (``prompt_cache: prefix``)
    before each step every row's reservation grown to what it holds plus a KV step
                     (``_fit_reservations``), and the prefill chunk sized by time
                     (``pacing``: every step within its budget, at the prefill rate
                     measured on this model)
    a cancellation   the row's KV goes to the prefix cache too, a prefill cut short
                     included: the retry of a request its client gave up on resumes there
    after each step  the memory tier trimmed to what the reservations leave, and
                     the bytes MLX's caches hold measured (``_settle``)
    speculation      each row's drafters opened in ``_insert``, asked before a step
                     (``_propose``) and told after it (``_on_batch_next``); the step
                     verifies the proposals (``app.engine.step.verify``; the drafters:
                     ``app.engine.speculative``), on every cache kind

Memory: when the rows' growth does not fit the KV budget, the prefix cache is
evicted first, then the lowest-priority row (background first, then the widest,
then the newest) leaves the batch: its KV goes to the prefix cache (and the disk
tier), its reservation is given back, and it waits at the head of the queue, to
resume from that prefix when room returns (``_pause_for_memory``), feeding first the
token it had drawn. Its sampler, processors and detokenizer stay with it, so at
temperature 0 its output is what it would have been.

Priority: while an interactive request waits for its first token (queued, or
in prefill), background requests (titles, tags, follow-ups) are not admitted,
those in prefill are paused, and those decoding keep at most
``background_share`` of the batch; the rest are paused too. A paused sequence
leaves the batch with its KV (``remove(..., return_prompt_caches=True)``) and the
token it had drawn, keeps its reservation, and is inserted again with both once no
interactive request waits (``Drawn``: the token is fed and emitted then).

Every decode-step, prefix-cache and quantized-cache call goes through ``ops``
(``app.engine.step.mirror.BatchOps``): made here, or, distributed, made here and
replayed on every other rank.
"""

from __future__ import annotations

import hashlib
import logging
import time
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx

from app.engine.batch.admission import KV_STEP, prefill_span, reservation, sequence_width
from app.engine.batch.batching import BatchingEngine, Seq
from app.engine.batch.pacing import PrefillPacer
from app.engine.batch.stops import StopMatcher
from app.engine.batch.vision_rows import VisionRows
from app.engine.kv.disk_cache import disk_root, open_disk_tier
from app.engine.kv.kv_layout import model_layout
from app.engine.kv.layers import nbytes
from app.engine.kv.prefix_cache import DISK_WRITES_WAIT_S, PrefixCache
from app.engine.mlx_internals import new_detokenizer
from app.engine.models.loader import KV_GROUP_SIZE, LoadedModel
from app.engine.models.vlm import LoadedVlm
from app.engine.params import EngineParams
from app.engine.prompt import MultimodalPrompt, TextPrompts
from app.engine.speculative import DraftSource
from app.engine.speculative.rows import RowDrafts, Speculator
from app.engine.step import DecodeBatch, Drawn, RowInputs, ScoreSpec
from app.engine.step.mirror import LOCAL_OPS, BatchOps
from app.engine.step.reasoning import BudgetProcessor
from app.engine.step.sampling import build_logits_processors, build_sampler
from app.engine.types import EngineStats, GenerationRequest, ScoreRequest
from app.engine.worker import MLXWorker
from app.errors import AppError, ContextLengthError, EngineError, InvalidRequestError, VisionNotSupportedError

log = logging.getLogger("tandem.engine")


def check_score(score: ScoreRequest, prompt_len: int, vocab_size: int | None) -> None:
    """Refuse a score row that cannot be read: nothing asked, a tail that leaves no token
    before it, a candidate token outside the vocabulary."""
    if score.tail < 0 or (score.tail == 0 and not score.next_tokens):
        raise InvalidRequestError("a score request reads a tail of the prompt or candidate next tokens")
    if score.tail >= prompt_len:
        raise InvalidRequestError(f"a score tail of {score.tail} tokens needs a longer prompt than {prompt_len}")
    if vocab_size and any(not 0 <= t < vocab_size for t in score.next_tokens):
        raise InvalidRequestError(f"a candidate next token is not a token id of this model (0..{vocab_size - 1})")



@dataclass(eq=False)
class _Seq(Seq):
    # Where its prompt splits for the prefix cache (``_store_points``): length -> pin seconds
    # (0: an entry kept by LRU alone); and those its prefill has still to reach (``_insert``).
    points: dict[int, float] = field(default_factory=dict)
    stores: dict[int, float] = field(default_factory=dict)
    # Its shared prefix (cache key, digest of the tokens): ``_filling`` names the row computing it.
    shares: tuple[str, str] | None = None
    sampler: Any = None
    processors: list[Any] = field(default_factory=list)
    # While paused for interactive work: the KV it had (cache, the tokens in it, the token it
    # had drawn and not fed yet with its distribution, if any).
    paused: tuple[Any, list[int], tuple[int, Any] | None] | None = None
    # Columns its prompt may span while prefilled (``admission.prefill_span``), and whether it is prefilling.
    prefill: int = 0
    prefilling: bool = True
    # Paused for memory: its KV went to the prefix cache under these tokens, and it waits to
    # resume (with the token it had drawn, as ``paused``).
    requeued: tuple[list[int], tuple[int, Any] | None] | None = None
    # Its drafters (speculative decoding), when it has any.
    drafts: RowDrafts | None = None
    # Its cached prefix, taken before admission made room for it (``_evict``): (cache, the tokens
    # left to prefill); what it then starts from.
    prefetched: tuple[Any, list[int]] | None = None
    # Its prompt as the prefix cache keys it (a VLM's: each image's span its pixel digest).
    key: list[int] = field(default_factory=list)
    # A VLM row's inputs as it was inserted (``VisionRows.inputs``), from its ``base`` tokens on.
    inputs: RowInputs | None = None
    base: int = 0

    @property
    def suspended(self) -> bool:
        return self.paused is not None


class TextEngine(BatchingEngine[_Seq, "LoadedModel | LoadedVlm"]):
    """Continuous batching for one loaded chat model, a text model or a native VLM."""

    def __init__(self, worker: MLXWorker, loaded: LoadedModel | LoadedVlm, params: EngineParams, *,
                 ops: BatchOps = LOCAL_OPS, clock: Callable[[], float] = time.perf_counter,
                 draft: DraftSource | None = None, vision: VisionRows | None = None) -> None:
        super().__init__(worker, loaded, params)
        # Every decode-step, prompt-cache and quantized-cache call goes through ops: made here, or
        # (distributed, app.engine.step.mirror) made here and replayed by every other rank.
        self.ops = ops
        # A native VLM's part (``vision_rows``): its prompts, its step's forward call, its rows' inputs.
        self.vision = vision
        self.prompts = vision.prompts if vision is not None else TextPrompts(self.tokenizer)
        self.bytes_per_token = loaded.kv.bytes_per_token
        bits = loaded.kv_cache_bits
        disk = None
        # Distributed, every rank replays rank 0's cache calls by name: a disk tier would make caches of its own.
        if params.prompt_cache_disk_bytes and not ops.replicated:
            # The tensors this model's caches are made of, layer by layer: what its disk tier reads and writes.
            if vision is not None:
                identity, layout = vision.identity(), lambda: vision.layout(bits, KV_GROUP_SIZE)
            else:
                assert isinstance(loaded, LoadedModel)
                identity = loaded.kv_identity
                layout = lambda: model_layout(loaded.model, bits, KV_GROUP_SIZE,  # noqa: E731
                                              plain=loaded.kv_plain_attention)
            disk = open_disk_tier(disk_root(params.prompt_cache_disk_dir), loaded.name, identity,
                                  params.prompt_cache_disk_bytes, params.prompt_cache_disk_queue_mb * 2**20,
                                  layout, key_share=params.prompt_cache_key_share,
                                  pin_share=params.prompt_cache_pin_share)
        self.prompt_cache = PrefixCache(ops.prompt_cache(), params.prompt_cache_entries,
                                        params.prompt_cache_bytes, disk, key_share=params.prompt_cache_key_share,
                                        pin_share=params.prompt_cache_pin_share)
        self._kv_bytes = 0
        self.cache_hits = 0
        self.cache_tokens_saved = 0
        self.background_pauses = 0
        # Rows paused because the KV budget could not take their growth.
        self.memory_pauses = 0
        self._paused: deque[_Seq] = deque()
        # Shared prefixes being computed, and the row computing each (``_held``).
        self._filling: dict[tuple[str, str], _Seq] = {}
        # Prefill chunks sized by time while rows decode (``pacing``), timed on ``clock``.
        self.pacer = PrefillPacer(params.prefill_chunk_size, params.prefill_step_ms / 1000)
        self._clock = clock
        self._progress: dict[int, int] = {}
        self._prefilled = 0
        self._last_wait_log = 0.0
        # Speculative decoding (``app.engine.speculative.rows``); None where this model cannot roll its KV back.
        self.speculator = self._speculator(draft)
        self._verify: DecodeBatch | None = None
        self._step_start = 0.0
        self._bg = self._new_batch()
        worker.add_stepper(self._step, self._on_worker_death)
        log.info(
            "model %s: KV %d bytes/token, budget %d tokens, prefix cache %d MB, on disk %s; EngineParams %s",
            loaded.name, self.bytes_per_token, self.admission.budget_tokens, params.prompt_cache_bytes // 2**20,
            f"{params.prompt_cache_disk_mb} MB in {disk.dir}" if disk else "off", params.to_log_string(),
        )

    def _new_batch(self) -> DecodeBatch:
        p = self.params
        settings: dict[str, Any] = dict(
            completion_batch_size=p.max_num_seqs, prefill_batch_size=min(p.max_num_seqs, p.prefill_batch_size),
            prefill_step_size=p.prefill_chunk_size,
            # Rows are checkpointed where prompts and segments end: layers that cannot trim (windows,
            # recurrent state) keep their state there, so the prefix cache can restore a conversation
            # there; for layers that trim it is a position only (what the disk tier indexes).
            checkpoints=p.prompt_cache != "off",
        )
        if self.vision is not None:  # one process: a VLM is never split across ranks
            bg = self.vision.new_batch(**settings)
        else:
            bg = self.ops.new_batch(self.loaded.model, self.tokenizer, max_tokens=512, **settings)
        if self.speculator is not None:
            self._verify = self.ops.verify_batch(bg)
        return bg

    def _speculator(self, draft: DraftSource | None) -> Speculator | None:
        spec = self.params.speculative
        if spec.tokens <= 0:
            return None
        return Speculator(self.loaded.name, spec, draft)

    # ---- called from the event loop -------------------------------------------------

    async def _open(self, req: GenerationRequest) -> _Seq:
        if self.vision is not None:
            self.vision.check(req)
        elif isinstance(req.prompt, MultimodalPrompt):
            raise VisionNotSupportedError(f"model {self.loaded.name} does not accept images")
        p, n = self.params, len(req.prompt_tokens)
        limit = min(self.loaded.max_model_len, self.admission.max_sequence_tokens)
        if n + req.max_tokens > limit:  # the pipeline's completion budget keeps within it
            expanded = " with its images expanded" if isinstance(req.prompt, MultimodalPrompt) else ""
            raise ContextLengthError(
                f"the prompt has {n} tokens{expanded} and asks for {req.max_tokens} more; this model takes {limit} "
                f"in all (context {self.loaded.max_model_len}, KV budget {self.admission.max_sequence_tokens})",
                param="messages")
        max_tokens = req.max_tokens
        if req.score is not None:  # a prefill-only row: its prompt's KV, no more
            check_score(req.score, n, self.vocab_size)
            max_tokens = 0
        # Its prompt is prefilled in a segment more for each prefix to cache on the way (``_insert``);
        # each may pad a chunk. A request that fits without them is served without the points its
        # padding has no room for (the least kept go first: unpinned, then the shortest pins).
        chunk = p.prefill_chunk_size
        points = self._store_points(req, n)
        while points and (sequence_width(n, max_tokens, segments=1 + len(points), chunk=chunk)
                          > self.admission.max_sequence_tokens):
            del points[min(points, key=lambda at: (points[at], at))]
        segments = 1 + len(points)
        return _Seq(req, self._streams.open(), sequence_width(n, max_tokens, segments=segments, chunk=chunk), n,
                    prefill=prefill_span(n, segments=segments, chunk=chunk), points=points)

    def _store_points(self, req: GenerationRequest, n: int) -> dict[int, float]:
        """Where ``req``'s prompt of ``n`` tokens is cached on the way (length -> pin seconds):
        the prefix it names (``cache_prefix_len``: a system prompt, a decision's input) unless
        it asks for breakpoints only, and each cache breakpoint, pinned for its TTL. Prefixes
        shorter than ``cache_min_tokens`` are not worth an entry, unless shared on purpose."""
        p = self.params
        if p.prompt_cache == "off" and not req.share_prefix:
            return {}
        least = 1 if req.share_prefix else p.cache_min_tokens
        points: dict[int, float] = {}
        prefix = req.cache_prefix_len
        if req.cache_implicit and prefix and least <= prefix < n:
            points[prefix] = 0.0
        for mark in req.cache_breakpoints:
            if least <= mark.tokens < n:
                points[mark.tokens] = max(points.get(mark.tokens, 0.0), float(mark.ttl_s))
        return points

    def close(self) -> None:
        """Leave the MLX loop and drop the model's arrays (an unload). MLX thread only,
        with nothing queued or running. The prefix cache's queued disk writes finish
        first: the prefixes stay on disk for the next load."""
        super().close()
        self._bg.close()
        if not self.prompt_cache.close(DISK_WRITES_WAIT_S):
            log.warning("model %s: prompt cache writes still queued after %gs were dropped", self.name,
                        DISK_WRITES_WAIT_S)
        self.prompt_cache.collect()
        self.prompt_cache.trim_to(n_bytes=0)
        if self.vision is not None:
            self.vision.close()

    def finish_writes(self, timeout: float) -> bool:
        """Finish the prefix cache's queued disk writes (graceful shutdown); whether in time.
        Any thread."""
        return self.prompt_cache.close(timeout)

    def stats(self) -> EngineStats:
        features = self.vision.features if self.vision is not None else None
        return replace(
            super().stats(),
            vision_feature_cache=features.stats() if features is not None else None,
            vision_encoded_images=features.encoded if features is not None else 0,
            vision_encode_s=features.encode_s if features is not None else 0.0,
            paused=len(self._paused),
            background_pauses=self.background_pauses,
            memory_pauses=self.memory_pauses,
            prompt_cache_bytes=self.prompt_cache.nbytes,
            prompt_cache_hits=self.cache_hits,
            prompt_cache_tokens_saved=self.cache_tokens_saved,
            kv_cache_bytes=self._kv_bytes,
            prompt_cache_tiers=self.prompt_cache.stats(),
            # Read from the event loop while the MLX thread counts: a snapshot of the items, copied.
            speculation={name: replace(c) for name, c in list(self.speculator.counts.items())}
            if self.speculator else {},
        )

    # ---- the MLX thread -------------------------------------------------------------

    @property
    def _parked(self) -> deque[_Seq]:
        return self._paused

    def _step(self) -> bool:
        self.prompt_cache.collect()
        busy = super()._step()
        self._settle()
        return busy

    def _schedule(self) -> None:
        self._fit_reservations()
        interactive_waits = self._interactive_waits()
        if interactive_waits:
            self._pause_background()
        else:
            self._resume_background()
        self._admit_and_insert(background=not interactive_waits)

    def _batch_step(self) -> bool:
        """One step with its prefill chunk sized by time (``pacing``) and timed for the next."""
        decoding = any(not s.prefilling for s in self._running.values())
        prompts = min(sum(s.prefilling for s in self._running.values()), self.params.prefill_batch_size)
        chunk = self.pacer.chunk(decoding=decoding, prompts=prompts)
        if chunk != self._bg.prefill_step_size:
            self._bg.prefill_step_size = chunk
        self._prefilled = 0
        start = self._step_start = self._clock()
        self._propose()
        busy = super()._batch_step()
        self.pacer.observe(prefilled=self._prefilled, decoding=decoding, seconds=self._clock() - start)
        return busy

    def _propose(self) -> None:
        """Before a step: the decoding rows' proposals to the verify batch (``app.engine.speculative.rows``)."""
        if self.speculator is None or self._verify is None:
            return
        # A verify step costs more than a plain one (far more on a CPU): none in the step that
        # gives an interactive row its first token, which it would delay.
        if any(not s.background and not s.prefilling and s.first_token is None for s in self._running.values()):
            return
        rows = {}
        for uid, seq in self._running.items():
            if seq.drafts is not None and not seq.prefilling:
                seq.drafts.remaining = seq.req.max_tokens - seq.generated - 1
                rows[uid] = seq.drafts
        if rows:
            try:
                self.speculator.propose(self._verify, rows)
            except Exception:  # noqa: BLE001 - a drafter's failure must not fail the step: it decodes plainly
                log.exception("model %s: speculative proposals failed; this step decodes without them", self.name)
                self.speculator.drop_in_flight()
                self._verify.propose({})

    def _on_batch_next(self, prompt_responses: list[Any]) -> None:
        """After the batch step, before its tokens are handled: what the proposals came to."""
        if self.speculator is None or self._verify is None:
            return
        try:
            self.speculator.settle(self._verify, self._clock() - self._step_start, timed=not prompt_responses)
        except Exception:  # noqa: BLE001 - bookkeeping only: the tokens are right whatever happens here
            log.exception("model %s: speculative bookkeeping failed", self.name)
            self.speculator.drop_in_flight()
        for seq in self._running.values():
            if seq.drafts is not None and seq.drafts.prediction_size:
                seq.accepted_prediction_tokens = seq.drafts.accepted_prediction
                seq.rejected_prediction_tokens = seq.drafts.rejected_prediction

    def _settle(self) -> None:
        """After a step: the memory tier within what the reservations leave of the budget
        (prefixes cached mid-prefill, or loaded from disk, come on top of them), and the
        bytes MLX's caches hold, measured for /health and /metrics."""
        room = self.admission.budget_bytes - self.admission.reserved
        if self.prompt_cache.nbytes > room:
            self.prompt_cache.trim_to(n_bytes=max(0, room))
        paused = sum(nbytes(s.paused[0]) for s in self._paused if s.paused)
        self._kv_bytes = self._bg.prompt_cache_nbytes + paused + self.prompt_cache.nbytes

    def _drop_row(self, uid: int) -> None:
        self._bg.remove([uid])

    # ---- priority: background work yields to interactive work -------------------------

    def _interactive_waits(self) -> bool:
        """An interactive request waits for its first token: admitted and in prefill, or
        queued where the KV budget could take it (one waiting for memory waits for
        running work to end, which pausing would only delay)."""
        if any(not s.background and s.first_token is None for s in self._running.values()):
            return True
        with self._lock:
            return self.admission.interactive_fits()

    def _pause_background(self) -> None:
        """Background sequences in prefill, and those decoding beyond background_share."""
        keep = int(self.params.background_share * self.params.max_num_seqs)
        background = [s for s in self._running.values() if s.background]
        decoding = sorted((s for s in background if s.first_token is not None), key=lambda s: s.enqueued)
        for seq in [s for s in background if s.first_token is None] + decoding[keep:]:
            seq.paused = self._take_out(seq)
            self._stop_storing(seq)
            with self._lock:
                self.admission.suspend()
            self._paused.append(seq)
            self.background_pauses += 1

    def _resume_background(self) -> None:
        """Paused sequences back into the batch, oldest first, as slots allow."""
        while self._paused:
            with self._lock:
                if not self.admission.resume():
                    return
            seq = self._paused.popleft()
            assert seq.paused is not None
            cache, tokens, drawn = seq.paused
            seq.paused = None
            if drawn is not None:  # paused decoding: it feeds (and emits) the token it had drawn
                rest = [drawn[0]]
            else:  # paused in prefill: the rest of the prompt
                rest = seq.req.prompt_tokens[len(tokens):]
            self._start(seq, [rest], cache, tokens, seq.req.max_tokens - seq.generated, drawn,
                        self._inputs_from(seq, len(tokens)))

    def _take_out(self, seq: _Seq) -> tuple[Any, list[int], tuple[int, Any] | None]:
        """``seq``'s row out of the batch: the KV it holds, its tokens, and the token it drew
        and has not fed yet (with its distribution), which it will feed when it resumes."""
        assert seq.uid is not None
        drawn = self._bg.pending_of(seq.uid)
        cache, tokens = self._bg.remove([seq.uid], return_prompt_caches=True)[seq.uid]
        del self._running[seq.uid]
        seq.uid = None
        return cache, list(tokens), drawn

    # ---- memory: reservations grow as rows decode; the lowest-priority row yields ----------

    def _reservation(self, seq: _Seq) -> int:
        """What it holds now (its prompt and what it generated) plus the next allocation step;
        its prompt's padded span while it prefills."""
        return reservation(seq.width, seq.prompt_len + seq.generated, prefill=seq.prefill if seq.prefilling else 0)

    def _fit_reservations(self) -> None:
        """Before a step: every reserved row's reservation grown to what it holds now plus a
        step. When that does not fit beside the prefix cache, the cache is evicted first, then
        the lowest-priority row paused (``admission.victim``) until it fits."""
        rows = [*self._running.values(), *self._paused]
        if not rows:
            return
        with self._lock:
            for seq in rows:
                self.admission.resize(seq, self._reservation(seq))
            over = self.admission.over(self.prompt_cache.nbytes)
        if over > 0 and self.prompt_cache.nbytes:
            self._evict(over)
            over = self.admission.over(self.prompt_cache.nbytes)
        while over > 0:
            keys = {s: (int(s.background), s.width, s.enqueued) for s in [*self._running.values(), *self._paused]}
            with self._lock:
                victim = self.admission.victim(keys)
            if victim is None:
                return
            self._pause_for_memory(victim)
            over = self.admission.over(self.prompt_cache.nbytes)

    def _pause_for_memory(self, seq: _Seq) -> None:
        """Take ``seq`` out with its KV, into the prefix cache (evictable, and to the disk tier),
        its reservation given back; it waits at the head of the queue to resume from there."""
        running = seq.paused is None
        if running:
            cache, tokens, drawn = self._take_out(seq)
        else:  # paused for interactive work already: its KV is aside
            cache, tokens, drawn = seq.paused  # type: ignore[misc]
            self._paused.remove(seq)
        if tokens:
            self.prompt_cache.insert_cache(self._cache_key(seq), self._keyed(seq, tokens), cache,
                                           cache_type="assistant")
        # On resume it may prefill what the cache no longer has, beside other prompts.
        chunk = self.params.prefill_chunk_size
        seq.prefill = prefill_span(max(len(tokens), seq.prompt_len), segments=1, chunk=chunk)
        seq.width = max(seq.width, seq.prefill)
        self._stop_storing(seq)
        seq.uid, seq.paused, seq.requeued, seq.holds = None, None, (tokens, drawn), False
        self.memory_pauses += 1
        # It comes back when a step more than it holds fits: not at the first free token.
        need = min(seq.width, max(seq.prefill, len(tokens) + 2 * KV_STEP))
        with self._lock:
            self.admission.requeue(seq, need, seq.enqueued, int(seq.background), running=running)
        log.info("model %s: KV budget full; request %s paused after %d tokens (its KV to the prefix cache)",
                 self.name, seq.req.request_id, seq.generated)

    def _resume_requeued(self, seq: _Seq) -> None:
        """A row paused for memory back into the batch, from what the prefix cache kept of its KV."""
        target = self._lookup_tokens(seq, keyed=False)  # paused in prefill: its prompt; decoding: its KV, drawn token
        cache, rest = self._fetch(seq)
        drawn = seq.requeued[1] if seq.requeued is not None else None
        seq.requeued = None
        rest = target[len(target) - len(rest):]  # the real tokens (a VLM's key stands for its images)
        if cache is None:
            rest = target
            cache = self._new_cache()
        done = len(target) - len(rest)
        self._start(seq, [rest], cache, target[:done], seq.req.max_tokens - seq.generated, drawn,
                    self._inputs_from(seq, done))

    def _evict(self, nbytes: int, seq: _Seq | None = None) -> int:
        """Evict at least ``nbytes`` of the prefix cache's memory tier (to admit ``seq``: its own
        cached prefix is taken first, so making room for it never evicts what it is about to
        read); what the tier holds then."""
        if seq is not None and seq.prefetched is None and self._uses_cache(seq):
            cache, rest, _ = self.prompt_cache.fetch(self._cache_key(seq), self._lookup_tokens(seq))
            if cache is not None:
                seq.prefetched = (cache, rest)
        self.prompt_cache.trim_to(n_bytes=max(0, self.prompt_cache.nbytes - nbytes))
        return self.prompt_cache.nbytes

    def _uses_cache(self, seq: _Seq) -> bool:
        return self.params.prompt_cache != "off" or seq.req.share_prefix or seq.requeued is not None

    def _lookup_tokens(self, seq: _Seq, *, keyed: bool = True) -> list[int]:
        """What ``seq`` looks up in the prefix cache when it starts: its prompt, or, resuming
        from a pause for memory, the tokens its KV held and the token it had drawn; as the
        cache keys them (``keyed``), or as the model sees them."""
        tokens = list(seq.req.prompt_tokens)
        if seq.requeued is not None:
            held, drawn = seq.requeued
            if drawn is not None:
                tokens = [*held, drawn[0]]
        elif seq.req.score is not None:  # its tail, and the token before it, are its score pass's to feed
            tokens = tokens[:len(tokens) - seq.req.score.tail]
        return self._keyed(seq, tokens) if keyed else tokens

    def _keyed(self, seq: _Seq, tokens: list[int]) -> list[int]:
        """``seq``'s tokens (its prompt's first, then what it generated) as the prefix cache keys
        them: a VLM's prompt with each image's span its pixel digest (``VisionRows.key_tokens``)."""
        if self.vision is None:
            return list(tokens)
        if not seq.key:
            seq.key = self.vision.key_tokens(seq.req.prompt)
        n = min(len(tokens), len(seq.key))
        return [*seq.key[:n], *tokens[n:]]

    def _inputs_from(self, seq: _Seq, done: int) -> RowInputs | None:
        """A VLM row's inputs when it starts (again) with ``done`` tokens in its KV: those it
        was inserted with, cut further (a paused row put back), or built anew when its cache
        now holds less than it did (the vision tower runs for images past ``done``)."""
        if self.vision is None:
            return None
        if seq.inputs is not None and done >= seq.base:
            return self.vision.rebased(seq.inputs, done - seq.base)
        seq.inputs, seq.base = self.vision.inputs(seq.req.prompt, seq.req.cache_namespace, done), done
        return seq.inputs

    def _fetch(self, seq: _Seq) -> tuple[Any, list[int]]:
        """``seq``'s cached prefix: the one taken before its admission, else a lookup now."""
        if seq.prefetched is not None:
            (cache, rest), seq.prefetched = seq.prefetched, None
            return cache, rest
        cache, rest, _ = self.prompt_cache.fetch(self._cache_key(seq), self._lookup_tokens(seq))
        return cache, rest

    def _admit_and_insert(self, *, background: bool = True) -> None:
        # One at a time: each takes its prefix from the cache before the next may evict it.
        while True:
            admitted = self._admit(self.prompt_cache.nbytes, self._evict, background=background, limit=1)
            if not admitted:
                break
            seq = admitted[0]
            try:
                if seq.requeued is not None:
                    self._resume_requeued(seq)
                else:
                    self._insert(seq)
            except Exception as exc:  # noqa: BLE001 - one bad request fails alone
                log.exception("could not start request %s", seq.req.request_id)
                self._release(seq)
                err = exc if isinstance(exc, AppError) else EngineError(f"could not start generation: {exc}")
                self._finish_with_error(seq, err)
            if self.vision is not None and self.vision.encodes(seq.req.prompt, seq.base):
                break  # the vision tower ran for it: one request's images a loop turn, streams keep moving
        waiting = len(self.admission.waiting)
        if waiting and time.monotonic() - self._last_wait_log > 5:
            self._last_wait_log = time.monotonic()
            log.info(
                "%d request(s) waiting for KV memory: %d of %d MB reserved by %d running, "
                "prefix cache %d MB", waiting, self.admission.reserved // 2**20, self.admission.budget_bytes // 2**20,
                self.admission.running, self.prompt_cache.nbytes // 2**20,
            )

    def _insert(self, seq: _Seq) -> None:
        req, p = seq.req, self.params
        prompt = list(req.prompt_tokens)
        cache, cached = None, 0
        if p.prompt_cache != "off" or req.share_prefix:
            cache, rest = self._fetch(seq)
            cached = len(self._lookup_tokens(seq, keyed=False)) - len(rest)
        if cache is None:
            cache, cached = self._new_cache(), 0
        if cached:
            self.cache_hits += 1
            self.cache_tokens_saved += cached
            self._pin_again(seq, cached)
        # The prompt splits where a prefix is to be cached that the cache does not hold yet.
        seq.stores = {n: pin_s for n, pin_s in seq.points.items() if n > cached}
        cuts = [cached, *sorted(seq.stores), len(prompt)]
        segments = [prompt[a:b] for a, b in zip(cuts, cuts[1:])]
        seq.cached_tokens = cached
        inputs = self._inputs_from(seq, cached)
        if req.score is not None:
            self._start(seq, segments, cache, prompt[:cached], 0, inputs=inputs,
                        score=ScoreSpec(req.score.tail, req.score.next_tokens))
            self._fill(seq)
            return
        seq.sampler = build_sampler(req.sampling)
        seq.processors = build_logits_processors(req.sampling) + self._budget(seq, len(prompt))
        if req.constraint is not None:  # last, so it masks the penalised logits; kept across a pause
            seq.constraint = req.constraint.processor(len(prompt))
            seq.processors.append(seq.constraint)
        seq.detok = self.vision.detokenizer() if self.vision is not None else new_detokenizer(self.tokenizer)
        seq.stops = StopMatcher(req.stop)
        if self.speculator is not None:
            budget = next((p for p in seq.processors if isinstance(p, BudgetProcessor)), None)
            seq.drafts = self.speculator.open(req, budget, seq.constraint)
        self._start(seq, segments, cache, prompt[:cached], req.max_tokens, inputs=inputs)
        self._fill(seq)

    def _start(self, seq: _Seq, segments: list[list[int]], cache: Any, done: list[int], max_tokens: int,
               drawn: tuple[int, Any] | None = None, inputs: RowInputs | None = None,
               score: ScoreSpec | None = None) -> None:
        """Insert ``seq`` into the batch: its prompt ``segments`` after the ``done`` tokens in ``cache``;
        ``drawn``: the last of them is a token it drew before a pause (fed and emitted); ``inputs``:
        a VLM row's embeddings and extras from ``done`` on; ``score``: a score row's reading."""
        (uid,) = self._bg.insert_segments(
            [segments],
            max_tokens=[max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[done],
            samplers=[seq.sampler],
            logits_processors=[seq.processors],
            scores=[score] if score is not None else None,
            drawn=[Drawn(drawn[1])] if drawn is not None else None,
            inputs=[inputs] if inputs is not None else None,
        )
        seq.uid, seq.prefilling = uid, True
        self._running[uid] = seq

    def _new_cache(self) -> Any:
        """A fresh row's cache when it is not the model's own (quantized KV); None: the step makes it."""
        bits = self.loaded.kv_cache_bits
        if bits is None:
            return None
        if self.vision is not None:
            return self.vision.quantized_cache(bits, KV_GROUP_SIZE)
        return self.ops.quantized_cache(self.loaded.model, bits, KV_GROUP_SIZE, self.loaded.kv_plain_attention)

    def cache_key(self, namespace: str = "") -> str:
        """The prefix cache's partition for a namespace: prefixes are shared only within one
        (a cache_salt, an API key), so cached_tokens and time to first token never tell a
        client what another one sent; a VLM's also by what shaped its images' tokens."""
        model = self.loaded.name if self.vision is None else f"{self.loaded.name}/{self.vision.partition()}"
        return f"{model}\x00{namespace}"

    def _cache_key(self, seq: _Seq) -> str:
        return self.cache_key(seq.req.cache_namespace)

    def _cache_prefix(self, seq: _Seq, pin_s: float) -> None:
        """``seq``'s KV now (its prompt up to a store point) into the prefix cache, pinned for
        ``pin_s``; written at a breakpoint, or as a score row's shared input, it counts as
        ``cache_write_tokens``."""
        assert seq.uid is not None
        for _, (cache, tokens) in self._bg.extract_cache([seq.uid]).items():
            self.prompt_cache.insert_cache(self._cache_key(seq), self._keyed(seq, tokens), cache, cache_type="system",
                                           pin_s=pin_s)
            if pin_s > 0 or seq.req.score is not None:
                seq.cache_write_tokens = max(seq.cache_write_tokens, len(tokens) - seq.cached_tokens)

    def _pin_again(self, seq: _Seq, cached: int) -> None:
        """Breakpoints the cache held already (``cached`` tokens were read): each pinned for its
        TTL from now, as a cache hit refreshes a breakpoint's TTL."""
        marks = [(n, pin_s) for n, pin_s in seq.points.items() if pin_s > 0 and n <= cached]
        if not marks:
            return
        key, tokens = self._cache_key(seq), self._lookup_tokens(seq)
        for n, pin_s in marks:
            if not self.prompt_cache.pin(key, tokens[:n], pin_s):
                self.prompt_cache.pin_nearest(key, tokens, pin_s)

    # ---- shared prefixes: computed once by one row while the others wait for it ------------

    def _share_of(self, seq: _Seq) -> tuple[str, str] | None:
        """``seq``'s shared prefix (the one ``cache_prefix_len`` names, when it is to be cached):
        its cache key and the digest of its tokens as the cache keys them."""
        prefix = seq.req.cache_prefix_len
        if seq.shares is None and prefix and prefix in seq.points and seq.requeued is None:
            tokens = self._keyed(seq, list(seq.req.prompt_tokens[:prefix]))
            seq.shares = (self._cache_key(seq), hashlib.sha256(array("q", tokens).tobytes()).hexdigest())
        return seq.shares

    def _fill(self, seq: _Seq) -> None:
        """``seq`` started: it computes its shared prefix for the requests that wait for it."""
        prefix = seq.req.cache_prefix_len
        share = self._share_of(seq)
        if share is not None and prefix in seq.stores:
            self._filling.setdefault(share, seq)

    def _unfill(self, seq: _Seq) -> None:
        """``seq`` computes its shared prefix no more (cached, paused or ended): those waiting go."""
        if seq.shares is not None and self._filling.get(seq.shares) is seq:
            del self._filling[seq.shares]

    def _stop_storing(self, seq: _Seq) -> None:
        """``seq`` left the batch before its prefill reached its store points."""
        seq.stores = {}
        self._unfill(seq)

    def _held(self, seq: _Seq) -> bool:
        """A waiting ``seq`` whose shared prefix a running row is computing: it waits for that
        and reads it from the cache (it would only compute it again beside it)."""
        if not self._filling or seq.requeued is not None:
            return False
        share = self._share_of(seq)
        return share is not None and share in self._filling

    def _on_prompt_progress(self, responses: list[Any]) -> None:
        # Prompt tokens this step prefilled: each row's progress since its last step.
        for r in responses:
            if r.end_of_prompt:
                self._progress.pop(r.uid, None)
            else:
                self._prefilled += r.progress[0] - self._progress.get(r.uid, 0)
                self._progress[r.uid] = r.progress[0]
        if any(uid not in self._running for uid in self._progress):  # rows removed in prefill
            self._progress = {uid: n for uid, n in self._progress.items() if uid in self._running}
        for r in responses:
            seq = self._running.get(r.uid)
            if seq and r.end_of_prompt:
                seq.prefilling = False
            if seq and seq.stores and r.end_of_segment:
                pin_s = seq.stores.pop(r.held, None)
                if pin_s is not None:
                    self._cache_prefix(seq, pin_s)
                if r.held == seq.req.cache_prefix_len:
                    self._unfill(seq)

    def _distribution(self, seq: _Seq, r: Any) -> mx.array:
        return r.logprobs

    def _stop_early(self, seq: _Seq) -> None:
        caches = self._bg.remove([seq.uid], return_prompt_caches=True)
        self._store_conversation(seq, *caches.get(seq.uid, (None, None)))

    def _on_finished(self, seq: _Seq, r: Any) -> None:
        self._store_conversation(seq, r.prompt_cache, r.all_tokens)

    def _cancel_row(self, seq: _Seq) -> None:
        """A cancelled row leaves with its KV, which goes to the prefix cache when the row
        computed any (prefill chunks, or tokens): Claude Code gives up on a request after
        300 s without an answer and retries, and the retry resumes where this one stopped
        instead of prefilling its long prompt from zero again."""
        caches = self._bg.remove([seq.uid], return_prompt_caches=True)
        cache, tokens = caches.get(seq.uid, (None, None))
        if tokens is not None and len(tokens) > seq.cached_tokens:
            self._store_conversation(seq, cache, tokens)

    def _store_conversation(self, seq: _Seq, cache: Any, tokens: Any) -> None:
        """A conversation's KV at its end into the prefix cache (``prompt_cache: prefix``), unless
        its request caches at its breakpoints only; pinned when a breakpoint marks its whole prompt."""
        if self.params.prompt_cache != "prefix" or cache is None or tokens is None:
            return
        pin_s = float(max((m.ttl_s for m in seq.req.cache_breakpoints if m.tokens >= seq.prompt_len), default=0))
        if not seq.req.cache_implicit and not pin_s:
            return
        if len(tokens) >= self.params.cache_min_tokens:
            self.prompt_cache.insert_cache(self._cache_key(seq), self._keyed(seq, tokens), cache,
                                           cache_type="assistant", pin_s=pin_s)
            if pin_s:
                seq.cache_write_tokens = max(seq.cache_write_tokens, seq.prompt_len - seq.cached_tokens)

    def _release(self, seq: _Seq) -> None:
        self._unfill(seq)
        super()._release(seq)
        seq.paused = seq.requeued = None  # a paused sequence's KV goes with it
        if seq.drafts is not None and self.speculator is not None:
            self.speculator.close(seq.drafts)
