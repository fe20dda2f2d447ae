"""The text engine: mlx-lm's BatchGenerator driven from the MLX-owner thread.

The request lifecycle is ``BatchingEngine``'s (``app.engine.batch.batching``): the
inbox, admission against the KV budget (``admission``: what MLX will really
allocate), cancellations, queue expiry, stop strings, one ``GenerationRecord``
to the listeners per generation, failing one request or one batch step alone.
What is this engine's own:

    _insert          an admitted request gets the KV of its longest cached prefix
                     from the prefix cache (``prefix_cache``: memory, then disk),
                     its sampler, logits processors and constraint, and is inserted
                     into the BatchGenerator, its prompt in two segments when its
                     cacheable prefix ends mid-prompt (that prefix is cached when
                     prefill reaches it)
    each token       logprobs straight from mlx-lm's responses; a finished
                     conversation's KV goes to the prefix cache (``prompt_cache: prefix``)
    before each step every row's reservation grown to what it holds plus a KV step
                     (``_fit_reservations``), and the prefill chunk sized by time
                     while rows decode (``pacing``: the step's time budget, at the
                     prefill rate measured on this model)
    a cancellation   the row's KV goes to the prefix cache too, a prefill cut short
                     included: the retry of a request its client gave up on resumes there
    after each step  the memory tier trimmed to what the reservations leave, and
                     the bytes MLX's caches hold measured (``_settle``)
    score rows       prefill-only rows (``GenerationRequest.score``) go to ``scoring`` when
                     admitted, and are scored after that turn's batch step (``_score_admitted``)
    speculation      each row's drafters opened in ``_insert``, asked before a step
                     (``_propose``) and told after it (``_on_batch_next``); the verify
                     step is the BatchGenerator's own generation batch
                     (``app.engine.speculative``: ``verify``, ``rows``)

Memory: when the rows' growth does not fit the KV budget, the prefix cache is
evicted first, then the lowest-priority row (background first, then the widest,
then the newest) leaves the batch: its KV goes to the prefix cache (and the disk
tier), its reservation is given back, and it waits at the head of the queue, to
resume from that prefix when room returns (``_pause_for_memory``). Its sampler,
processors and detokenizer stay with it, so at temperature 0 its output is what
it would have been.

Priority: while an interactive request waits for its first token (queued, or
in prefill), background requests (titles, tags, follow-ups) are not admitted,
those in prefill are paused, and those decoding keep at most
``background_share`` of the batch; the rest are paused too. A paused sequence
leaves the batch with its KV (``remove(..., return_prompt_caches=True)``),
keeps its reservation, and is inserted again with that KV once no interactive
request waits.

Every BatchGenerator, prompt-cache and KV-cache call goes through ``ops``
(``app.engine.distributed.mirror.BatchOps``): made here, or, distributed, made here and
replayed on every other rank.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx

from app.engine.batch.admission import KV_STEP, prefill_span, reservation, sequence_width
from app.engine.batch.batching import BatchingEngine, Seq
from app.engine.batch.pacing import PrefillPacer
from app.engine.batch.reasoning import BudgetProcessor
from app.engine.batch.sampling import build_logits_processors, build_sampler
from app.engine.batch.scoring import SCORED, Scorer
from app.engine.batch.stops import StopMatcher
from app.engine.distributed.mirror import LOCAL_OPS, BatchOps
from app.engine.kv.disk_cache import disk_root, open_disk_tier
from app.engine.kv.kv_snapshot import probe_layout
from app.engine.kv.prefix_cache import DISK_WRITES_WAIT_S, UNBOUNDED, PrefixCache
from app.engine.mlx_internals import BatchGenerator, batch_kv_nbytes, make_prompt_cache, new_detokenizer
from app.engine.models.loader import KV_GROUP_SIZE, LoadedModel
from app.engine.params import EngineParams
from app.engine.prompt import MultimodalPrompt, TextPrompts
from app.engine.speculative import DraftSource
from app.engine.speculative.rows import RowDrafts, Speculator
from app.engine.speculative.verify import VerifyBatch
from app.engine.types import EngineStats, GenerationRequest
from app.engine.worker import MLXWorker
from app.errors import EngineError, VisionNotSupportedError

log = logging.getLogger("tandem.engine")



@dataclass(eq=False)
class _Seq(Seq):
    # Prompt segments left whose end is a prefix worth caching (``_insert``).
    cache_segments: int = 0
    sampler: Any = None
    processors: list[Any] = field(default_factory=list)
    # While paused for interactive work: the KV it had (cache, the tokens in it).
    paused: tuple[Any, list[int]] | None = None
    # Columns its prompt may span while prefilled (``admission.prefill_span``), and whether it is prefilling.
    prefill: int = 0
    prefilling: bool = True
    # Paused for memory: its KV went to the prefix cache under these tokens, and it waits to resume.
    requeued: list[int] | None = None
    # Its drafters (speculative decoding), when it has any.
    drafts: RowDrafts | None = None

    @property
    def suspended(self) -> bool:
        return self.paused is not None


class TextEngine(BatchingEngine[_Seq, LoadedModel]):
    """Continuous batching for one loaded chat model."""

    def __init__(self, worker: MLXWorker, loaded: LoadedModel, params: EngineParams, *,
                 ops: BatchOps = LOCAL_OPS, clock: Callable[[], float] = time.perf_counter,
                 draft: DraftSource | None = None) -> None:
        super().__init__(worker, loaded, params)
        # Every BatchGenerator, prompt-cache and KV-cache call goes through ops: made here, or
        # (distributed, app.engine.distributed.mirror) made here and replayed by every other rank.
        self.ops = ops
        self.prompts = TextPrompts(self.tokenizer)
        self.bytes_per_token = loaded.kv.bytes_per_token
        disk = None
        # Distributed, every rank replays rank 0's cache calls by name: a disk tier would make caches of its own.
        if params.prompt_cache_disk_bytes and not ops.replicated:
            # The tensors this model's KV is made of: what its disk tier reads and writes, nothing else.
            layout = probe_layout(loaded.model, loaded.kv_cache_bits, KV_GROUP_SIZE)
            if layout is None:
                log.info("model %s: its KV caches are not plain KV layers: no prefix cache on disk", loaded.name)
            else:
                disk = open_disk_tier(disk_root(params.prompt_cache_disk_dir), loaded.name, loaded.kv_identity,
                                      params.prompt_cache_disk_bytes, params.prompt_cache_disk_queue_mb * 2**20,
                                      layout)
        self.prompt_cache = PrefixCache(ops.prompt_cache(UNBOUNDED, UNBOUNDED), params.prompt_cache_entries,
                                        params.prompt_cache_bytes, disk)
        self._kv_bytes = 0
        self.cache_hits = 0
        self.cache_tokens_saved = 0
        self.background_pauses = 0
        # Rows paused because the KV budget could not take their growth.
        self.memory_pauses = 0
        self._paused: deque[_Seq] = deque()
        # Prefill chunks sized by time while rows decode (``pacing``), timed on ``clock``.
        self.pacer = PrefillPacer(params.prefill_chunk_size, params.prefill_step_ms / 1000)
        self._clock = clock
        self._progress: dict[int, int] = {}
        self._prefilled = 0
        self._last_wait_log = 0.0
        # Speculative decoding (``app.engine.speculative.rows``); None where this model cannot roll its KV back.
        self.speculator = self._speculator(draft)
        self._verify: VerifyBatch | None = None
        self._step_start = 0.0
        self._bg = self._new_batch()
        # Prefill-only rows (``GenerationRequest.score``), scored between batch steps (``scoring``).
        self.scorer: Scorer[_Seq] = Scorer(
            loaded.model, self.prompt_cache, self._empty_cache, cache_key=self.cache_key,
            chunk=params.prefill_chunk_size, min_tokens=params.cache_min_tokens,
            cache_on=params.prompt_cache != "off", vocab_size=self.vocab_size, replicated=ops.replicated)
        worker.add_stepper(self._step, self._on_worker_death)
        log.info(
            "model %s: KV %d bytes/token, budget %d tokens, prefix cache %d MB, on disk %s; EngineParams %s",
            loaded.name, self.bytes_per_token, self.admission.budget_tokens, params.prompt_cache_bytes // 2**20,
            f"{params.prompt_cache_disk_mb} MB in {disk.dir}" if disk else "off", params.to_log_string(),
        )

    def _new_batch(self) -> BatchGenerator:
        p = self.params
        bg = self.ops.new_batch(
            self.loaded.model, self.tokenizer, max_tokens=512, completion_batch_size=p.max_num_seqs,
            prefill_batch_size=min(p.max_num_seqs, p.prefill_batch_size), prefill_step_size=p.prefill_chunk_size,
        )
        if self.speculator is not None:
            self._verify = self.ops.verify_batch(bg)
        return bg

    def _speculator(self, draft: DraftSource | None) -> Speculator | None:
        spec = self.params.speculative
        if spec.tokens <= 0:
            return None
        kinds = {type(c).__name__ for c in make_prompt_cache(self.loaded.model)}
        if kinds != {"KVCache"}:
            log.info("model %s: no speculative decoding: its KV caches (%s) cannot be rolled back",
                     self.loaded.name, ", ".join(sorted(kinds)))
            return None
        return Speculator(self.loaded.name, spec, draft)

    # ---- called from the event loop -------------------------------------------------

    async def _open(self, req: GenerationRequest) -> _Seq:
        if isinstance(req.prompt, MultimodalPrompt):
            raise VisionNotSupportedError(f"model {self.loaded.name} does not accept images")
        p, n, prefix = self.params, len(req.prompt_tokens), req.cache_prefix_len
        if req.score is not None:  # a prefill-only row holds its prompt's KV, no more (``scoring``)
            return _Seq(req, self._streams.open(), n, n, prefill=n)
        # Its prompt is prefilled in two segments when its cacheable prefix may end mid-prompt (``_insert``).
        cached = p.prompt_cache != "off" or req.share_prefix
        segments = 1 + (cached and bool(prefix) and p.cache_min_tokens <= (prefix or 0) < n)
        chunk = p.prefill_chunk_size
        return _Seq(req, self._streams.open(), sequence_width(n, req.max_tokens, segments=segments, chunk=chunk), n,
                    prefill=prefill_span(n, segments=segments, chunk=chunk))

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

    def finish_writes(self, timeout: float) -> bool:
        """Finish the prefix cache's queued disk writes (graceful shutdown); whether in time.
        Any thread."""
        return self.prompt_cache.close(timeout)

    def stats(self) -> EngineStats:
        return replace(
            super().stats(),
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
        self._score_admitted()
        self._settle()
        return busy

    def _score_admitted(self) -> None:
        """The score rows admitted this turn, scored after its batch step (``scoring``); each
        ends like a generation, its reservation given back."""
        for seq, delta in self.scorer.run():
            self._release(seq)
            if delta.error is not None:
                self._finish_with_error(seq, delta.error)
            else:
                self._end(seq, SCORED)
                seq.channel.put(delta)

    def _empty_cache(self) -> list[Any]:
        """An empty per-layer KV cache for this model, quantized when its KV is."""
        if self.loaded.kv_cache_bits is not None:
            return self.ops.quantized_cache(self.loaded.model, self.loaded.kv_cache_bits, KV_GROUP_SIZE)
        return make_prompt_cache(self.loaded.model)

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
        bpt = self.bytes_per_token
        room = (self.admission.budget_tokens - self.admission.reserved) * bpt
        if self.prompt_cache.nbytes > room:
            self.prompt_cache.trim_to(n_bytes=max(0, room))
        paused = sum(c.nbytes for s in self._paused if s.paused for c in s.paused[0])
        self._kv_bytes = batch_kv_nbytes(self._bg) + paused + self.prompt_cache.nbytes

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
            assert seq.uid is not None
            cache, tokens = self._bg.remove([seq.uid], return_prompt_caches=True)[seq.uid]
            del self._running[seq.uid]
            seq.uid, seq.paused, seq.cache_segments = None, (cache, list(tokens)), 0
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
            cache, tokens = seq.paused
            seq.paused = None
            prompt = seq.req.prompt_tokens
            if len(tokens) < len(prompt):  # paused in prefill: the rest of the prompt
                rest = prompt[len(tokens):]
            else:  # paused decoding: feed the last token again for the next one's logits
                self.ops.trim_cache(cache, 1)
                rest, tokens = tokens[-1:], tokens[:-1]
            self._start(seq, [rest], cache, tokens, seq.req.max_tokens - seq.generated)

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
            over = self.admission.over(self._cache_tokens())
        if over > 0 and self.prompt_cache.nbytes:
            self._evict(over)
            over = self.admission.over(self._cache_tokens())
        while over > 0:
            keys = {s: (int(s.background), s.width, s.enqueued) for s in [*self._running.values(), *self._paused]}
            with self._lock:
                victim = self.admission.victim(keys)
            if victim is None:
                return
            self._pause_for_memory(victim)
            over = self.admission.over(self._cache_tokens())

    def _pause_for_memory(self, seq: _Seq) -> None:
        """Take ``seq`` out with its KV, into the prefix cache (evictable, and to the disk tier),
        its reservation given back; it waits at the head of the queue to resume from there."""
        running = seq.paused is None
        if running:
            assert seq.uid is not None
            cache, tokens = self._bg.remove([seq.uid], return_prompt_caches=True)[seq.uid]
            del self._running[seq.uid]
        else:  # paused for interactive work already: its KV is aside
            cache, tokens = seq.paused  # type: ignore[misc]
            self._paused.remove(seq)
        tokens = list(tokens)
        if tokens:
            self.prompt_cache.insert_cache(self._cache_key(seq), tokens, cache, cache_type="assistant")
        # On resume it may prefill what the cache no longer has, beside other prompts.
        chunk = self.params.prefill_chunk_size
        seq.prefill = prefill_span(max(len(tokens), seq.prompt_len), segments=1, chunk=chunk)
        seq.width = max(seq.width, seq.prefill)
        seq.uid, seq.paused, seq.cache_segments, seq.requeued, seq.holds = None, None, 0, tokens, False
        self.memory_pauses += 1
        # It comes back when a step more than it holds fits: not at the first free token.
        need = min(seq.width, max(seq.prefill, len(tokens) + 2 * KV_STEP))
        with self._lock:
            self.admission.requeue(seq, need, seq.enqueued, int(seq.background), running=running)
        log.info("model %s: KV budget full; request %s paused after %d tokens (its KV to the prefix cache)",
                 self.name, seq.req.request_id, seq.generated)

    def _resume_requeued(self, seq: _Seq) -> None:
        """A row paused for memory back into the batch, from what the prefix cache kept of its KV."""
        held, seq.requeued = seq.requeued or [], None
        prompt = list(seq.req.prompt_tokens)
        target = held if len(held) >= len(prompt) else prompt  # paused in prefill: the whole prompt
        cache, rest, _ = self.prompt_cache.fetch(self._cache_key(seq), target)
        if cache is None:
            rest = target
            if self.loaded.kv_cache_bits is not None:
                cache = self.ops.quantized_cache(self.loaded.model, self.loaded.kv_cache_bits, KV_GROUP_SIZE)
        elif not rest:  # all of it: feed the last token again for the next one's logits
            self.ops.trim_cache(cache, 1)
            rest = target[-1:]
        self._start(seq, [rest], cache, target[:len(target) - len(rest)], seq.req.max_tokens - seq.generated)

    def _cache_tokens(self) -> int:
        """The prefix cache's memory tier in tokens, rounded up: the figure must never be below what is held."""
        return -(-self.prompt_cache.nbytes // self.bytes_per_token)

    def _evict(self, tokens: int) -> int:
        """Evict at least ``tokens`` of the prefix cache's memory tier; what it holds then."""
        self.prompt_cache.trim_to(n_bytes=max(0, self.prompt_cache.nbytes - tokens * self.bytes_per_token))
        return self._cache_tokens()

    def _admit_and_insert(self, *, background: bool = True) -> None:
        # One at a time: each takes its prefix from the cache before the next may evict it.
        while True:
            admitted = self._admit(self._cache_tokens(), self._evict, background=background, limit=1)
            if not admitted:
                break
            seq = admitted[0]
            try:
                if seq.req.score is not None:  # a prefill-only row: scored after this turn's step
                    self.scorer.add(seq)
                elif seq.requeued is not None:
                    self._resume_requeued(seq)
                else:
                    self._insert(seq)
            except Exception as exc:  # noqa: BLE001 - one bad request fails alone
                log.exception("could not start request %s", seq.req.request_id)
                self._release(seq)
                self._finish_with_error(seq, EngineError(f"could not start generation: {exc}"))
        waiting = len(self.admission.waiting)
        if waiting and time.monotonic() - self._last_wait_log > 5:
            self._last_wait_log = time.monotonic()
            log.info(
                "%d request(s) waiting for KV memory: %d of %d tokens reserved by %d running, "
                "prefix cache %d MB", waiting, self.admission.reserved, self.admission.budget_tokens,
                self.admission.running, self.prompt_cache.nbytes // 2**20,
            )

    def _insert(self, seq: _Seq) -> None:
        req, p = seq.req, self.params
        prompt = list(req.prompt_tokens)
        cache, rest = (None, prompt)
        use_cache = p.prompt_cache != "off" or req.share_prefix
        if use_cache:
            cache, rest, _ = self.prompt_cache.fetch(self._cache_key(seq), prompt)
            if cache is not None and not rest:  # exact hit: the last token must still run
                self.ops.trim_cache(cache, 1)
                rest = prompt[-1:]
        if cache is None and self.loaded.kv_cache_bits is not None:
            cache = self.ops.quantized_cache(self.loaded.model, self.loaded.kv_cache_bits, KV_GROUP_SIZE)
        cached = len(prompt) - len(rest)
        if cached:
            self.cache_hits += 1
            self.cache_tokens_saved += cached
        segments = [rest]
        prefix = req.cache_prefix_len
        worth = prefix is not None and (prefix >= p.cache_min_tokens or req.share_prefix)
        if use_cache and prefix and worth and cached < prefix < len(prompt):
            segments = [prompt[cached:prefix], prompt[prefix:]]
            seq.cache_segments = 1
        seq.cached_tokens = cached
        seq.sampler = build_sampler(req.sampling)
        seq.processors = build_logits_processors(req.sampling) + self._budget(seq, len(prompt))
        if req.constraint is not None:  # last, so it masks the penalised logits; kept across a pause
            seq.constraint = req.constraint.processor(len(prompt))
            seq.processors.append(seq.constraint)
        seq.detok = new_detokenizer(self.tokenizer)
        seq.stops = StopMatcher(req.stop)
        if self.speculator is not None:
            budget = next((p for p in seq.processors if isinstance(p, BudgetProcessor)), None)
            seq.drafts = self.speculator.open(req, budget, seq.constraint)
        self._start(seq, segments, cache, prompt[:cached], req.max_tokens)

    def _start(self, seq: _Seq, segments: list[list[int]], cache: Any, done: list[int], max_tokens: int) -> None:
        """Insert ``seq`` into the batch: its prompt ``segments`` after the ``done`` tokens in ``cache``."""
        (uid,) = self._bg.insert_segments(
            [segments],
            max_tokens=[max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[done],
            samplers=[seq.sampler],
            logits_processors=[seq.processors],
        )
        seq.uid, seq.prefilling = uid, True
        self._running[uid] = seq

    def cache_key(self, namespace: str = "") -> str:
        """The prefix cache's partition for a namespace: prefixes are shared only within one
        (a cache_salt, an API key), so cached_tokens and time to first token never tell a
        client what another one sent."""
        return f"{self.loaded.name}\x00{namespace}"

    def _cache_key(self, seq: _Seq) -> str:
        return self.cache_key(seq.req.cache_namespace)

    def _cache_prefix(self, seq: _Seq) -> None:
        assert seq.uid is not None
        for _, (cache, tokens) in self._bg.extract_cache([seq.uid]).items():
            self.prompt_cache.insert_cache(self._cache_key(seq), list(tokens), cache, cache_type="system")

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
            if seq and seq.cache_segments and r.end_of_segment and not r.end_of_prompt:
                seq.cache_segments -= 1
                self._cache_prefix(seq)

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
        if self.params.prompt_cache != "prefix" or cache is None or tokens is None:
            return
        if len(tokens) >= self.params.cache_min_tokens:
            self.prompt_cache.insert_cache(self._cache_key(seq), list(tokens), cache, cache_type="assistant")

    def _release(self, seq: _Seq) -> None:
        super()._release(seq)
        seq.paused = seq.requeued = None  # a paused sequence's KV goes with it
        if seq.drafts is not None and self.speculator is not None:
            self.speculator.close(seq.drafts)
