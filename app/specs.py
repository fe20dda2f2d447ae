"""models.yaml entries -> the engine's frozen parameter types.

The one place where the pydantic schema (``app.config.schema``) meets the engine's own
dataclasses (``app/engine/params.py``), above both: config and the engine sit side by
side and never import each other (the engine never sees pydantic, config never sees MLX). The
dataclasses have no defaults for what models.yaml sets, so every value comes from
the schema, defaults included; code and tests that need engine params build them
here (``engine_params(ChatParams(mem=64))``).
"""

from __future__ import annotations

from dataclasses import replace

from app.config.schema import ChatEntry, ChatParams, EncoderParams, ModelEntry, VisionParams
from app.engine import (
    EncoderLimits,
    EncoderSpec,
    EngineParams,
    LoadParams,
    ModelSource,
    ModelSpec,
    SpeculativeParams,
    VisionSpec,
)


def model_source(entry: ModelEntry) -> ModelSource:
    """Where an entry's weights come from."""
    return ModelSource(entry.name, builtin=entry.builtin, local_path=entry.local_path,
                       weight_file=entry.weight_file, hf_id=entry.hf_id)


def load_params(p: ChatParams | VisionParams) -> LoadParams:
    """How a chat (or captioning) model's weights are loaded."""
    return LoadParams(dtype=p.dtype, quantization=p.quantization, quantization_group_size=p.quantization_group_size,
                      max_model_len=p.max_model_len, kv_cache_bits=p.kv_cache_bits, distributed=p.distributed)


def engine_params(p: ChatParams) -> EngineParams:
    """How a loaded chat model is scheduled."""
    return EngineParams(
        kv_mem_mb=p.kv_mem_mb,
        max_num_seqs=p.max_num_seqs,
        prefill_chunk_size=p.prefill_chunk_size,
        prefill_batch_size=min(p.prefill_batch_size, p.max_num_seqs),
        prefill_step_ms=p.prefill_step_ms,
        max_queue=p.max_queue,
        queue_timeout_s=p.queue_timeout_s,
        prompt_cache=p.prompt_cache,
        cache_min_tokens=p.cache_min_tokens,
        prompt_cache_mb=p.prompt_cache_mem,
        prompt_cache_entries=p.prompt_cache_entries,
        prompt_cache_disk_mb=p.prompt_cache_disk_mb,
        prompt_cache_disk_dir=p.prompt_cache_disk_dir,
        background_share=p.background_share,
        prompt_cache_key_share=p.prompt_cache_key_share,
        prompt_cache_pin_share=p.prompt_cache_pin_share,
        speculative=SpeculativeParams(prompt_lookup=p.speculative.prompt_lookup, draft=p.speculative.draft,
                                      tokens=p.speculative.tokens),
    )


def vision_engine_params(p: VisionParams) -> EngineParams:
    """A captioning VLM is scheduled as a chat model is, without a prefix cache (a caption is
    never continued); what its entry leaves unset takes the chat default."""
    return engine_params(ChatParams(**p.model_dump(exclude_unset=True, exclude={"mem"}), mem=p.mem,
                                    prompt_cache="off"))


def encoder_limits(p: EncoderParams) -> EncoderLimits:
    """How an embedding or rerank model batches."""
    return EncoderLimits(max_batch=p.max_batch, max_batch_tokens=p.max_batch_tokens, max_inputs=p.max_inputs,
                         max_length=p.max_model_len, max_jobs=p.max_jobs, max_step_ms=p.max_step_ms,
                         truncate=p.truncate)


def model_spec(entry: ModelEntry, file_idle_unload_secs: int | None) -> ModelSpec:
    """A served entry, of any role, as the registry takes it. What the engine gets follows the
    entry's params model, not its role, so a new role that reuses a params model maps here
    unchanged."""
    p = entry.params
    if not isinstance(p, ChatParams | VisionParams | EncoderParams):
        raise TypeError(f"model {entry.name!r}: no engine spec for {type(p).__name__}")
    idle = entry.idle_unload_secs if entry.idle_unload_secs is not None else file_idle_unload_secs
    spec = ModelSpec(name=entry.name, role=entry.role, source=model_source(entry),
                     aliases=(entry.hf_id,) if entry.hf_id else (), preload=entry.preload, pin=entry.pin,
                     idle_unload_s=float(idle) if idle else None, max_queue=p.max_queue,
                     queue_timeout_s=p.queue_timeout_s)
    match p:
        case ChatParams():  # served by mlx-lm, or by mlx-vlm as a native VLM
            native = isinstance(entry, ChatEntry) and entry.capabilities.vision_mode == "native"
            return replace(spec, load=load_params(p), engine=engine_params(p),
                           vision=vision_spec(p) if native else None)
        case VisionParams():  # a VLM that captions
            return replace(spec, load=load_params(p), engine=vision_engine_params(p), vision=vision_spec(p))
        case EncoderParams():
            return replace(spec, encoder=EncoderSpec(p.dtype, encoder_limits(p)))


def vision_spec(p: ChatParams | VisionParams) -> VisionSpec:
    """A VLM's image bounds."""
    return VisionSpec(p.max_pixels, p.min_pixels, p.max_images_per_request, p.vision_feature_cache_mb * 2**20)
