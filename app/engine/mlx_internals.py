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
    "vlm_encode_images",
    "vlm_feature_rows",
    "vlm_language_model",
    "vlm_prompt_inputs",
    "vlm_text_config",
    "vlm_text_tokens",
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


# ---- mlx-vlm: native VLM chat models (app/engine/models/vlm.py, vlm_forward.py) ---------------


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


def vlm_blank_features(model: Any, rows: int) -> Any:
    """Zero features for an image whose KV comes from the prefix cache: its rows of the
    embeddings are never prefilled, only their count and dtype matter."""
    import mlx.core as mx

    hidden = int(vlm_text_config(model)["hidden_size"])
    return mx.zeros((rows, hidden), dtype=model.vision_tower.patch_embed.proj.weight.dtype)


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
