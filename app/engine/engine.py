"""The text engine: mlx-lm's BatchGenerator driven from the MLX-owner thread.

Async handlers call ``stream(request)``; the request is admitted against the
KV budget (``admission``), given a prefix from the prompt cache when one
matches exactly, inserted into the BatchGenerator, and its tokens come back
detokenized through a bounded ``TokenChannel``. A client that goes away
cancels its sequence and frees its KV. An exception in one sequence fails
that request only; a failure of the whole batch step fails the requests in
it and starts a fresh batch, and the thread goes on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator

from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import LRUPromptCache, trim_prompt_cache

from app.engine.admission import Admission, Waiting, busy_error
from app.engine.channel import TokenChannel
from app.engine.kv_quant import make_quantized_prompt_cache
from app.engine.loader import KV_GROUP_SIZE, LoadedModel
from app.engine.sampling import build_logits_processors, build_sampler, reset_random_state
from app.engine.stops import StopMatcher
from app.engine.types import EngineStats, GenerationRequest, TokenDelta
from app.engine.worker import MLXWorker
from app.errors import EngineDeadError, EngineError

if TYPE_CHECKING:  # the engine takes config objects but never imports pydantic
    from app.config.schema import EngineParams

log = logging.getLogger("tandem.engine")


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


class TextEngine:
    """Continuous batching for one loaded chat model."""

    def __init__(self, worker: MLXWorker, loaded: LoadedModel, params: EngineParams) -> None:
        self.worker = worker
        self.loaded = loaded
        self.params = params
        self.tokenizer = loaded.tokenizer
        bpt = loaded.kv.bytes_per_token
        self.bytes_per_token = bpt
        self.admission: Admission[_Seq] = Admission(
            loaded.kv.budget_tokens(params.kv_mem_mb),
            params.max_num_seqs,
            params.max_queue,
            params.queue_timeout_s,
        )
        cache_mb = params.prompt_cache_mem if params.prompt_cache_mem is not None else params.kv_mem_mb // 4
        self.prompt_cache = LRUPromptCache(max_size=256, max_bytes=cache_mb * 1024 * 1024)
        self.cache_hits = 0
        self.cache_tokens_saved = 0
        self._lock = threading.Lock()
        self._inbox: deque[_Seq] = deque()
        self._cancelled: deque[_Seq] = deque()
        self._running: dict[int, _Seq] = {}
        self._accepting = True
        self._last_wait_log = 0.0
        self._bg = self._new_batch()
        worker.add_stepper(self._step, self._on_worker_death)
        log.info(
            "model %s: KV %d bytes/token, budget %d tokens (mem=%d MB), prefix cache %d MB, "
            "max_num_seqs=%d, prefill_chunk_size=%d, max_model_len=%d",
            loaded.name, bpt, self.admission.budget_tokens, params.kv_mem_mb, cache_mb,
            params.max_num_seqs, params.prefill_chunk_size, loaded.max_model_len,
        )

    def _new_batch(self) -> BatchGenerator:
        return BatchGenerator(
            self.loaded.model,
            max_tokens=self.params.max_tokens,
            stop_tokens=[[t] for t in self.tokenizer.eos_token_ids],
            completion_batch_size=self.params.max_num_seqs,
            prefill_batch_size=min(self.params.max_num_seqs, 8),
            prefill_step_size=self.params.prefill_chunk_size,
        )

    # ---- called from the event loop -------------------------------------------------

    async def stream(self, req: GenerationRequest) -> AsyncIterator[TokenDelta]:
        """Deltas for one request, ending with the one that carries finish_reason."""
        seq = _Seq(req, TokenChannel(asyncio.get_running_loop()), len(req.prompt_tokens) + req.max_tokens)
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
        if not self.worker.alive:
            raise EngineDeadError("the engine is not running; see /health")
        if not self._accepting:
            raise EngineDeadError("the server is shutting down", retry_after=10)
        with self._lock:
            self.admission.check(seq.reserved)
            self._inbox.append(seq)
        self.worker.wake()

    def stop_accepting(self) -> None:
        self._accepting = False

    @property
    def in_flight(self) -> int:
        return len(self._inbox) + len(self.admission.waiting) + len(self._running)

    def stats(self) -> EngineStats:
        return EngineStats(
            alive=self.worker.alive,
            active=len(self._running),
            waiting=len(self.admission.waiting) + len(self._inbox),
            kv_budget_tokens=self.admission.budget_tokens,
            kv_reserved_tokens=self.admission.reserved,
            prompt_cache_bytes=self.prompt_cache.nbytes,
            prompt_cache_hits=self.cache_hits,
            prompt_cache_tokens_saved=self.cache_tokens_saved,
        )

    # ---- the MLX thread -------------------------------------------------------------

    def _step(self) -> bool:
        self._take_inbox()
        self._take_cancellations()
        self._expire_waiting()
        self._admit()
        if not self._running:
            return bool(self.admission.waiting)
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
                self._cache_prefix(r.uid)
        for r in gen_responses:
            seq = self._running.get(r.uid)
            if seq is not None:
                self._on_token(seq, r)
        return True

    def _take_inbox(self) -> None:
        while self._inbox:
            seq = self._inbox.popleft()
            with self._lock:
                self.admission.waiting.append(Waiting(seq, seq.reserved, seq.enqueued))

    def _take_cancellations(self) -> None:
        while self._cancelled:
            seq = self._cancelled.popleft()
            if seq.done:
                continue
            seq.done = True
            if seq.uid is not None and seq.uid in self._running:
                self._bg.remove([seq.uid])
                self._release(seq)
            else:
                with self._lock:
                    self.admission.waiting = deque(w for w in self.admission.waiting if w.item is not seq)
                    if seq in self._inbox:
                        self._inbox.remove(seq)

    def _expire_waiting(self) -> None:
        with self._lock:
            expired = self.admission.expire()
        for seq in expired:
            self._finish_with_error(seq, busy_error(time.monotonic() - seq.enqueued))

    def _admit(self) -> None:
        bpt = self.bytes_per_token

        def evict(tokens: int) -> int:
            self.prompt_cache.trim_to(n_bytes=max(0, self.prompt_cache.nbytes - tokens * bpt))
            return self.prompt_cache.nbytes // bpt

        with self._lock:
            admitted = self.admission.admit(self.prompt_cache.nbytes // bpt, evict)
            waiting = len(self.admission.waiting)
        if waiting and time.monotonic() - self._last_wait_log > 5:
            self._last_wait_log = time.monotonic()
            log.info(
                "%d request(s) waiting for KV memory: %d of %d tokens reserved by %d running, "
                "prefix cache %d MB", waiting, self.admission.reserved, self.admission.budget_tokens,
                self.admission.running, self.prompt_cache.nbytes // 2**20,
            )
        for seq in admitted:
            try:
                self._insert(seq)
            except Exception as exc:  # noqa: BLE001 - one bad request fails alone
                log.exception("could not start request %s", seq.req.request_id)
                with self._lock:
                    self.admission.release(seq.reserved)
                self._finish_with_error(seq, EngineError(f"could not start generation: {exc}"))

    def _insert(self, seq: _Seq) -> None:
        req, p = seq.req, self.params
        prompt = list(req.prompt_tokens)
        cache, rest = (None, prompt)
        if p.prompt_cache != "off":
            cache, rest = self.prompt_cache.fetch_nearest_cache(self.loaded.name, prompt)
            if cache is not None and not rest:  # exact hit: the last token must still run
                trim_prompt_cache(cache, 1)
                rest = prompt[-1:]
        if cache is None and p.kv_cache_bits is not None:
            cache = make_quantized_prompt_cache(self.loaded.model, p.kv_cache_bits, KV_GROUP_SIZE)
        cached = len(prompt) - len(rest)
        if cached:
            self.cache_hits += 1
            self.cache_tokens_saved += cached
        segments = [rest]
        prefix = req.cache_prefix_len
        if p.prompt_cache != "off" and prefix and cached < prefix < len(prompt) and prefix >= p.cache_min_tokens:
            segments = [prompt[cached:prefix], prompt[prefix:]]
            seq.cache_segments = 1
        processors = build_logits_processors(req.sampling)
        if req.constraint is not None:  # last, so it masks the penalised logits
            processors.append(req.constraint.processor(len(prompt)))
        (uid,) = self._bg.insert_segments(
            [segments],
            max_tokens=[req.max_tokens],
            caches=[cache] if cache is not None else None,
            all_tokens=[prompt[:cached]],
            samplers=[build_sampler(req.sampling)],
            logits_processors=[processors],
        )
        seq.uid, seq.cached_tokens = uid, cached
        seq.detok = self.tokenizer.detokenizer
        seq.stops = StopMatcher(req.stop)
        self._running[uid] = seq

    def _cache_prefix(self, uid: int) -> None:
        for _, (cache, tokens) in self._bg.extract_cache([uid]).items():
            self.prompt_cache.insert_cache(self.loaded.name, list(tokens), cache, cache_type="system")

    def _on_token(self, seq: _Seq, r: Any) -> None:
        try:
            finish = r.finish_reason
            if finish != "stop":  # an EOS token is not text
                seq.detok.add_token(r.token)
            if finish is not None:
                seq.detok.finalize()
            seq.generated += 1
            text = seq.stops.feed(seq.detok.last_segment)
            if seq.stops.stopped:
                if finish is None:
                    caches = self._bg.remove([seq.uid], return_prompt_caches=True)
                    self._store_conversation(*caches.get(seq.uid, (None, None)))
                finish = "stop"
            elif finish is not None:
                text += seq.stops.flush()
                self._store_conversation(r.prompt_cache, r.all_tokens)
            self._emit(seq, text, finish)
        except Exception as exc:  # noqa: BLE001 - this request fails, the batch goes on
            log.exception("request %s failed while decoding", seq.req.request_id)
            if seq.uid in self._running and r.finish_reason is None:
                self._bg.remove([seq.uid])
            self._release(seq)
            self._finish_with_error(seq, EngineError(f"generation failed: {exc}"))

    def _store_conversation(self, cache: Any, tokens: Any) -> None:
        if self.params.prompt_cache != "prefix" or cache is None or tokens is None:
            return
        if len(tokens) >= self.params.cache_min_tokens:
            self.prompt_cache.insert_cache(self.loaded.name, list(tokens), cache, cache_type="assistant")

    def _emit(self, seq: _Seq, text: str, finish: str | None) -> None:
        delta = TokenDelta(text=text, tokens=1, finish_reason=finish)
        if finish is not None:
            delta.prompt_tokens = len(seq.req.prompt_tokens)
            delta.cached_tokens = seq.cached_tokens
            delta.completion_tokens = seq.generated
            self._release(seq)
            seq.done = True
        seq.channel.put(delta)

    def _release(self, seq: _Seq) -> None:
        if seq.uid is not None and self._running.pop(seq.uid, None) is not None:
            with self._lock:
                self.admission.release(seq.reserved)

    def _finish_with_error(self, seq: _Seq, exc: BaseException) -> None:
        seq.done = True
        seq.channel.put(TokenDelta(error=exc))

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
        for seq in waiting + list(self._running.values()):
            self._finish_with_error(seq, err)
        self._running.clear()

    def abort_all(self, exc: BaseException):
        """End every queued and running request with ``exc`` (a shutdown past its grace
        period); returns the worker's Future for it."""
        return self.worker.submit(lambda: self._abort_all(exc))

    def _abort_all(self, exc: BaseException) -> None:
        self._take_inbox()
        with self._lock:
            waiting = self.admission.fail_all()
        for seq in waiting:
            self._finish_with_error(seq, exc)
        for seq in list(self._running.values()):
            self._bg.remove([seq.uid])
            self._release(seq)
            self._finish_with_error(seq, exc)

