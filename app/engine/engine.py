"""The text engine: mlx-lm's BatchGenerator driven from the MLX-owner thread.

Async handlers call ``stream(request)``; the request is admitted against the
KV budget (``admission``: what MLX will really allocate for it), given the KV of
its longest cached prefix from the prefix cache (``prefix_cache``: memory, then
disk), inserted into the BatchGenerator, and its tokens come back
detokenized through a bounded ``TokenChannel``. A client that goes away
cancels its sequence and frees its KV. An exception in one sequence fails
that request only; a failure of the whole batch step fails the requests in
it and starts a fresh batch, and the thread goes on. Every generation that
ends, however it ends, is reported once to the listeners as a
``GenerationRecord`` (metrics, the log).

Priority: while an interactive request waits for its first token (queued, or
in prefill), background requests (titles, tags, follow-ups) are not admitted,
those in prefill are paused, and those decoding keep at most
``background_share`` of the batch; the rest are paused too. A paused sequence
leaves the batch with its KV (``remove(..., return_prompt_caches=True)``),
keeps its reservation, and is inserted again with that KV once no interactive
request waits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from app.engine.admission import Admission, Waiting, busy_error, sequence_width
from app.engine.channel import OpenStreams, TokenChannel
from app.engine.disk_cache import disk_root, open_disk_tier
from app.engine.loader import KV_GROUP_SIZE, LoadedModel
from app.engine.mirror import LOCAL_OPS, BatchOps
from app.engine.mlx_internals import BatchGenerator, batch_kv_nbytes, new_detokenizer
from app.engine.params import EngineParams
from app.engine.prefix_cache import UNBOUNDED, PrefixCache
from app.engine.sampling import build_logits_processors, build_sampler, reset_random_state
from app.engine.stops import StopMatcher
from app.engine.types import EngineStats, GenerationRecord, GenerationRequest, TokenDelta, TokenLogprob
from app.engine.worker import MLXWorker
from app.errors import AppError, EngineDeadError, EngineError, VisionNotSupportedError

log = logging.getLogger("tandem.engine")

Listener = Callable[[GenerationRecord], None]
# An unload waits this long for the prefix cache's queued disk writes.
DISK_WRITES_WAIT_S = 30.0


@dataclass(eq=False)
class _Seq:
    req: GenerationRequest
    channel: TokenChannel
    reserved: int
    uid: int | None = None
    detok: Any = None
    stops: StopMatcher | None = None
    cached_tokens: int = 0
    generated: int = 0
    cache_segments: int = 0
    done: bool = False
    enqueued: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    gaps: list[float] = field(default_factory=list)
    sampler: Any = None
    processors: list[Any] = field(default_factory=list)
    # While paused: the KV it had (cache, the tokens in it).
    paused: tuple[Any, list[int]] | None = None

    @property
    def background(self) -> bool:
        return self.req.priority == "background"


class TextEngine:
    """Continuous batching for one loaded chat model."""

    def __init__(self, worker: MLXWorker, loaded: LoadedModel, params: EngineParams, *,
                 ops: BatchOps = LOCAL_OPS) -> None:
        self.worker = worker
        # Every BatchGenerator, prompt-cache and KV-cache call goes through ops: made here, or
        # (distributed, app.engine.mirror) made here and replayed by every other rank.
        self.ops = ops
        self.loaded = loaded
        self.params = params
        self.tokenizer = loaded.tokenizer
        self.bytes_per_token = loaded.kv.bytes_per_token
        self.admission: Admission[_Seq] = Admission(
            loaded.kv.budget_tokens(params.kv_mem_mb),
            params.max_num_seqs,
            params.max_queue,
            params.queue_timeout_s,
            starvation_s=params.starvation_s,
        )
        disk = None
        # Distributed, every rank replays rank 0's cache calls by name: a disk tier would make caches of its own.
        if params.prompt_cache_disk_bytes and not ops.replicated:
            disk = open_disk_tier(disk_root(params.prompt_cache_disk_dir), loaded.name, loaded.kv_identity,
                                  params.prompt_cache_disk_bytes, params.prompt_cache_disk_queue_mb * 2**20)
        self.prompt_cache = PrefixCache(ops.prompt_cache(UNBOUNDED, UNBOUNDED), params.prompt_cache_entries,
                                        params.prompt_cache_bytes, disk)
        self._kv_bytes = 0
        self.cache_hits = 0
        self.cache_tokens_saved = 0
        self.background_pauses = 0
        self._listeners: list[Listener] = []
        self._streams = OpenStreams(params.channel_max_pending)
        self._lock = threading.Lock()
        self._inbox: deque[_Seq] = deque()
        self._cancelled: deque[_Seq] = deque()
        self._running: dict[int, _Seq] = {}
        self._paused: deque[_Seq] = deque()
        self._accepting = True
        self._last_wait_log = 0.0
        self._bg = self._new_batch()
        worker.add_stepper(self._step, self._on_worker_death)
        log.info(
            "model %s: KV %d bytes/token, budget %d tokens, prefix cache %d MB, on disk %s; EngineParams %s",
            loaded.name, self.bytes_per_token, self.admission.budget_tokens, params.prompt_cache_bytes // 2**20,
            f"{params.prompt_cache_disk_mb} MB in {disk.dir}" if disk else "off", params.to_log_string(),
        )

    def _new_batch(self) -> BatchGenerator:
        p = self.params
        return self.ops.new_batch(
            self.loaded.model, self.tokenizer, max_tokens=512, completion_batch_size=p.max_num_seqs,
            prefill_batch_size=min(p.max_num_seqs, p.prefill_batch_size), prefill_step_size=p.prefill_chunk_size,
        )

    # ---- called from the event loop -------------------------------------------------

    @property
    def name(self) -> str:
        return self.loaded.name

    @property
    def max_model_len(self) -> int:
        return self.loaded.max_model_len

    @property
    def vocab_size(self) -> int | None:
        config = self.loaded.config
        size = config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")
        return int(size) if size else None

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener`` (on the MLX thread; it must be quick) for every generation that ends."""
        self._listeners.append(listener)

    async def stream(self, req: GenerationRequest) -> AsyncGenerator[TokenDelta, None]:
        """Deltas for one request, ending with the one that carries finish_reason."""
        seq = _Seq(req, self._streams.open(), self._width(req))
        self._submit(seq)
        try:
            while True:
                for delta in await seq.channel.get():
                    if delta.error is not None:
                        raise delta.error
                    yield delta
                    if delta.finish_reason is not None:
                        return
        finally:
            if not seq.done:
                self._cancelled.append(seq)
                self.worker.wake()

    def _submit(self, seq: _Seq) -> None:
        if seq.req.images:
            raise VisionNotSupportedError(f"model {self.loaded.name} does not accept images")
        if not self.worker.alive:
            raise EngineDeadError("the engine is not running; see /health")
        if not self._accepting:
            raise EngineDeadError("the server is shutting down", retry_after=10)
        with self._lock:
            self.admission.check(seq.reserved, arriving=len(self._inbox))
            self._inbox.append(seq)
        self.worker.wake()

    def _width(self, req: GenerationRequest) -> int:
        """The sequence's width in a batch cache (``admission.sequence_width``); its prompt is
        prefilled in two segments when its cacheable prefix may end mid-prompt (``_insert``)."""
        p, n, prefix = self.params, len(req.prompt_tokens), req.cache_prefix_len
        cached = p.prompt_cache != "off" or req.share_prefix
        split = cached and bool(prefix) and p.cache_min_tokens <= (prefix or 0) < n
        return sequence_width(n, req.max_tokens, segments=1 + split, chunk=p.prefill_chunk_size)

    def stop_accepting(self) -> None:
        self._accepting = False

    def close(self) -> None:
        """Leave the MLX loop and drop the model's arrays (an unload). MLX thread only,
        with nothing queued or running. The prefix cache's queued disk writes finish
        first: the prefixes stay on disk for the next load."""
        self._accepting = False
        self.worker.remove_stepper(self._step)
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

    @property
    def in_flight(self) -> int:
        return len(self._inbox) + len(self.admission.waiting) + len(self._running) + len(self._paused)

    def stats(self) -> EngineStats:
        return EngineStats(
            alive=self.worker.alive,
            active=len(self._running),
            paused=len(self._paused),
            background_pauses=self.background_pauses,
            waiting=len(self.admission.waiting) + len(self._inbox),
            kv_budget_tokens=self.admission.budget_tokens,
            kv_reserved_tokens=self.admission.reserved,
            prompt_cache_bytes=self.prompt_cache.nbytes,
            prompt_cache_hits=self.cache_hits,
            prompt_cache_tokens_saved=self.cache_tokens_saved,
            kv_cache_bytes=self._kv_bytes,
            kv_max_sequence_tokens=self.admission.max_sequence_tokens,
            prompt_cache_tiers=self.prompt_cache.stats(),
        )

    # ---- the MLX thread -------------------------------------------------------------

    def _step(self) -> bool:
        self.prompt_cache.collect()
        busy = self._run_step()
        self._settle()
        return busy

    def _run_step(self) -> bool:
        self._take_inbox()
        self._take_cancellations()
        self._expire_waiting()
        interactive_waits = self._interactive_waits()
        if interactive_waits:
            self._pause_background()
        else:
            self._resume_background()
        self._admit(background=not interactive_waits)
        if not self._running:
            return bool(self.admission.waiting or self._paused)
        try:
            prompt_responses, gen_responses = self._bg.next()
        except Exception as exc:  # noqa: BLE001 - fail this batch, keep the thread
            log.exception("batch step failed; failing %d requests", len(self._running))
            self._fail_batch(exc)
            return True
        for r in prompt_responses:
            seq = self._running.get(r.uid)
            if seq and seq.cache_segments and r.end_of_segment and not r.end_of_prompt:
                seq.cache_segments -= 1
                self._cache_prefix(seq)
        for r in gen_responses:
            seq = self._running.get(r.uid)
            if seq is not None:
                self._on_token(seq, r)
        return True

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

    def _take_inbox(self) -> None:
        while self._inbox:
            with self._lock:
                seq = self._inbox.popleft()
                self.admission.waiting.append(Waiting(seq, seq.reserved, seq.enqueued, rank=int(seq.background)))

    def _take_cancellations(self) -> None:
        while self._cancelled:
            seq = self._cancelled.popleft()
            if seq.done:
                continue
            if seq.uid is not None and seq.uid in self._running:
                self._bg.remove([seq.uid])
                self._release(seq)
            elif seq in self._paused:
                self._paused.remove(seq)
                self._release(seq)
            else:
                with self._lock:
                    self.admission.waiting = deque(w for w in self.admission.waiting if w.item is not seq)
                    if seq in self._inbox:
                        self._inbox.remove(seq)
            self._end(seq, "cancelled")

    def _expire_waiting(self) -> None:
        with self._lock:
            expired = self.admission.expire()
            for_slot = self.admission.running >= self.admission.max_seqs
        for seq in expired:
            self._finish_with_error(seq, busy_error(time.monotonic() - seq.enqueued, for_slot))

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

    def _admit(self, *, background: bool = True) -> None:
        bpt = self.bytes_per_token

        def cache_tokens() -> int:  # rounded up: the figure must never be below what is held
            return -(-self.prompt_cache.nbytes // bpt)

        def evict(tokens: int) -> int:
            self.prompt_cache.trim_to(n_bytes=max(0, self.prompt_cache.nbytes - tokens * bpt))
            return cache_tokens()

        # One at a time: each takes its prefix from the cache before the next may evict it.
        while True:
            with self._lock:
                admitted = self.admission.admit(cache_tokens(), evict, background=background, limit=1)
                waiting = len(self.admission.waiting)
            if not admitted:
                break
            seq = admitted[0]
            try:
                self._insert(seq)
            except Exception as exc:  # noqa: BLE001 - one bad request fails alone
                log.exception("could not start request %s", seq.req.request_id)
                with self._lock:
                    self.admission.release(seq.reserved)
                self._finish_with_error(seq, EngineError(f"could not start generation: {exc}"))
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
        seq.processors = build_logits_processors(req.sampling)
        if req.constraint is not None:  # last, so it masks the penalised logits; kept across a pause
            seq.processors.append(req.constraint.processor(len(prompt)))
        seq.detok = new_detokenizer(self.tokenizer)
        seq.stops = StopMatcher(req.stop)
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
        seq.uid = uid
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

    def _on_token(self, seq: _Seq, r: Any) -> None:
        assert seq.stops is not None
        try:
            finish = r.finish_reason
            if finish != "stop":  # an EOS token is not text
                seq.detok.add_token(r.token)
            if finish is not None:
                seq.detok.finalize()
            seq.generated += 1
            self._time_token(seq)
            text = seq.stops.feed(seq.detok.last_segment)
            logprobs = [_token_logprob(r.token, r.logprobs, seq.req.logprobs)] if seq.req.logprobs is not None else []
            if seq.stops.stopped:
                if finish is None:
                    caches = self._bg.remove([seq.uid], return_prompt_caches=True)
                    self._store_conversation(seq, *caches.get(seq.uid, (None, None)))
                finish = "stop"
            elif finish is not None:
                text += seq.stops.flush()
                self._store_conversation(seq, r.prompt_cache, r.all_tokens)
            self._emit(seq, text, finish, logprobs)
        except Exception as exc:  # noqa: BLE001 - this request fails, the batch goes on
            log.exception("request %s failed while decoding", seq.req.request_id)
            if seq.uid in self._running and r.finish_reason is None:
                self._bg.remove([seq.uid])
            self._release(seq)
            self._finish_with_error(seq, EngineError(f"generation failed: {exc}"))

    @staticmethod
    def _time_token(seq: _Seq) -> None:
        now = time.monotonic()
        if seq.first_token is None:
            seq.first_token = now
        else:
            seq.gaps.append(now - (seq.last_token or now))
        seq.last_token = now

    def _store_conversation(self, seq: _Seq, cache: Any, tokens: Any) -> None:
        if self.params.prompt_cache != "prefix" or cache is None or tokens is None:
            return
        if len(tokens) >= self.params.cache_min_tokens:
            self.prompt_cache.insert_cache(self._cache_key(seq), list(tokens), cache, cache_type="assistant")

    def _emit(self, seq: _Seq, text: str, finish: str | None, logprobs: list[TokenLogprob]) -> None:
        delta = TokenDelta(text=text, tokens=1, finish_reason=finish, logprobs=logprobs)
        if finish is not None:
            delta.stop_sequence = seq.stops.matched if seq.stops is not None else None
            delta.prompt_tokens = len(seq.req.prompt_tokens)
            delta.cached_tokens = seq.cached_tokens
            delta.completion_tokens = seq.generated
            self._release(seq)
            self._end(seq, finish)
        seq.channel.put(delta)

    def _release(self, seq: _Seq) -> None:
        if seq.uid is not None and self._running.pop(seq.uid, None) is not None:
            with self._lock:
                self.admission.release(seq.reserved)
        elif seq.paused is not None:
            seq.paused = None  # its KV goes with it
            with self._lock:
                self.admission.release(seq.reserved, running=False)

    def _finish_with_error(self, seq: _Seq, exc: BaseException) -> None:
        self._end(seq, "error", exc)
        seq.channel.put(TokenDelta(error=exc))

    def _end(self, seq: _Seq, outcome: str, exc: BaseException | None = None) -> None:
        """Mark ``seq`` done and tell the listeners, once."""
        if seq.done:
            return
        seq.done = True
        now = time.monotonic()
        code = None
        if exc is not None:
            code = exc.code if isinstance(exc, AppError) else type(exc).__name__
        record = GenerationRecord(
            request_id=seq.req.request_id, model=self.loaded.name, outcome=outcome,
            prompt_tokens=len(seq.req.prompt_tokens), cached_tokens=seq.cached_tokens,
            completion_tokens=seq.generated,
            ttft_s=None if seq.first_token is None else seq.first_token - seq.enqueued,
            total_s=now - seq.enqueued, token_gaps_s=tuple(seq.gaps), error=code,
        )
        for listener in self._listeners:
            try:
                listener(record)
            except Exception:  # noqa: BLE001 - a listener's bug must not fail the request
                log.exception("generation listener failed")

    def _fail_batch(self, exc: Exception) -> None:
        for seq in list(self._running.values()):
            self._release(seq)
            self._finish_with_error(seq, EngineError(f"generation failed: {exc}"))
        self._bg = self._new_batch()
        reset_random_state()

    def _on_worker_death(self, exc: BaseException) -> None:
        err = EngineDeadError(f"the engine thread died: {exc}")
        with self._lock:
            waiting = self.admission.fail_all() + list(self._inbox)
            self._inbox.clear()
        for seq in waiting + list(self._running.values()) + list(self._paused):
            self._finish_with_error(seq, err)
        self._running.clear()
        self._paused.clear()

    def abort_all(self, exc: BaseException) -> Future[None]:
        """End every queued and running request with ``exc`` (a shutdown past its grace
        period); returns the worker's Future for it."""
        return self.worker.submit(lambda: self._abort_all(exc))

    def end_streams(self, exc: BaseException) -> None:
        """Event loop: end every open stream with ``exc`` now, without the MLX thread (when
        ``abort_all`` waits behind a long step at shutdown)."""
        self._streams.end_all(exc)

    def _abort_all(self, exc: BaseException) -> None:
        self._take_inbox()
        with self._lock:
            waiting = self.admission.fail_all()
        for seq in waiting:
            self._finish_with_error(seq, exc)
        for seq in list(self._running.values()):
            assert seq.uid is not None
            self._bg.remove([seq.uid])
            self._release(seq)
            self._finish_with_error(seq, exc)
        while self._paused:
            seq = self._paused.popleft()
            self._release(seq)
            self._finish_with_error(seq, exc)


def _token_logprob(token: int, logprobs: Any, top: int) -> TokenLogprob:
    """The sampled token's log-probability in the distribution the sampler drew from (after
    logit bias and penalties), and the ``top`` most likely tokens of that distribution."""
    alternatives: tuple[tuple[int, float], ...] = ()
    if top:
        ids = mx.argpartition(-logprobs, top - 1)[:top]
        values = logprobs[ids]
        order = mx.argsort(-values)
        alternatives = tuple(zip(ids[order].tolist(), values[order].tolist(), strict=True))  # type: ignore[arg-type]
    return TokenLogprob(token, float(logprobs[token].item()), alternatives)
