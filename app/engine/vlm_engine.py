"""The native VLM engine: mlx-vlm's BatchGenerator driven from the MLX-owner thread.

The same guarantees as ``TextEngine``: admission under the KV budget with
``max_queue`` / ``queue_timeout``, a client that leaves cancels its sequence,
one bad request fails alone, a ``GenerationRecord`` to the listeners whenever a
generation ends, stop strings on the text, per-request sampling and seeds.

A request's way through, on the MLX thread:

    stream(req)      count its prompt tokens with the processor (a one-off job):
                     the placeholders expanded, so admission reserves the real KV
    admit            against the KV budget, interactive before background
    encode           the processor again, then the vision tower (one request per
                     loop turn, so running streams keep moving): its embeddings
    BatchGenerator   prefill and decode, batched with every other running request

What is batched: prefill (``prefill_batch_size`` prompts at a time, in chunks of
``prefill_chunk_size``) and decode of every running request, images or not.
What is serialized: the vision tower, one request's images at a time between
batch steps; its memory is what the load-time worst-case profile measured.
Not here (``TextEngine`` has them): the prefix cache, pausing background work.
Per-request sampling rides on mlx-vlm's per-row logits processors
(``sampling_processor``), since its sampler is one for the whole batch.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from app.engine.admission import Admission, Waiting, busy_error
from app.engine.channel import OpenStreams, TokenChannel
from app.engine.mlx_internals import (
    new_vlm_batch_generator,
    new_vlm_detokenizer,
    vlm_input_embeddings,
    vlm_prompt_inputs,
)
from app.engine.params import EngineParams
from app.engine.sampling import build_logits_processors, build_sampler, reset_random_state, sampling_processor
from app.engine.stops import StopMatcher
from app.engine.types import EngineStats, GenerationRecord, GenerationRequest, TokenDelta
from app.engine.worker import MLXWorker
from app.errors import AppError, ContextLengthError, EngineDeadError, EngineError, ImageError, InvalidRequestError

if TYPE_CHECKING:
    from app.engine.vlm import LoadedVlm

log = logging.getLogger("tandem.engine")

Listener = Callable[[GenerationRecord], None]


@dataclass(eq=False)
class _Seq:
    req: GenerationRequest
    channel: TokenChannel
    prompt_len: int
    max_tokens: int
    uid: int | None = None
    detok: Any = None
    stops: StopMatcher | None = None
    generated: int = 0
    done: bool = False
    # Its KV reservation was given back.
    released: bool = False
    enqueued: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    gaps: list[float] = field(default_factory=list)

    @property
    def reserved(self) -> int:
        return self.prompt_len + self.max_tokens

    @property
    def background(self) -> bool:
        return self.req.priority == "background"


class VlmEngine:
    """Continuous batching for one loaded native VLM, images and text alike."""

    def __init__(self, worker: MLXWorker, loaded: LoadedVlm, params: EngineParams) -> None:
        self.worker = worker
        self.loaded = loaded
        self.params = params
        self.tokenizer = loaded.tokenizer
        self.admission: Admission[_Seq] = Admission(
            loaded.kv.budget_tokens(params.kv_mem_mb), params.max_num_seqs, params.max_queue,
            params.queue_timeout_s, starvation_s=params.starvation_s,
        )
        self._listeners: list[Listener] = []
        self._streams = OpenStreams(params.channel_max_pending)
        self._lock = threading.Lock()
        self._inbox: deque[_Seq] = deque()
        self._cancelled: deque[_Seq] = deque()
        # Admitted, waiting for the vision tower (one per loop turn).
        self._starting: deque[_Seq] = deque()
        self._running: dict[int, _Seq] = {}
        self._accepting = True
        self._bg: Any = None  # made on the MLX thread, at its first step
        worker.add_stepper(self._step, self._on_worker_death)
        log.info(
            "vlm %s: KV %d bytes/token, budget %d tokens, at most %d image(s) per request; EngineParams %s",
            loaded.name, loaded.kv.bytes_per_token, self.admission.budget_tokens, loaded.max_images,
            params.to_log_string(),
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
        size = self.loaded.config.get("vocab_size")
        return int(size) if size else None

    @property
    def in_flight(self) -> int:
        return len(self._inbox) + len(self.admission.waiting) + len(self._starting) + len(self._running)

    def add_listener(self, listener: Listener) -> None:
        """Call ``listener`` (on the MLX thread; it must be quick) for every generation that ends."""
        self._listeners.append(listener)

    def close(self) -> None:
        """Leave the MLX loop and drop the model (an unload). MLX thread only, idle."""
        self._accepting = False
        self.worker.remove_stepper(self._step)
        self._bg = None

    def stop_accepting(self) -> None:
        self._accepting = False

    def finish_writes(self, timeout: float) -> bool:
        """Nothing to finish: native VLM prompts are not cached."""
        return True

    def stats(self) -> EngineStats:
        return EngineStats(
            alive=self.worker.alive,
            active=len(self._running) + len(self._starting),
            waiting=len(self.admission.waiting) + len(self._inbox),
            kv_budget_tokens=self.admission.budget_tokens,
            kv_reserved_tokens=self.admission.reserved,
            prompt_cache_bytes=0,
            kv_max_sequence_tokens=self.admission.max_sequence_tokens,
        )

    async def stream(self, req: GenerationRequest) -> AsyncGenerator[TokenDelta, None]:
        """Deltas for one request, ending with the one that carries finish_reason."""
        self._check_open()
        check_images(req, self.loaded.max_images, self.loaded.image_token)
        if req.prompt_text is None:
            prompt_len = len(req.prompt_tokens)
        else:
            prompt_len = await asyncio.wrap_future(self.worker.submit(lambda: self._count_tokens(req)))
        seq = _Seq(req, self._streams.open(), prompt_len,
                   self._completion_budget(prompt_len, req.max_tokens))
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

    def _check_open(self) -> None:
        if not self.worker.alive:
            raise EngineDeadError("the engine is not running; see /health")
        if not self._accepting:
            raise EngineDeadError("the server is shutting down", retry_after=10)

    def _completion_budget(self, prompt_len: int, wanted: int) -> int:
        """``wanted`` clamped to what the context and the KV budget leave after the real
        prompt (images expanded), as the pipeline clamps text prompts."""
        limit = min(self.loaded.max_model_len, self.admission.budget_tokens)
        if prompt_len >= limit:
            raise ContextLengthError(
                f"the prompt has {prompt_len} tokens with its images expanded; this model takes at most "
                f"{limit - 1} (context {self.loaded.max_model_len}, KV budget {self.admission.budget_tokens})",
                param="messages",
            )
        return max(1, min(wanted, limit - prompt_len))

    def _submit(self, seq: _Seq) -> None:
        self._check_open()
        with self._lock:
            self.admission.check(seq.reserved, arriving=len(self._inbox))
            self._inbox.append(seq)
        self.worker.wake()

    # ---- the MLX thread -------------------------------------------------------------

    def _count_tokens(self, req: GenerationRequest) -> int:
        """The prompt's tokens as the processor makes them (a job on the MLX thread)."""
        return int(self._inputs(req)["input_ids"].shape[-1])

    def _inputs(self, req: GenerationRequest) -> dict[str, Any]:
        """The processor's inputs for ``req``; a text-only request given as token ids
        skips the processor."""
        if req.prompt_text is None:
            import mlx.core as mx

            return {"input_ids": mx.array([list(req.prompt_tokens)])}
        images = [fit_image(img, self.loaded.max_pixels) for img in req.images]
        try:
            return vlm_prompt_inputs(self.loaded.model, self.loaded.processor, req.prompt_text, images)
        except Exception as exc:  # noqa: BLE001 - the processor refusing this prompt is the request's fault
            raise InvalidRequestError(f"the model's processor cannot take this prompt: {exc}",
                                      param="messages") from exc

    def _step(self) -> bool:
        if self._bg is None:
            self._bg = self._new_batch()
        self._take_inbox()
        self._take_cancellations()
        self._expire_waiting()
        self._admit()
        self._start_one()
        if not self._running:
            return bool(self.admission.waiting or self._starting)
        try:
            _, responses = self._bg.next()
        except Exception as exc:  # noqa: BLE001 - fail this batch, keep the thread
            log.exception("vlm batch step failed; failing %d requests", len(self._running))
            self._fail_batch(exc)
            return True
        for r in responses:
            seq = self._running.get(r.uid)
            if seq is not None:
                self._on_token(seq, r)
        return True

    def _new_batch(self) -> Any:
        p = self.params
        return new_vlm_batch_generator(
            self.loaded.model, self.loaded.processor, max_num_seqs=p.max_num_seqs,
            prefill_batch_size=min(p.max_num_seqs, p.prefill_batch_size), prefill_step_size=p.prefill_chunk_size,
        )

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
                self._bg.remove(seq.uid)
                self._release(seq)
            elif seq in self._starting:
                self._starting.remove(seq)
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

    def _admit(self) -> None:
        with self._lock:
            admitted = self.admission.admit(0, lambda _: 0)
        self._starting.extend(admitted)

    def _start_one(self) -> None:
        """The vision tower for one admitted request, then into the batch."""
        if not self._starting:
            return
        seq = self._starting.popleft()
        req = seq.req
        try:
            inputs = self._inputs(req)
            ids = inputs["input_ids"][0].tolist()
            kwargs = vlm_input_embeddings(self.loaded.model, inputs)
            processors = build_logits_processors(req.sampling)
            if req.constraint is not None:  # masks before the sampling processor draws
                processors.append(req.constraint.processor(len(ids)))
            if req.sampling.temperature > 0:
                processors.append(sampling_processor(build_sampler(req.sampling)))
            (uid,) = self._bg.insert([ids], max_tokens=[seq.max_tokens], prompt_kwargs=[kwargs],
                                     logits_processors=[processors])
        except Exception as exc:  # noqa: BLE001 - one bad request fails alone
            log.exception("could not start request %s", req.request_id)
            self._release(seq)
            err = exc if isinstance(exc, AppError) else EngineError(f"could not start generation: {exc}")
            self._finish_with_error(seq, err)
            return
        seq.uid = uid
        seq.detok = new_vlm_detokenizer(self.loaded.processor)
        seq.stops = StopMatcher(req.stop)
        self._running[uid] = seq

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
            if seq.stops.stopped:
                if finish is None:
                    self._bg.remove(seq.uid)
                finish = "stop"
            elif finish is not None:
                text += seq.stops.flush()
            self._emit(seq, text, finish)
        except Exception as exc:  # noqa: BLE001 - this request fails, the batch goes on
            log.exception("request %s failed while decoding", seq.req.request_id)
            if seq.uid in self._running and r.finish_reason is None:
                self._bg.remove(seq.uid)
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

    def _emit(self, seq: _Seq, text: str, finish: str | None) -> None:
        delta = TokenDelta(text=text, tokens=1, finish_reason=finish)
        if finish is not None:
            delta.stop_sequence = seq.stops.matched if seq.stops is not None else None
            delta.prompt_tokens = seq.prompt_len
            delta.completion_tokens = seq.generated
            self._release(seq)
            self._end(seq, finish)
        seq.channel.put(delta)

    def _release(self, seq: _Seq) -> None:
        """Free the KV reservation of an admitted sequence (running or about to start), once."""
        if seq.uid is not None:
            self._running.pop(seq.uid, None)
        if not seq.released:
            seq.released = True
            with self._lock:
                self.admission.release(seq.reserved)

    def _finish_with_error(self, seq: _Seq, exc: BaseException) -> None:
        self._end(seq, "error", exc)
        seq.channel.put(TokenDelta(error=exc))

    def _end(self, seq: _Seq, outcome: str, exc: BaseException | None = None) -> None:
        """Mark ``seq`` done and tell the listeners, once."""
        if seq.done:
            return
        seq.done = True
        code = None
        if exc is not None:
            code = exc.code if isinstance(exc, AppError) else type(exc).__name__
        record = GenerationRecord(
            request_id=seq.req.request_id, model=self.loaded.name, outcome=outcome,
            prompt_tokens=seq.prompt_len, cached_tokens=0, completion_tokens=seq.generated,
            ttft_s=None if seq.first_token is None else seq.first_token - seq.enqueued,
            total_s=time.monotonic() - seq.enqueued, token_gaps_s=tuple(seq.gaps), error=code,
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
        self._bg.close()
        self._bg = self._new_batch()
        reset_random_state()

    def _on_worker_death(self, exc: BaseException) -> None:
        err = EngineDeadError(f"the engine thread died: {exc}")
        with self._lock:
            waiting = self.admission.fail_all() + list(self._inbox)
            self._inbox.clear()
        for seq in waiting + list(self._starting) + list(self._running.values()):
            self._finish_with_error(seq, err)
        self._starting.clear()
        self._running.clear()

    def abort_all(self, exc: BaseException) -> Future[None]:
        """End every queued and running request with ``exc`` (a shutdown past its grace
        period); returns the worker's Future for it."""
        return self.worker.submit(lambda: self._abort_all(exc))

    def end_streams(self, exc: BaseException) -> None:
        """Event loop: end every open stream with ``exc`` now, without the MLX thread."""
        self._streams.end_all(exc)

    def _abort_all(self, exc: BaseException) -> None:
        self._take_inbox()
        with self._lock:
            waiting = self.admission.fail_all()
        for seq in waiting:
            self._finish_with_error(seq, exc)
        for seq in list(self._starting) + list(self._running.values()):
            if seq.uid is not None and self._bg is not None:
                self._bg.remove(seq.uid)
            self._release(seq)
            self._finish_with_error(seq, exc)
        self._starting.clear()


def check_images(req: GenerationRequest, max_images: int, image_token: str | None) -> None:
    """The engine's own guard on a request's images: the count (the pipeline checks it
    first, naming the client's part), and one placeholder per image in the prompt
    (mlx-vlm's processor silently drops images that have none)."""
    if len(req.images) > max_images:
        raise ImageError(
            f"this request has {len(req.images)} images; at most {max_images} are accepted",
            param=None, code="too_many_images",
        )
    if req.images and req.prompt_text is None:
        raise InvalidRequestError("images need a prompt rendered by the model's chat template (prompt_text)")
    if req.prompt_text is not None and image_token is not None:
        placeholders = req.prompt_text.count(image_token)
        if placeholders != len(req.images):
            raise InvalidRequestError(
                f"the prompt has {placeholders} image placeholder(s) for {len(req.images)} image(s)",
                param="messages",
            )


def fit_image(image: Any, max_pixels: int) -> Any:
    """``image`` shrunk, keeping its aspect ratio, to at most ``max_pixels`` (the
    worst case the load-time profile measured). Usually a no-op: the pipeline
    decodes images to that size already."""
    w, h = image.size
    if w * h <= max_pixels:
        return image
    scale = math.sqrt(max_pixels / (w * h))
    return image.resize((max(1, math.floor(w * scale)), max(1, math.floor(h * scale))))
