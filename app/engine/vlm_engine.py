"""The native VLM engine: mlx-vlm's BatchGenerator driven from the MLX-owner thread.

The request lifecycle is ``BatchingEngine``'s (``app.engine.batching``), as for
``TextEngine``: admission under the KV budget with ``max_queue`` /
``queue_timeout``, a client that leaves cancels its sequence, one bad request
fails alone, a ``GenerationRecord`` to the listeners whenever a generation ends,
stop strings on the text, per-request sampling and seeds, logprobs.

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
(``sampling_processor``), since its sampler is one for the whole batch. That
processor leaves only the sampled token, so mlx-vlm's own logprobs would say
nothing: a request with logprobs gets a ``logprob_tap`` just before it, which
keeps the distribution the token is drawn from.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from app.engine.batching import BatchingEngine, Seq
from app.engine.mlx_internals import (
    new_vlm_batch_generator,
    new_vlm_detokenizer,
    vlm_input_embeddings,
    vlm_prompt_inputs,
)
from app.engine.params import EngineParams
from app.engine.sampling import build_logits_processors, build_sampler, logprob_tap, sampling_processor
from app.engine.stops import StopMatcher
from app.engine.types import EngineStats, GenerationRequest
from app.engine.worker import MLXWorker
from app.errors import AppError, ContextLengthError, EngineError, ImageError, InvalidRequestError

if TYPE_CHECKING:
    from app.engine.vlm import LoadedVlm

log = logging.getLogger("tandem.engine")


@dataclass(eq=False)
class _Seq(Seq):
    # The completion budget: what the context and the KV budget leave after the real prompt.
    max_tokens: int = 0
    # With logprobs: the distribution each generated token is drawn from, in order
    # (``logprob_tap``; mlx-vlm draws the next token before it returns this one).
    drawn_from: deque[mx.array] = field(default_factory=deque)


class VlmEngine(BatchingEngine[_Seq, "LoadedVlm"]):
    """Continuous batching for one loaded native VLM, images and text alike."""

    def __init__(self, worker: MLXWorker, loaded: LoadedVlm, params: EngineParams) -> None:
        super().__init__(worker, loaded, params)
        # Admitted, waiting for the vision tower (one per loop turn).
        self._starting: deque[_Seq] = deque()
        worker.add_stepper(self._step, self._on_worker_death)
        log.info(
            "vlm %s: KV %d bytes/token, budget %d tokens, at most %d image(s) per request; EngineParams %s",
            loaded.name, loaded.kv.bytes_per_token, self.admission.budget_tokens, loaded.max_images,
            params.to_log_string(),
        )

    # ---- called from the event loop -------------------------------------------------

    def close(self) -> None:
        """Leave the MLX loop and drop the model (an unload). MLX thread only, idle."""
        super().close()
        self._bg = None

    def stats(self) -> EngineStats:
        return replace(super().stats(), active=len(self._running) + len(self._starting))

    async def _open(self, req: GenerationRequest) -> _Seq:
        self._check_open()
        check_images(req, self.loaded.max_images, self.loaded.image_token)
        if req.prompt_text is None:
            prompt_len = len(req.prompt_tokens)
        else:
            prompt_len = await asyncio.wrap_future(self.worker.submit(lambda: self._count_tokens(req)))
        max_tokens = self._completion_budget(prompt_len, req.max_tokens)
        return _Seq(req, self._streams.open(), prompt_len + max_tokens, prompt_len, max_tokens=max_tokens)

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

    # ---- the MLX thread -------------------------------------------------------------

    def _count_tokens(self, req: GenerationRequest) -> int:
        """The prompt's tokens as the processor makes them (a job on the MLX thread)."""
        return int(self._inputs(req)["input_ids"].shape[-1])

    def _inputs(self, req: GenerationRequest) -> dict[str, Any]:
        """The processor's inputs for ``req``; a text-only request given as token ids
        skips the processor."""
        if req.prompt_text is None:
            return {"input_ids": mx.array([list(req.prompt_tokens)])}
        images = [fit_image(img, self.loaded.max_pixels) for img in req.images]
        try:
            return vlm_prompt_inputs(self.loaded.model, self.loaded.processor, req.prompt_text, images)
        except Exception as exc:  # noqa: BLE001 - the processor refusing this prompt is the request's fault
            raise InvalidRequestError(f"the model's processor cannot take this prompt: {exc}",
                                      param="messages") from exc

    @property
    def _parked(self) -> deque[_Seq]:
        return self._starting

    def _step(self) -> bool:
        if self._bg is None:
            self._bg = self._new_batch()
        return super()._step()

    def _schedule(self) -> None:
        self._starting.extend(self._admit())
        self._start_one()

    def _new_batch(self) -> Any:
        p = self.params
        return new_vlm_batch_generator(
            self.loaded.model, self.loaded.processor, max_num_seqs=p.max_num_seqs,
            prefill_batch_size=min(p.max_num_seqs, p.prefill_batch_size), prefill_step_size=p.prefill_chunk_size,
        )

    def _drop_row(self, uid: int) -> None:
        self._bg.remove(uid)

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
                seq.constraint = req.constraint.processor(len(ids))
                processors.append(seq.constraint)
            if req.logprobs is not None:  # after every processor that shapes the distribution
                processors.append(logprob_tap(seq.drawn_from))
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

    def _distribution(self, seq: _Seq, r: Any) -> mx.array:
        return seq.drawn_from.popleft()


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
