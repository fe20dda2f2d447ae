"""models.yaml entries -> the engine's frozen parameter types.

The one place where the pydantic schema (``app.config.schema``) meets the engine's own
dataclasses (``app/engine/params.py``), above both: config and the engine sit side by
side and never import each other (the engine never sees pydantic, config never sees MLX). The
dataclasses have no defaults for what models.yaml sets, so every value comes from
the schema, defaults included; code and tests that need engine params build them
here (``engine_params(ChatParams(mem=64))``).
"""

from __future__ import annotations

from app.config.schema import ChatEntry, ChatParams, EncoderParams, ModelEntry, VisionEntry, VisionParams
from app.engine.params import (
    EncoderLimits,
    EncoderSpec,
    EngineParams,
    LoadParams,
    ModelSource,
    ModelSpec,
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
    )


def vision_engine_params(p: VisionParams) -> EngineParams:
    """A captioning VLM is scheduled as a chat model is, without a prefix cache (a caption is
    never continued); what its entry leaves unset takes the chat default."""
    return engine_params(ChatParams(**p.model_dump(exclude_unset=True, exclude={"mem"}), mem=p.mem,
                                    prompt_cache="off"))


def encoder_limits(p: EncoderParams) -> EncoderLimits:
    """How an embedding or rerank model batches."""
    return EncoderLimits(max_batch=p.max_batch, max_batch_tokens=p.max_batch_tokens, max_inputs=p.max_inputs,
                         max_length=p.max_model_len, max_jobs=p.max_jobs, max_step_ms=p.max_step_ms)


def model_spec(entry: ModelEntry, file_idle_unload_secs: int | None) -> ModelSpec:
    """A served entry (chat, vision, embedding or rerank) as the registry takes it."""
    idle = entry.idle_unload_secs if entry.idle_unload_secs is not None else file_idle_unload_secs
    p = entry.params
    chat = entry if isinstance(entry, ChatEntry) else None
    vision = entry if isinstance(entry, VisionEntry) else None
    vlm = vision is not None or (chat is not None and chat.capabilities.vision_mode == "native")
    return ModelSpec(
        name=entry.name, role=entry.role, source=model_source(entry), aliases=(entry.hf_id,) if entry.hf_id else (),
        preload=entry.preload, pin=entry.pin, idle_unload_s=float(idle) if idle else None,
        max_queue=p.max_queue, queue_timeout_s=p.queue_timeout_s,
        load=load_params(p) if isinstance(p, ChatParams | VisionParams) else None,
        engine=engine_params(p) if isinstance(p, ChatParams) else vision_engine_params(p) if isinstance(p, VisionParams)
        else None,
        vision=VisionSpec(p.max_pixels, p.min_pixels, p.max_images_per_request, p.vision_feature_cache_mb * 2**20)
        if vlm and isinstance(p, ChatParams | VisionParams) else None,
        encoder=EncoderSpec(p.dtype, encoder_limits(p)) if isinstance(p, EncoderParams) else None,
    )
