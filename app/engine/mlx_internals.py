"""Every private or undocumented mlx-lm / mlx-vlm / mlx-embeddings API Tandem relies on, in one place.

mlx-lm's continuous batching and its cache classes are not a documented API:
the names, fields and behaviours below were read from mlx-lm 0.32.x and
mlx-vlm 0.7.x. ``pyproject.toml`` pins those minor versions, and
``tests/engine/test_mlx_internals.py`` checks each contract listed here and
fails naming it, so an upgrade that breaks one is caught before it ships.
Nothing else in Tandem imports these names from mlx-lm, mlx-vlm or mlx-embeddings
directly (their documented entry points, ``mlx_lm.load``, ``mlx_lm.sample_utils``,
``mlx_lm.convert``, ``mlx_vlm.load`` and ``apply_chat_template``, are imported where used).
Each ``name`` in a list below has a contract test named for it: a test checks the list
and the tests agree.

mlx-lm
Tandem's decode step (``app.engine.step``) runs batches itself over the model's public
call (``model(tokens, cache=)``); what it takes from mlx-lm besides the models is their
caches:
- ``models.cache``: ``make_prompt_cache(model)`` (the model's own ``make_cache()``: one
  cache per layer, its kind the class: ``app.engine.kv.layers``); ``trim_prompt_cache``
  (the draft model's own cache); the per-sequence classes ``KVCache``,
  ``QuantizedKVCache``, ``RotatingKVCache`` (``keys, values, offset, max_size, keep,
  _idx``), ``ArraysCache`` (``cache``: its arrays, ``left_padding``, ``lengths``) and
  ``CacheList`` (``caches``), with ``merge`` into their batch classes; the batch classes
  ``BatchKVCache`` and ``BatchRotatingKVCache`` (and ``ArraysCache``, ``CacheList``, which
  batch themselves) with the batch-cache protocol the step drives: ``merge``, ``extend``,
  ``filter(rows)``, ``extract(row)``, ``prepare(lengths=, right_padding=)`` and
  ``finalize()`` around a right-padded forward pass, ``trim`` (kv kinds), ``make_mask``,
  ``nbytes``, ``state``; the verify step's rollback reads and sets their fields
  (``layers._BATCH_FIELDS``: ``BatchKVCache``'s ``keys, values, offset, left_padding,
  _idx``; ``BatchRotatingKVCache``'s ``keys, values, offset, left_padding, max_size,
  _offset, _idx, rotated, _lengths``; ``ArraysCache``'s ``cache, left_padding,
  lengths``). Batch caches are rectangles: each row as wide as the widest (left padding,
  right-padded prefill chunks rolled left), plain KV grown ``KVCache.step`` (256) tokens
  at a time (``admission`` relies on it). ``TokenBuffer(tokens)``:
  ``update_and_fetch(new)``, the context a row's logits processors see. ``_BaseCache``;
  ``dynamic_roll``; ``models.base.create_causal_mask``: what ``kv_quant`` builds its
  batched quantized cache from.
- ``utils.sharded_load(path, pipeline_group=, tensor_group=, return_config=)``: loads
  this rank's shard (tensor parallel through ``Model.shard(group)``, pipeline through
  ``Model.model.pipeline(group)``, which needs ``model.safetensors.index.json``) and ends
  with an ``all_sum`` barrier; ``utils._get_classes(config) -> (Model, ModelArgs)``, for
  telling which of the two a model type supports before loading it.
- ``TokenizerWrapper``: ``detokenizer`` (a fresh streaming detokenizer on each
  access), ``eos_token_ids``, ``has_thinking``; the streaming detokenizers drop
  the first token's leading space (``SPMStreamingDetokenizer.trim_space``;
  ``BPEStreamingDetokenizer`` whenever its ``text`` is empty), which
  ``new_detokenizer`` undoes: a continuation keeps its space.

mlx-vlm
- the processor's ``tokenizer.stopping_criteria.reset(eos_token_id)``, which
  ``mlx_vlm.generate`` calls before each generation (``stream_generate`` does not), and
  its ``eos_token_ids`` after it: the tokens a generation stops at (``vlm_stop_tokens``);
- ``processor.clean_output(text)`` when the model defines one;
- ``generate.ar.BatchGenerator(language_model, processor, completion_batch_size=,
  prefill_batch_size=, prefill_step_size=, compute_logprobs=, sampler=)``: one
  batch-wide sampler; ``insert([ids], max_tokens=, prompt_kwargs=[kw],
  logits_processors=[[...]]) -> uids`` where ``kw`` carries the prompt's
  ``inputs_embeds``; ``next() -> (prompt_progress, responses)`` with ``uid, token,
  finish_reason`` ("stop" at an EOS of the processor's stopping criteria,
  "length"); ``remove(uid)``; ``close()``. It admits waiting prompts only while
  ``completion_batch_size - decoding >= prefill_batch_size``.
- for the prefix cache (``vlm_prefix_batch_generator``, ``_vlm_prefix_batch_class``):
  ``BatchGenerator._build_mixed_prompt_batch(sequences)``, called by ``_next`` with the
  prompts it is about to prefill (tuples ``uid, ids, max_tokens, prompt_kwargs,
  logits_processors, thinking_budget_criteria``) and returning a prompt batch for all of
  them, or None for its own cold prefill; ``BatchGenerator._extend_generation_batch(
  gen_batch)``, each finished prefill's rows handed to the generation batch, which is
  the generator's ``_generation_batch`` (replaced once, at construction, by an empty one of
  ours made from its ``model``, ``sampler``, ``tokenizer.stopping_criteria``,
  ``compute_logprobs``, ``top_logprobs_k`` and ``greedy_sampling``);
  ``GenerationBatch.empty(model, sampler, stop_criteria, compute_logprobs=,
  top_logprobs_k=, greedy_sampling=)``, its ``extend`` (into an empty one too), its
  ``filter(keep)``, through which every leaving row goes (finished inside ``next()``,
  or ``remove``d), and its ``uids`` and ``prompt_cache`` (one cache per layer, rows in
  ``uids`` order); ``PromptProcessingBatch(model=, uids=, input_ids=, max_tokens=,
  inputs_embeds=, prompt_kwargs=, logits_processors=, thinking_budget_criteria=,
  prefill_step_size=, warm_cache=, right_pad_per_row=, suffix_lens=, greedy_sampling=)``,
  mlx-vlm's warm prefill (the layers' caches given, right-padded rows rolled left after
  the last chunk), whose ``_token_context`` is the context its rows' logits processors
  see; ``models.cache.BatchKVCache.merge`` and ``extract``, ``models.cache.KVCache``
  (``keys``, ``values``, ``offset``). The language model takes explicit M-RoPE
  ``position_ids`` for the tokens it is given and, decoding, adds ``rope_deltas`` to each
  row's cache offset: so a row prefilled from a cached prefix gets the positions a full
  prefill gives.
- ``model.get_input_embeddings(input_ids, pixel_values, mask=, **processor_extras)
  .to_dict()``: the prompt's embeddings with the image features merged in, and
  the model's position extras (Qwen2-VL's M-RoPE ``position_ids``, ``rope_deltas``);
  with ``cached_image_features=`` (Qwen2-VL, Qwen2.5-VL) it merges those rows in place
  of running the vision tower; ``model.vision_tower(pixel_values, grid_thw,
  output_hidden_states=False)`` there gives one row per image token, image after
  image, each image's rows its own (block-diagonal attention over ``grid_thw``),
  which is what lets ``batch/vision_features`` encode and cache images one by one;
  ``model.language_model``; ``model.config.text_config`` (a dataclass);
- for Tandem's decode step (``models/vlm_forward``): ``model.language_model(tokens,
  cache=, inputs_embeds=, position_ids=, visual_pos_masks=, deepstack_visual_embeds=)``
  returning a ``LanguageModelOutput`` (``logits``), which given its own text embeddings
  computes what it computes from the ids, and places each token where explicit
  ``position_ids`` say (M-RoPE: (3, B, L)), in mlx-lm's batch caches; its
  ``make_cache()``, of mlx-vlm's own copies of mlx-lm's cache classes (``KVCache``,
  ``RotatingKVCache`` ``max_size, keep``, ``ArraysCache`` ``cache``, ``ChunkedKVCache``
  ``chunk_size``, ``CacheList`` ``caches``), which ``vlm_make_cache`` translates to
  mlx-lm's; ``get_input_embeddings(input_ids, None)`` for text alone, and the fields of
  its ``InputEmbeddingsFeatures`` (``to_dict``) that ``vlm_forward`` batches.
- ``utils.should_add_special_tokens(model_type, processor)``, the rule
  ``mlx_vlm.generate`` applies before ``prepare_inputs``; without images,
  ``prepare_inputs`` is the tokenizer alone (``vlm_text_tokens`` calls it so);
- ``prompt_utils.SINGLE_IMAGE_ONLY_MODELS``: model types that take one image;
- ``tokenizer_utils.make_streaming_detokenizer(processor)``: a private streaming
  detokenizer (``add_token``, ``finalize``, ``last_segment``) per sequence.

mlx-embeddings
- ``utils.load_model(path, model_config=)``: the model alone (its tokenizer is read
  with ``tokenizers``), with ``model_config`` overriding the checkpoint's config
  (ModernBERT's ``classifier_pooling``); its forward ``model(input_ids,
  attention_mask=)`` returns ``text_embeds``, ``last_hidden_state`` and, for
  ModernBERT's classifier, ``pooler_output`` (the sigmoid of its one logit).

Fenced names (one a line: an import path, or ``<vlm model>`` / ``<vlm processor>`` for
the loaded objects' members; ``test_every_fenced_name_has_a_contract_test`` keeps this
list and the contract tests in step):

    mlx_lm.models.cache.TokenBuffer
    mlx_lm.models.cache.trim_prompt_cache
    mlx_lm.models.cache.make_prompt_cache
    mlx_lm.models.cache.KVCache
    mlx_lm.models.cache.QuantizedKVCache
    mlx_lm.models.cache.RotatingKVCache
    mlx_lm.models.cache.ArraysCache
    mlx_lm.models.cache.CacheList
    mlx_lm.models.cache._BaseCache
    mlx_lm.models.cache.BatchKVCache
    mlx_lm.models.cache.BatchKVCache._idx
    mlx_lm.models.cache.BatchRotatingKVCache
    mlx_lm.models.cache.dynamic_roll
    mlx_lm.models.base.create_causal_mask
    mlx_lm.utils.sharded_load
    mlx_lm.utils._get_classes
    mlx_lm.tokenizer_utils.TokenizerWrapper
    mlx_lm.tokenizer_utils.SPMStreamingDetokenizer
    mlx_lm.tokenizer_utils.BPEStreamingDetokenizer
    mlx_vlm.prepare_inputs
    mlx_vlm.generate.ar.BatchGenerator
    mlx_vlm.generate.ar.BatchGenerator.insert
    mlx_vlm.generate.ar.BatchGenerator.next
    mlx_vlm.generate.ar.BatchGenerator.remove
    mlx_vlm.generate.ar.BatchGenerator.close
    mlx_vlm.generate.ar.BatchGenerator._build_mixed_prompt_batch
    mlx_vlm.generate.ar.BatchGenerator._extend_generation_batch
    mlx_vlm.generate.ar.GenerationBatch.empty
    mlx_vlm.generate.ar.GenerationBatch.extend
    mlx_vlm.generate.ar.GenerationBatch.filter
    mlx_vlm.generate.ar.PromptProcessingBatch
    mlx_vlm.generate.ar.PromptProcessingBatch._token_context
    mlx_vlm.models.cache.BatchKVCache
    mlx_vlm.models.cache.KVCache
    mlx_vlm.utils.should_add_special_tokens
    mlx_vlm.prompt_utils.SINGLE_IMAGE_ONLY_MODELS
    mlx_vlm.tokenizer_utils.make_streaming_detokenizer
    <vlm processor>.tokenizer.stopping_criteria.reset
    <vlm processor>.tokenizer.stopping_criteria.eos_token_ids
    <vlm processor>.clean_output
    <vlm model>.get_input_embeddings
    <vlm model>.get_input_embeddings.cached_image_features
    <vlm model>.vision_tower
    <vlm model>.language_model
    <vlm model>.config.text_config
    <vlm model>.language_model.__call__
    <vlm model>.language_model.make_cache
    mlx_vlm.models.base.InputEmbeddingsFeatures
    mlx_vlm.models.base.LanguageModelOutput.logits
    mlx_vlm.models.cache.RotatingKVCache
    mlx_vlm.models.cache.ArraysCache
    mlx_vlm.models.cache.ChunkedKVCache
    mlx_vlm.models.cache.CacheList
    mlx_embeddings.utils.load_model
"""

from __future__ import annotations

import functools
from typing import Any

from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    TokenBuffer,
    _BaseCache,
    dynamic_roll,
    make_prompt_cache,
    trim_prompt_cache,
)

__all__ = [
    "ArraysCache",
    "BatchKVCache",
    "BatchRotatingKVCache",
    "CacheList",
    "RotatingKVCache",
    "TokenBuffer",
    "KVCache",
    "QuantizedKVCache",
    "_BaseCache",
    "create_causal_mask",
    "dynamic_roll",
    "eos_token_ids",
    "has_thinking",
    "make_prompt_cache",
    "new_detokenizer",
    "reset_vlm_stopping",
    "sharded_load",
    "sharding_support",
    "trim_prompt_cache",
    "vlm_blank_features",
    "vlm_clean_output",
    "vlm_embedding_features",
    "vlm_forward",
    "vlm_make_cache",
    "vlm_stop_tokens",
    "vlm_text_embeddings",
    "vlm_image_limit",
    "vlm_input_embeddings",
    "vlm_encode_images",
    "vlm_feature_rows",
    "vlm_language_model",
    "vlm_lm_cache",
    "vlm_prefix_batch_generator",
    "vlm_prefix_cacheable",
    "vlm_prompt_inputs",
    "vlm_rest_kwargs",
    "vlm_text_config",
    "vlm_text_tokens",
    "new_vlm_batch_generator",
    "new_vlm_detokenizer",
    "load_embedding_model",
]


def sharded_load(path: str, *, pipeline: bool) -> tuple[Any, Any, dict[str, Any]]:
    """This rank's shard of a model, its tokenizer and its config, split over the whole
    distributed group (tensor parallel, or pipeline when ``pipeline``)."""
    import mlx.core as mx
    from mlx_lm.utils import sharded_load as load

    group = mx.distributed.init()
    model, tokenizer, config = load(path, pipeline_group=group if pipeline else None,
                                    tensor_group=None if pipeline else group, return_config=True)
    return model, tokenizer, config


def sharding_support(config: dict[str, Any]) -> tuple[bool, bool]:
    """Whether mlx-lm can split this model type (tensor parallel, pipeline), as
    ``sharded_load`` decides it: from a lazily built model, no weights read."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    return hasattr(model, "shard"), hasattr(getattr(model, "model", None), "pipeline")


def eos_token_ids(tokenizer: Any) -> list[int]:
    """Every token id that ends a turn (mlx-lm's wrapper gathers them from the configs)."""
    return list(tokenizer.eos_token_ids)


def new_detokenizer(tokenizer: Any) -> Any:
    """A fresh streaming detokenizer: ``add_token``, ``finalize``, ``last_segment``.

    It keeps the first token's leading space, as the tokens have it: a text completion
    of "The capital of France is" goes on with " Paris" (the chat parser trims the
    edges of an answer itself)."""
    detok = tokenizer.detokenizer
    if hasattr(detok, "trim_space"):  # SentencePiece
        detok.trim_space = False
    elif type(detok).__name__ == "BPEStreamingDetokenizer":
        # It trims while its text is empty: start it non-empty, and past that text.
        detok.text, detok.offset = "\x00", 1
    return detok


def has_thinking(tokenizer: Any) -> bool:
    """Whether mlx-lm knows the model's single-token think markers."""
    return bool(getattr(tokenizer, "has_thinking", False))


def think_markers(tokenizer: Any) -> tuple[str, str] | None:
    """mlx-lm's think markers for the model (``<think>``, ``</think>``), when it knows them."""
    if not has_thinking(tokenizer):
        return None
    start, end = getattr(tokenizer, "think_start", None), getattr(tokenizer, "think_end", None)
    return (start, end) if isinstance(start, str) and isinstance(end, str) else None


def reset_vlm_stopping(processor: Any, model: Any) -> None:
    """Reset mlx-vlm's stopping criteria before a generation, as ``mlx_vlm.generate`` does."""
    tokenizer = getattr(processor, "tokenizer", processor)
    if hasattr(tokenizer, "stopping_criteria"):
        tokenizer.stopping_criteria.reset(model.config.eos_token_id)


def vlm_stop_tokens(processor: Any, model: Any) -> list[int]:
    """Every token id ``mlx_vlm.generate`` stops at: its stopping criteria's ``eos_token_ids``
    after the reset it makes (the config's EOS ids, the tokenizer's, and the processor's
    additional ones, such as Idefics3's ``<end_of_utterance>``)."""
    reset_vlm_stopping(processor, model)
    tokenizer = getattr(processor, "tokenizer", processor)
    criteria = getattr(tokenizer, "stopping_criteria", None)
    if criteria is not None:
        return list(criteria.eos_token_ids)
    eos = model.config.eos_token_id
    return [eos] if isinstance(eos, int) else list(eos or [])


def vlm_clean_output(processor: Any, text: str) -> str:
    """The model's own clean-up of generated text, when it defines one."""
    clean = getattr(processor, "clean_output", None)
    return clean(text) if callable(clean) else text


# ---- mlx-vlm: native VLM chat models (app/engine/models/vlm.py, vlm_engine.py) ----------------


def new_vlm_batch_generator(
    model: Any, processor: Any, *, max_num_seqs: int, prefill_batch_size: int, prefill_step_size: int,
) -> Any:
    """mlx-vlm's BatchGenerator over ``model``'s language model, greedy over the
    logits each row's processors leave (per-request sampling is one of them),
    stopping at the model's EOS tokens. Admission caps running sequences at
    ``max_num_seqs`` outside; the completion batch is sized so that a waiting
    prompt always finds room (mlx-vlm starts prompts only while
    ``completion_batch_size - decoding >= prefill_batch_size``)."""
    import mlx.core as mx
    from mlx_vlm.generate.ar import BatchGenerator as VlmBatchGenerator

    return VlmBatchGenerator(
        vlm_language_model(model),
        processor,
        completion_batch_size=max_num_seqs + prefill_batch_size - 1,
        prefill_batch_size=prefill_batch_size,
        prefill_step_size=prefill_step_size,
        compute_logprobs=False,
        sampler=lambda logprobs: mx.argmax(logprobs, axis=-1),
    )


def vlm_prefix_batch_generator(
    model: Any, processor: Any, *, max_num_seqs: int, prefill_batch_size: int, prefill_step_size: int,
) -> Any:
    """``new_vlm_batch_generator``'s generator, with a way in and out for a row's KV
    (``_vlm_prefix_batch_class``): what the prefix cache of a native VLM needs."""
    import mlx.core as mx

    return _vlm_prefix_batch_class()(
        vlm_language_model(model),
        processor,
        completion_batch_size=max_num_seqs + prefill_batch_size - 1,
        prefill_batch_size=prefill_batch_size,
        prefill_step_size=prefill_step_size,
        compute_logprobs=False,
        sampler=lambda logprobs: mx.argmax(logprobs, axis=-1),
    )


@functools.cache
def _vlm_prefix_batch_class() -> type:
    """mlx-vlm's BatchGenerator with a row's KV in (``insert_row(cache=)``) and out
    (``keep_cache`` then ``take_cache``), made here once on first use (mlx-vlm is
    imported only where a VLM is loaded).

    In: a row that starts from cached KV is prefilled by ``_build_mixed_prompt_batch``,
    the hook mlx-vlm's own prefix cache (APC) uses, reached when the generator takes
    its next prompts: every row of that prefill batch (cold rows with an empty cache)
    gets its KV merged into one ``BatchKVCache`` (left-padded to the longest cached
    prefix), its remaining prompt right-padded to the longest, ``prepare(right_padding=)``
    and, after the last chunk, ``finalize()`` roll each row's padding left: mlx-vlm's
    warm-prefill path, given our caches instead of its block pool. A row prefilled alone
    keeps a plain ``KVCache``, as mlx-vlm's own one-row prefill does (its decode then
    needs no padding mask). Each row's
    ``prompt_kwargs`` hold the embeddings and M-RoPE ``position_ids`` of exactly its
    remaining tokens (sliced from the whole prompt's, so every position is what a full
    prefill gives it) and the whole prompt's ``rope_deltas``, which decode adds to
    each row's cache offset. The logits processors see the whole prompt as context.

    Out: the generation batch is one ``GenerationBatch`` for the generator's life (each
    new prefill's rows are ``extend``-ed into it), whose ``filter`` first copies out the
    KV of every leaving row marked ``keep_cache`` (finished, or removed): mlx-vlm
    gives a finished row's KV to no one, and a removed one's back to no one.
    """
    import mlx.core as mx
    from mlx_vlm.generate.ar import BatchGenerator as VlmBatchGenerator
    from mlx_vlm.generate.ar import GenerationBatch, PromptProcessingBatch
    from mlx_vlm.models.cache import BatchKVCache as VlmBatchKVCache
    from mlx_vlm.models.cache import KVCache as VlmKVCache

    class KeepingGenerationBatch(GenerationBatch):
        keep: set[int]
        kept: dict[int, list[Any]]

        def filter(self, keep: list[int]) -> None:
            staying = set(keep)
            for i, uid in enumerate(self.uids):
                if i not in staying and uid in self.keep:
                    self.keep.discard(uid)
                    rows = [c.extract(i) for c in self.prompt_cache]
                    mx.eval([(r.keys, r.values) for r in rows])
                    self.kept[uid] = rows
            super().filter(keep)

    class PrefixBatchGenerator(VlmBatchGenerator):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # uid -> (the cached prefix's KV, the whole prompt's tokens) until its prefill starts.
            self._warm: dict[int, tuple[list[Any], list[int]]] = {}
            gen = KeepingGenerationBatch.empty(
                self.model, self.sampler, self.tokenizer.stopping_criteria, compute_logprobs=self.compute_logprobs,
                top_logprobs_k=self.top_logprobs_k, greedy_sampling=self.greedy_sampling,
            )
            gen.keep, gen.kept = set(), {}
            self._generation_batch = gen

        def insert_row(self, rest: list[int], *, max_tokens: int, prompt_kwargs: dict[str, Any],
                       logits_processors: list[Any], cache: list[Any] | None = None,
                       prompt: list[int] | None = None) -> int:
            """One prompt: ``rest`` (its tokens after ``cache``'s, all of them without a
            cache); ``prompt``, the whole prompt, with a cache."""
            (uid,) = self.insert([rest], max_tokens=[max_tokens], prompt_kwargs=[prompt_kwargs],
                                 logits_processors=[logits_processors])
            if cache is not None:
                self._warm[uid] = (cache, list(prompt if prompt is not None else rest))
            return uid

        def keep_cache(self, uid: int) -> None:
            """When row ``uid`` leaves the generation batch, keep its KV for ``take_cache``."""
            self._generation_batch.keep.add(uid)

        def take_cache(self, uid: int) -> list[Any] | None:
            """The KV row ``uid`` left with (mlx-vlm ``KVCache`` layers), once; None if none was kept."""
            self._generation_batch.keep.discard(uid)
            return self._generation_batch.kept.pop(uid, None)

        def remove(self, uid: int) -> bool:
            self._warm.pop(uid, None)
            return bool(super().remove(uid))

        def _extend_generation_batch(self, gen_batch: Any) -> None:
            self._generation_batch.extend(gen_batch)  # never replaced: it keeps what leaves

        def _build_mixed_prompt_batch(self, sequences: list[tuple[Any, ...]]) -> Any:
            warm = [self._warm.pop(s[0], None) for s in sequences]
            if all(w is None for w in warm):
                return None  # mlx-vlm's own cold prefill
            rest = [list(s[1]) for s in sequences]
            width = max(len(r) for r in rest)
            embeds, positions, deltas = [], [], []
            for s, r in zip(sequences, rest, strict=True):
                kw, pad = s[3], width - len(r)
                embeds.append(mx.pad(kw["inputs_embeds"], [(0, 0), (0, pad), (0, 0)]))
                pos = kw["position_ids"]
                if pos.ndim == 2:  # text-only prompts: one row of positions for all three sections
                    pos = mx.broadcast_to(pos[None], (3, *pos.shape))
                positions.append(mx.pad(pos, [(0, 0), (0, 0), (0, pad)]))
                deltas.append(kw["rope_deltas"].reshape(1, 1))
            layers = len(self.model.layers)
            rows = [w[0] if w is not None else [VlmKVCache() for _ in range(layers)] for w in warm]
            if len(rows) == 1:  # alone: a plain cache, as mlx-vlm's own one-row prefill has
                return self._warm_batch(sequences, rest, [_vlm_kv(c) for c in rows[0]], mx.concatenate(embeds),
                                        positions, deltas, warm, None)
            merged = [VlmBatchKVCache.merge([row[i] for row in rows]) for i in range(layers)]
            return self._warm_batch(sequences, rest, merged, mx.concatenate(embeds, axis=0), positions, deltas, warm,
                                    [width - len(r) for r in rest])

        def _warm_batch(self, sequences: list[tuple[Any, ...]], rest: list[list[int]], cache: list[Any],
                        embeds: Any, positions: list[Any], deltas: list[Any],
                        warm: list[tuple[list[Any], list[int]] | None], right_pad: list[int] | None) -> Any:
            batch = PromptProcessingBatch(
                model=self.model, uids=[s[0] for s in sequences], input_ids=rest,
                max_tokens=[s[2] for s in sequences], inputs_embeds=embeds,
                prompt_kwargs={"position_ids": mx.concatenate(positions, axis=1),
                               "rope_deltas": mx.concatenate(deltas, axis=0)},
                logits_processors=[s[4] for s in sequences], thinking_budget_criteria=[s[5] for s in sequences],
                prefill_step_size=self.prefill_step_size, warm_cache=cache, right_pad_per_row=right_pad,
                suffix_lens=[len(r) for r in rest] if right_pad is not None else None,
                greedy_sampling=self.greedy_sampling,
            )
            if batch._token_context:  # the processors see the whole prompt, as after a full prefill
                batch._token_context = [list(w[1]) if w is not None else r for w, r in zip(warm, rest, strict=True)]
            return batch

    def _vlm_kv(c: Any) -> Any:
        """A cached layer (mlx-lm ``KVCache``) as mlx-vlm's own single-row ``KVCache``."""
        out = VlmKVCache()
        out.keys, out.values, out.offset = c.keys[..., : c.offset, :], c.values[..., : c.offset, :], c.offset
        return out

    return PrefixBatchGenerator


def vlm_lm_cache(rows: list[Any]) -> list[KVCache]:
    """A row's KV from the VLM generator (mlx-vlm ``KVCache`` layers) as mlx-lm ``KVCache``
    layers: what the prefix cache and its disk tier hold. The arrays are shared."""
    out = []
    for r in rows:
        c = KVCache()
        c.keys, c.values, c.offset = r.keys[..., : r.offset, :], r.values[..., : r.offset, :], r.offset
        out.append(c)
    return out


def vlm_prompt_inputs(model: Any, processor: Any, prompt_text: str, images: list[Any]) -> dict[str, Any]:
    """The processor's inputs for one prompt (``input_ids`` with every image
    placeholder expanded to the image's tokens, ``pixel_values``, ``attention_mask``
    and model extras such as ``image_grid_thw``), tokenized as mlx-vlm's own
    ``generate`` does."""
    from mlx_vlm import prepare_inputs
    from mlx_vlm.utils import should_add_special_tokens

    return dict(
        prepare_inputs(
            processor,
            images=images or None,
            prompts=[prompt_text],
            image_token_index=getattr(model.config, "image_token_index", None),
            add_special_tokens=should_add_special_tokens(model.config.model_type, processor),
        )
    )


def vlm_text_tokens(model: Any, processor: Any, text: str) -> list[int]:
    """A prompt without images tokenized as ``vlm_prompt_inputs`` tokenizes it (mlx-vlm's
    text-only path), with the tokenizer alone: no MLX arrays, fit for any thread."""
    from mlx_vlm.utils import should_add_special_tokens

    tokenizer = getattr(processor, "tokenizer", processor)
    add = should_add_special_tokens(model.config.model_type, processor)
    return list(tokenizer(text, add_special_tokens=add)["input_ids"])


def vlm_input_embeddings(model: Any, inputs: dict[str, Any], image_features: Any = None) -> dict[str, Any]:
    """The ``prompt_kwargs`` BatchGenerator.insert takes for one prompt: its
    embeddings with the image features merged in, and the model's position extras,
    as mlx-vlm's own server builds them. The vision tower runs here unless
    ``image_features`` (``vlm_encode_images``' rows for every image, in order) are given."""
    extras = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    return {**extras, **vlm_embedding_features(model, inputs, image_features)}


def vlm_embedding_features(model: Any, inputs: dict[str, Any], image_features: Any = None) -> dict[str, Any]:
    """What ``get_input_embeddings`` gives for one prompt (its processor's ``inputs``): the
    fields of mlx-vlm's ``InputEmbeddingsFeatures`` that are set. ``inputs_embeds`` (1, L,
    hidden), the image features merged in, and the model's extras: ``position_ids`` (3, 1, L)
    and ``rope_deltas`` (1, 1) for M-RoPE (a text-only prompt: (1, L) and zeros),
    ``visual_pos_masks`` (1, L) and ``deepstack_visual_embeds`` (one (image tokens, hidden)
    array per layer) for Qwen3-VL, ``attention_mask_4d`` for Gemma 3. The vision tower runs
    here unless ``image_features`` (``vlm_encode_images``' rows for every image) are given."""
    extras = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
    cached = {"cached_image_features": image_features} if image_features is not None else {}
    features = model.get_input_embeddings(
        inputs["input_ids"], inputs.get("pixel_values"), mask=inputs.get("attention_mask"), **extras, **cached
    )
    return {k: v for k, v in features.to_dict().items() if v is not None}


def vlm_text_embeddings(model: Any, tokens: Any) -> Any:
    """The model's own embeddings of token ids (B, L) with no image: (B, L, hidden), as
    ``get_input_embeddings`` gives a text-only prompt. The language model given these as
    ``inputs_embeds`` computes what it computes from the ids themselves."""
    return model.get_input_embeddings(tokens, None).inputs_embeds


def vlm_forward(model: Any, tokens: Any, cache: list[Any], **features: Any) -> Any:
    """One pass of the language model (``model.language_model``) over ``tokens`` (B, L) and
    the batch caches, with ``features`` (``inputs_embeds``, ``position_ids``, ...) as mlx-vlm's
    own generators pass them: the logits (B, L, vocab) of its ``LanguageModelOutput``."""
    out = model.language_model(tokens, cache=cache, **features)
    return out.logits if hasattr(out, "logits") else out


def vlm_make_cache(model: Any) -> list[Any]:
    """A fresh cache for one sequence of the VLM's language model, one per layer, as
    mlx-lm's classes (what Tandem's decode step, its batch caches, snapshots and KV files
    know): the language model's own ``make_cache()`` translated kind by kind (mlx-vlm keeps
    its own copies of mlx-lm's cache classes, with the same fields), or a ``KVCache`` per
    layer where it has none (mlx-lm's ``make_prompt_cache`` rule). ``ConfigError`` for a
    kind mlx-lm has no class for."""
    from app.errors import ConfigError

    lm = vlm_language_model(model)
    if not hasattr(lm, "make_cache"):
        return [KVCache() for _ in lm.layers]
    out = []
    for layer in lm.make_cache():
        cache = _mlx_lm_cache(layer)
        if cache is None:
            raise ConfigError(f"the language model keeps a {type(layer).__name__} cache, which mlx-lm has no class for")
        out.append(cache)
    return out


def _mlx_lm_cache(layer: Any) -> Any:
    """mlx-lm's fresh cache of the same kind and settings as mlx-vlm's ``layer``; None if none."""
    from mlx_lm.models.cache import ChunkedKVCache
    from mlx_vlm.models import cache as vc

    if isinstance(layer, vc.CacheList):
        parts = [_mlx_lm_cache(c) for c in layer.caches]
        return None if any(p is None for p in parts) else CacheList(*parts)
    if isinstance(layer, vc.RotatingKVCache):
        return RotatingKVCache(max_size=layer.max_size, keep=layer.keep)
    if isinstance(layer, vc.ChunkedKVCache):
        return ChunkedKVCache(layer.chunk_size)
    if isinstance(layer, vc.ArraysCache):
        return ArraysCache(len(layer.cache))
    if type(layer) is vc.KVCache:
        return KVCache()
    return None


# Model types whose get_input_embeddings takes ``cached_image_features`` and whose vision
# tower maps (pixel_values, grid_thw) to one row per image token (read from mlx-vlm 0.7.x).
_FEATURE_CACHE_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl"})


def vlm_feature_rows(model: Any, inputs: dict[str, Any]) -> list[tuple[int, int]] | None:
    """For a model whose image features can be cached image by image: each image's rows
    in ``inputs["pixel_values"]`` as (start, count), in prompt order. None otherwise."""
    if model.config.model_type not in _FEATURE_CACHE_MODEL_TYPES or inputs.get("image_grid_thw") is None:
        return None
    rows, start = [], 0
    for t, h, w in inputs["image_grid_thw"].tolist():
        rows.append((start, t * h * w))
        start += t * h * w
    return rows


def vlm_encode_images(model: Any, pixel_values: Any, grid_thw: Any) -> Any:
    """The vision tower on some images' patches (rows of ``pixel_values``, one
    ``grid_thw`` row each): their features, one row per image token, image after image."""
    dtype = model.vision_tower.patch_embed.proj.weight.dtype
    return model.vision_tower(pixel_values.astype(dtype), grid_thw, output_hidden_states=False)


def vlm_prefix_cacheable(model: Any) -> bool:
    """Whether a row of this model can start from cached KV (``vlm_prefix_batch_generator``):
    its embeddings come with explicit M-RoPE ``position_ids`` and ``rope_deltas``, and its
    image features can be left out image by image (Qwen2-VL, Qwen2.5-VL)."""
    return model.config.model_type in _FEATURE_CACHE_MODEL_TYPES


def vlm_blank_features(model: Any, rows: int) -> Any:
    """Zero features for an image whose KV comes from the prefix cache: its rows of the
    embeddings are never prefilled, only their count and dtype matter."""
    import mlx.core as mx

    hidden = int(vlm_text_config(model)["hidden_size"])
    return mx.zeros((rows, hidden), dtype=model.vision_tower.patch_embed.proj.weight.dtype)


def vlm_rest_kwargs(kwargs: dict[str, Any], start: int) -> dict[str, Any]:
    """The ``prompt_kwargs`` of a prompt's tokens from ``start`` on, for a row whose first
    ``start`` tokens' KV is cached: the whole prompt's embeddings and M-RoPE positions
    sliced (each position what a full prefill gives it), its ``rope_deltas`` as they are."""
    return {"inputs_embeds": kwargs["inputs_embeds"][:, start:], "position_ids": kwargs["position_ids"][..., start:],
            "rope_deltas": kwargs["rope_deltas"]}


def vlm_language_model(model: Any) -> Any:
    """The text half of an mlx-vlm model (what BatchGenerator runs and KV is sized for)."""
    return model.language_model


def vlm_text_config(model: Any) -> dict[str, Any]:
    """The language model's config fields (layers, heads, vocab, context length)."""
    return dict(vars(model.config.text_config))


def vlm_image_limit(model: Any) -> int | None:
    """The most images the model takes in one prompt, when mlx-vlm knows a limit."""
    from mlx_vlm.prompt_utils import SINGLE_IMAGE_ONLY_MODELS

    return 1 if model.config.model_type in SINGLE_IMAGE_ONLY_MODELS else None


def new_vlm_detokenizer(processor: Any) -> Any:
    """A fresh streaming detokenizer of the processor's, one per sequence."""
    from mlx_vlm.tokenizer_utils import make_streaming_detokenizer

    return make_streaming_detokenizer(processor)


def load_embedding_model(path: Any, model_config: dict[str, Any]) -> Any:
    """mlx-embeddings' model at ``path``, ``model_config`` overriding its config.json."""
    from mlx_embeddings.utils import load_model  # imported on use: only embedding entries need it

    return load_model(path, model_config=model_config)
