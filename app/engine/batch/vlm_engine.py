"""The native VLM engine: mlx-vlm's BatchGenerator driven from the MLX-owner thread.

The request lifecycle is ``BatchingEngine``'s (``app.engine.batch.batching``), as for
``TextEngine``: admission under the KV budget with ``max_queue`` /
``queue_timeout``, a client that leaves cancels its sequence, one bad request
fails alone, a ``GenerationRecord`` to the listeners whenever a generation ends,
stop strings on the text, per-request sampling and seeds, logprobs.

A request's way through, on the MLX thread:

    stream(req)      the prompt's exact tokens are known (``VlmPrompts.build`` ran the
                     processor at prepare time): admission reserves the real KV
    admit            against the KV budget (the prefix cache's memory tier counted),
                     interactive before background
    prefix           the KV of the prompt's longest cached prefix, images included
    encode           each image after that prefix: its features from the vision-feature
                     cache, or through the vision tower (one request per loop turn, so
                     running streams keep moving), merged into the rest's embeddings
    BatchGenerator   prefill of the rest and decode, batched with every other running
                     request; the finished row's KV back to the prefix cache

What is batched: prefill (``prefill_batch_size`` prompts at a time, in chunks of
``prefill_chunk_size``) and decode of every running request, images or not.
What is serialized: the vision tower, one request's images at a time between
batch steps; its memory is what the load-time worst-case profile measured.

Caches (issue 22):

- The vision-feature cache (``app.engine.batch.vision_features``): the vision tower's
  output per image, under its pixel digest, processor settings and cache scope;
  ``get_input_embeddings`` takes those rows as ``cached_image_features`` (Qwen2-VL,
  Qwen2.5-VL), so only images not held go through the tower, whatever text surrounds them.
- The prefix cache: ``TextEngine``'s (``app.engine.kv.prefix_cache``: the memory tier
  inside ``mem``, counted by admission and trimmed to what the reservations leave, and
  the disk tier), keyed by ``cache_key_tokens``: the prompt's tokens with each image's
  placeholder run replaced by ids drawn from its pixel digest, so a cached prefix runs
  across an image only when the pixels are the same (never by URL); partitioned per
  model, its max/min pixels and the request's cache namespace (API key, cache_salt).
  A request takes its longest cached prefix (cut back to an image's start when it ends
  inside one, and short of the last token), and only the rest is embedded into the
  batch: images wholly inside the prefix skip the vision tower and the feature cache
  (blank rows stand for them), and ``cached_tokens`` counts their tokens. In
  ``prompt_cache: prefix`` mode a row's KV goes back to the cache when it finishes, stops
  at a stop string or is cancelled after its prefill, keyed by its prompt's key tokens
  and what it generated: the next turn of the conversation starts there.

  mlx-vlm 0.7.x's ``BatchGenerator`` has no way in or out for a row's KV, so the fence
  (``mlx_internals.vlm_prefix_batch_generator``) subclasses it. In: a row inserted with
  a cache is prefilled through ``_build_mixed_prompt_batch``, mlx-vlm's warm-prefill hook
  (the one its own APC uses): the rows' caches merged into one left-padded
  ``BatchKVCache``, the rest of each prompt right-padded and rolled left after the last
  chunk. Positions stay exact: Qwen2-VL's M-RoPE positions of the whole prompt are
  computed as for a full prefill (``get_rope_index`` depends only on the tokens and the
  images' grids before each position), and the row gets the slice for its remaining
  tokens plus the whole prompt's ``rope_deltas``, which decode adds to the row's cache
  offset: every token sits where a full prefill puts it, and at temperature 0 the
  answer is the same. Out: the generator's one generation batch copies out the KV of
  each row marked ``keep_cache`` as it leaves (``filter``), for ``take_cache``.
  Models without explicit M-RoPE positions and per-image features (the other mlx-vlm
  families) have no prefix cache: ``cached_tokens`` stays 0 there.

Not here (``TextEngine`` has them): pausing background work and pausing for memory
(a row keeps its whole reservation), the ``system`` / ``first_message`` modes'
mid-prompt prefix (only whole conversations are stored), ``share_prefix``.

Per-request sampling rides on mlx-vlm's per-row logits processors
(``sampling_processor``), since its sampler is one for the whole batch. That
processor leaves only the sampled token, so mlx-vlm's own logprobs would say
nothing: a request with logprobs gets a ``logprob_tap`` just before it, which
keeps the distribution the token is drawn from.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field, replace
from importlib.metadata import version
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from app.engine.batch.batching import BatchingEngine, Seq
from app.engine.batch.sampling import build_logits_processors, build_sampler, logprob_tap, sampling_processor
from app.engine.batch.stops import StopMatcher
from app.engine.batch.vision_features import FeatureCache, input_embeddings
from app.engine.distributed.mirror import LOCAL_OPS
from app.engine.kv.disk_cache import DiskTier, disk_root, open_disk_tier
from app.engine.kv.kv_snapshot import kv_identity, probe_layout
from app.engine.kv.prefix_cache import DISK_WRITES_WAIT_S, PrefixCache
from app.engine.mlx_internals import (
    new_vlm_batch_generator,
    new_vlm_detokenizer,
    trim_prompt_cache,
    vlm_language_model,
    vlm_lm_cache,
    vlm_prefix_batch_generator,
    vlm_prefix_cacheable,
    vlm_rest_kwargs,
)
from app.engine.models.loader import KV_GROUP_SIZE
from app.engine.params import EngineParams
from app.engine.prompt import MultimodalPrompt, cache_key_tokens
from app.engine.types import EngineStats, GenerationRequest
from app.engine.worker import MLXWorker
from app.errors import AppError, ContextLengthError, EngineError, ImageError

if TYPE_CHECKING:
    from app.engine.models.vlm import LoadedVlm

log = logging.getLogger("tandem.engine")


@dataclass(eq=False)
class _Seq(Seq):
    # With logprobs: the distribution each generated token is drawn from, in order
    # (``logprob_tap``; mlx-vlm draws the next token before it returns this one).
    drawn_from: deque[mx.array] = field(default_factory=deque)
    # The prompt as the prefix cache keys it (``cache_key_tokens``), and the tokens generated:
    # together, what its KV holds when it leaves the batch.
    key: list[int] = field(default_factory=list)
    out: list[int] = field(default_factory=list)


class VlmEngine(BatchingEngine[_Seq, "LoadedVlm"]):
    """Continuous batching for one loaded native VLM, images and text alike."""

    def __init__(self, worker: MLXWorker, loaded: LoadedVlm, params: EngineParams, *,
                 feature_cache_bytes: int = 0) -> None:
        super().__init__(worker, loaded, params)
        # The vision tower's output per image (``app.engine.batch.vision_features``); 0 bytes: none.
        self.features = FeatureCache(feature_cache_bytes) if feature_cache_bytes > 0 else None
        from app.engine.models.vlm import VlmPrompts

        # The processor's one job per prompt runs here, on the MLX thread.
        self.prompts = VlmPrompts(loaded, lambda fn: worker.submit(fn).result())
        # Admitted, waiting for the vision tower (one per loop turn).
        self._starting: deque[_Seq] = deque()
        self.bytes_per_token = loaded.kv.bytes_per_token
        # The prefix cache (``app.engine.kv.prefix_cache``, as ``TextEngine``'s), for the
        # models whose rows can start from cached KV.
        self.prefix = params.prompt_cache != "off" and vlm_prefix_cacheable(loaded.model)
        disk = self._open_disk_tier() if self.prefix and params.prompt_cache_disk_bytes else None
        self.prompt_cache = PrefixCache(LOCAL_OPS.prompt_cache(), params.prompt_cache_entries,
                                        params.prompt_cache_bytes if self.prefix else 0, disk)
        self.cache_hits = 0
        self.cache_tokens_saved = 0
        worker.add_stepper(self._step, self._on_worker_death)
        log.info(
            "vlm %s: KV %d bytes/token, budget %d tokens, at most %d image(s) per request, vision-feature "
            "cache %.1f MB, prefix cache %s; EngineParams %s",
            loaded.name, loaded.kv.bytes_per_token, self.admission.budget_tokens, loaded.max_images,
            feature_cache_bytes / 2**20, f"{params.prompt_cache_bytes // 2**20} MB" if self.prefix else "off",
            params.to_log_string(),
        )

    def _open_disk_tier(self) -> DiskTier | None:
        """The prefix cache's disk tier, as ``TextEngine``'s: the language model's KV layers,
        under an identity of the weights and of what shaped each image's tokens."""
        loaded, p = self.loaded, self.params
        layout = probe_layout(vlm_language_model(loaded.model), None, KV_GROUP_SIZE)
        if layout is None:
            log.info("vlm %s: its KV caches are not plain KV layers: no prefix cache on disk", loaded.name)
            return None
        identity = kv_identity(loaded.model, loaded.path, {
            "kind": "vlm", "max_pixels": loaded.max_pixels, "min_pixels": loaded.min_pixels,
            "mlx_vlm": version("mlx-vlm")})
        return open_disk_tier(disk_root(p.prompt_cache_disk_dir), loaded.name, identity, p.prompt_cache_disk_bytes,
                              p.prompt_cache_disk_queue_mb * 2**20, layout)

    # ---- called from the event loop -------------------------------------------------

    def close(self) -> None:
        """Leave the MLX loop and drop the model (an unload). MLX thread only, idle."""
        super().close()
        self._bg = None
        if self.features is not None:
            self.features.clear()
        if not self.prompt_cache.close(DISK_WRITES_WAIT_S):
            log.warning("vlm %s: prompt cache writes still queued after %gs were dropped", self.name,
                        DISK_WRITES_WAIT_S)
        self.prompt_cache.collect()
        self.prompt_cache.trim_to(n_bytes=0)

    def finish_writes(self, timeout: float) -> bool:
        """Finish the prefix cache's queued disk writes (graceful shutdown); whether in time."""
        return self.prompt_cache.close(timeout)

    def stats(self) -> EngineStats:
        f = self.features
        return replace(
            super().stats(), active=len(self._running) + len(self._starting),
            vision_feature_cache=f.stats() if f is not None else None,
            vision_encoded_images=f.encoded if f is not None else 0,
            vision_encode_s=f.encode_s if f is not None else 0.0,
            prompt_cache_bytes=self.prompt_cache.nbytes,
            prompt_cache_hits=self.cache_hits,
            prompt_cache_tokens_saved=self.cache_tokens_saved,
            prompt_cache_tiers=self.prompt_cache.stats() if self.prefix else {},
        )

    async def _open(self, req: GenerationRequest) -> _Seq:
        self._check_open()
        check_images(req, self.loaded.max_images)
        prompt_len = len(req.prompt.tokens)
        limit = min(self.loaded.max_model_len, self.admission.budget_tokens)
        if prompt_len + req.max_tokens > limit:  # the pipeline's completion_budget keeps within it
            raise ContextLengthError(
                f"the prompt has {prompt_len} tokens with its images expanded and asks for {req.max_tokens} more; "
                f"this model takes {limit} in all (context {self.loaded.max_model_len}, "
                f"KV budget {self.admission.budget_tokens})", param="messages",
            )
        return _Seq(req, self._streams.open(), prompt_len + req.max_tokens, prompt_len)

    # ---- the MLX thread -------------------------------------------------------------

    @property
    def _parked(self) -> deque[_Seq]:
        return self._starting

    def _step(self) -> bool:
        if self._bg is None:
            self._bg = self._new_batch()
        self.prompt_cache.collect()
        busy = super()._step()
        self._settle()
        return busy

    def _schedule(self) -> None:
        self._starting.extend(self._admit(self.prompt_cache.nbytes, self._evict))
        self._start_one()

    def _new_batch(self) -> Any:
        p = self.params
        new = vlm_prefix_batch_generator if self.prefix else new_vlm_batch_generator
        return new(
            self.loaded.model, self.loaded.processor, max_num_seqs=p.max_num_seqs,
            prefill_batch_size=min(p.max_num_seqs, p.prefill_batch_size), prefill_step_size=p.prefill_chunk_size,
        )

    def _drop_row(self, uid: int) -> None:
        self._bg.remove(uid)

    # ---- the prefix cache: KV accounting as TextEngine's -------------------------------

    def _evict(self, nbytes: int, seq: _Seq | None = None) -> int:
        """Evict at least ``nbytes`` of the prefix cache's memory tier; what it holds then."""
        self.prompt_cache.trim_to(n_bytes=max(0, self.prompt_cache.nbytes - nbytes))
        return self.prompt_cache.nbytes

    def _settle(self) -> None:
        """After a step: the memory tier within what the reservations leave of the budget."""
        room = self.admission.budget_bytes - self.admission.reserved
        if self.prompt_cache.nbytes > room:
            self.prompt_cache.trim_to(n_bytes=max(0, room))

    def cache_key(self, namespace: str = "") -> str:
        """The prefix cache's partition: per model and its image settings (what shaped each
        image's tokens), and per namespace (a cache_salt, an API key), as ``TextEngine``'s."""
        return f"{self.loaded.name}\x00{self.loaded.max_pixels}/{self.loaded.min_pixels}\x00{namespace}"

    def _cached_prefix(self, seq: _Seq) -> tuple[list[Any] | None, int]:
        """The KV of ``seq``'s longest cached prefix (a copy it owns) and its length in tokens,
        cut back to the start of an image its end falls in, and short of the last token
        (which must run for the first new token's logits); (None, 0) on a miss."""
        prompt = seq.req.prompt
        seq.key = cache_key_tokens(prompt)
        cache, rest, _ = self.prompt_cache.fetch(self.cache_key(seq.req.cache_namespace), seq.key)
        if cache is None:
            return None, 0
        done = len(seq.key) - len(rest)
        for image in prompt.images:  # an image's rows are all cached or none
            if image.start < done < image.start + image.length:
                done = image.start
        done = min(done, len(seq.key) - 1)
        if done <= 0:
            return None, 0
        trim_prompt_cache(cache, cache[0].offset - done)
        self.cache_hits += 1
        self.cache_tokens_saved += done
        return cache, done

    def _keep_conversation(self, seq: _Seq, rows: list[Any] | None) -> None:
        """A row's KV as it left the batch into the prefix cache, keyed by its prompt's key
        tokens and the tokens it generated (``prompt_cache: prefix``)."""
        if rows is None:
            return
        cache = vlm_lm_cache(rows)
        tokens = (seq.key + seq.out)[: cache[0].offset]
        if len(tokens) < cache[0].offset:
            trim_prompt_cache(cache, cache[0].offset - len(tokens))
        if len(tokens) >= self.params.cache_min_tokens:
            self.prompt_cache.insert_cache(self.cache_key(seq.req.cache_namespace), tokens, cache,
                                           cache_type="assistant")

    def _release(self, seq: _Seq) -> None:
        if seq.uid is not None and self._keeps() and self._bg is not None:
            self._bg.take_cache(seq.uid)  # kept and not taken (a failure, a stop on the last token): dropped
        super()._release(seq)

    def _keeps(self) -> bool:
        return self.prefix and self.params.prompt_cache == "prefix"

    def _on_token(self, seq: _Seq, r: Any) -> None:
        if self._keeps():
            seq.out.append(r.token)
        super()._on_token(seq, r)

    def _on_finished(self, seq: _Seq, r: Any) -> None:
        if self._keeps():
            self._keep_conversation(seq, self._bg.take_cache(r.uid))

    def _stop_early(self, seq: _Seq) -> None:
        assert seq.uid is not None
        self._bg.remove(seq.uid)
        if self._keeps():
            self._keep_conversation(seq, self._bg.take_cache(seq.uid))

    def _cancel_row(self, seq: _Seq) -> None:
        """A cancelled row's KV goes to the prefix cache too, when it got past its prompt
        (a row removed in prefill gives none back)."""
        assert seq.uid is not None
        self._bg.remove(seq.uid)
        if self._keeps():
            self._keep_conversation(seq, self._bg.take_cache(seq.uid))

    def _start_one(self) -> None:
        """The vision tower for one admitted request, then into the batch."""
        if not self._starting:
            return
        seq = self._starting.popleft()
        req = seq.req
        try:
            from app.engine.models.vlm import prompt_inputs

            ids = list(req.prompt.tokens)
            images = req.prompt.images if isinstance(req.prompt, MultimodalPrompt) else ()
            cache, done = self._cached_prefix(seq) if self.prefix else (None, 0)
            kwargs = input_embeddings(self.loaded.model, prompt_inputs(req.prompt), images, self.features,
                                      req.cache_namespace, self.loaded.max_pixels, self.loaded.min_pixels,
                                      cached_tokens=done)
            if done:
                kwargs = vlm_rest_kwargs(kwargs, done)
            processors = build_logits_processors(req.sampling) + self._budget(seq, len(ids))
            if req.constraint is not None:  # masks before the sampling processor draws
                seq.constraint = req.constraint.processor(len(ids))
                processors.append(seq.constraint)
            if req.logprobs is not None:  # after every processor that shapes the distribution
                processors.append(logprob_tap(seq.drawn_from))
            if req.sampling.temperature > 0:
                processors.append(sampling_processor(build_sampler(req.sampling)))
            if self.prefix:
                uid = self._bg.insert_row(ids[done:], max_tokens=req.max_tokens, prompt_kwargs=kwargs,
                                          logits_processors=processors, cache=cache, prompt=ids)
                if self._keeps():
                    self._bg.keep_cache(uid)
            else:
                (uid,) = self._bg.insert([ids], max_tokens=[req.max_tokens], prompt_kwargs=[kwargs],
                                         logits_processors=[processors])
            seq.cached_tokens = done
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


def check_images(req: GenerationRequest, max_images: int) -> None:
    """The engine's own guard on a request's images (the pipeline checks the count first,
    naming the client's part): a text engine's prompt is refused elsewhere."""
    images = req.prompt.images if isinstance(req.prompt, MultimodalPrompt) else ()
    if len(images) > max_images:
        raise ImageError(
            f"this request has {len(images)} images; at most {max_images} are accepted",
            param=None, code="too_many_images",
        )
