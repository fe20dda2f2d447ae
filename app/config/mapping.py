"""models.yaml entries -> the engine's frozen parameter types.

The one place where the pydantic schema (``schema``) meets the engine's own
dataclasses (``app/engine/params.py``): the engine never imports pydantic.
"""

from __future__ import annotations

from app.config.schema import ModelEntry, ModelParams
from app.engine.params import EncoderSpec, EngineParams, LoadParams, ModelSource, ModelSpec, VisionSpec


def model_source(entry: ModelEntry) -> ModelSource:
    """Where an entry's weights come from."""
    return ModelSource(entry.name, builtin=entry.builtin, local_path=entry.local_path,
                       weight_file=entry.weight_file, hf_id=entry.hf_id)


def load_params(p: ModelParams) -> LoadParams:
    """How the weights are loaded."""
    return LoadParams(dtype=p.dtype, quantization=p.quantization, quantization_group_size=p.quantization_group_size,
                      max_model_len=p.max_model_len, kv_cache_bits=p.kv_cache_bits, distributed=p.distributed)


def engine_params(p: ModelParams) -> EngineParams:
    """How a loaded chat model is scheduled."""
    return EngineParams(
        kv_mem_mb=p.kv_mem_mb,
        max_num_seqs=p.max_num_seqs,
        prefill_chunk_size=p.prefill_chunk_size,
        prefill_batch_size=min(p.prefill_batch_size, p.max_num_seqs),
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


def model_spec(entry: ModelEntry, file_idle_unload_secs: int | None) -> ModelSpec:
    """A served entry as the registry takes it."""
    idle = entry.idle_unload_secs if entry.idle_unload_secs is not None else file_idle_unload_secs
    p = entry.params
    return ModelSpec(
        name=entry.name, role=entry.role, source=model_source(entry), load=load_params(p),
        engine=engine_params(p),
        encoder=EncoderSpec(max_batch=p.max_batch, max_batch_tokens=p.max_batch_tokens, max_inputs=p.max_inputs,
                            max_length=p.max_model_len),
        vision=VisionSpec(p.max_pixels, p.min_pixels, p.max_images_per_request)
        if entry.role == "vision" or entry.capabilities.vision_mode == "native" else None,
        aliases=(entry.hf_id,) if entry.hf_id else (), preload=entry.preload, pin=entry.pin,
        idle_unload_s=float(idle) if idle else None,
    )
