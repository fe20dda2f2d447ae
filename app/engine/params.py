"""The engine's own frozen parameters, and every knob it has.

``app.specs`` builds these from a models.yaml entry (pydantic, validated
there); the engine never sees pydantic. A knob that models.yaml sets has no default
here: its one default and description are on the schema's field of the same name
(``app/config/schema.py``; renamed ones say so). Knobs with a default here are the
engine's own, not configurable. The value types models.yaml offers (``Dtype``,
``PromptCacheMode``, ...) are defined here, once, and the schema uses them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from app.kinds import Distributed, Dtype, KVBits, PromptCacheMode, Quantization


@dataclass(frozen=True)
class LoadParams:
    """How a chat model's weights are loaded (schema: ``ChatParams``)."""

    dtype: Dtype | None
    quantization: Quantization | None
    quantization_group_size: int
    max_model_len: int | None
    kv_cache_bits: KVBits | None
    distributed: Distributed


@dataclass(frozen=True)
class SpeculativeParams:
    """Speculative decoding for one chat model (``app.engine.speculative``; schema: ``SpeculativeConfig``)."""

    # Propose n-gram continuations found in the prompt and the output so far.
    prompt_lookup: bool
    # Another chat entry of models.yaml that drafts for this one (None: no draft model).
    draft: str | None
    # The most tokens a row proposes per step (the adaptive rule picks fewer when they do not pay).
    tokens: int


@dataclass(frozen=True)
class EngineParams:
    """How one loaded chat model is scheduled: memory, batching, queueing, caching."""

    kv_mem_mb: int  # schema: mem (or kvcache_mem_gpu + kvcache_mem_cpu)
    max_num_seqs: int
    prefill_chunk_size: int
    prefill_batch_size: int  # never more than max_num_seqs
    prefill_step_ms: int
    max_queue: int
    queue_timeout_s: float
    prompt_cache: PromptCacheMode
    cache_min_tokens: int
    prompt_cache_mb: int | None  # schema: prompt_cache_mem
    prompt_cache_entries: int
    prompt_cache_disk_mb: int
    prompt_cache_disk_dir: str | None
    background_share: float
    prompt_cache_key_share: float
    prompt_cache_pin_share: float
    # Speculative decoding (models.yaml ``speculative``).
    speculative: SpeculativeParams
    # The engine's own knobs:
    # A waiting request older than this stops smaller ones from passing it (backfill).
    starvation_s: float = 5.0
    # The prefix cache's share of kv_mem_mb when prompt_cache_mb is not set.
    prompt_cache_share: float = 0.25
    # MB of KV the disk writer may have queued (one entry is always taken, whatever its size);
    # beyond it a write is dropped, never waited for. Queued KV is held, not copied.
    prompt_cache_disk_queue_mb: int = 1024
    # Deltas one stream may have pending before new text is merged into the last one
    # (a slow client never makes the engine thread wait).
    channel_max_pending: int = 32

    @property
    def prompt_cache_disk_bytes(self) -> int:
        """The disk tier's byte budget (0: no disk tier)."""
        return 0 if self.prompt_cache == "off" else self.prompt_cache_disk_mb * 1024 * 1024

    @property
    def prompt_cache_bytes(self) -> int:
        """The prefix cache's byte cap inside the KV budget."""
        mb = self.prompt_cache_mb if self.prompt_cache_mb is not None else self.kv_mem_mb * self.prompt_cache_share
        return int(mb * 1024 * 1024)

    def to_log_string(self) -> str:
        """One line with every value, for the start-up log."""
        return " ".join(f"{k}={v}" for k, v in asdict(self).items())


@dataclass(frozen=True)
class ModelSource:
    """Where a model's weights come from; the first that is set wins, in this order."""

    name: str
    # A model shipped inside an installed package, prepared offline into the cache.
    builtin: str | None = None
    # A local mlx-lm / mlx-vlm model directory.
    local_path: str | None = None
    # A llama-architecture GGUF file, converted once into the cache.
    weight_file: str | None = None
    # A Hugging Face repo id (needs the hub or its local cache).
    hf_id: str | None = None


@dataclass(frozen=True)
class EncoderLimits:
    """Batching and request limits of an embedding or rerank model (schema: ``EncoderParams``)."""

    max_batch: int
    max_batch_tokens: int
    max_inputs: int
    max_length: int | None  # schema: max_model_len; None: the model's own limit
    max_jobs: int
    max_step_ms: int
    # Inputs longer than max_length are cut to it unless a request says otherwise (else refused).
    truncate: bool


@dataclass(frozen=True)
class EncoderSpec:
    """How an embedding or rerank model is loaded and batched."""

    dtype: Dtype | None
    limits: EncoderLimits


@dataclass(frozen=True)
class VisionSpec:
    """A native VLM's image limits (``vision_mode: native``; schema: ``ChatParams``)."""

    max_pixels: int
    min_pixels: int
    max_images: int  # schema: max_images_per_request
    feature_cache_bytes: int  # schema: vision_feature_cache_mb (in bytes)


@dataclass(frozen=True)
class ModelSpec:
    """One served model, from its models.yaml entry (``app.specs.model_spec``)."""

    name: str
    role: str  # chat | embedding | rerank | vision (a VLM that captions for proxy-mode chat models)
    source: ModelSource
    aliases: tuple[str, ...]
    preload: bool
    pin: bool
    # Seconds unused before it is unloaded; None: never (unless memory is needed).
    idle_unload_s: float | None
    # Requests that may wait for the model to load, and for how long (any role).
    max_queue: int
    queue_timeout_s: float
    # A chat or vision model's; None for the encoders.
    load: LoadParams | None = None
    engine: EngineParams | None = None
    # Set for a VLM served by mlx-vlm: a native chat model, or a vision entry.
    vision: VisionSpec | None = None
    # An embedding or rerank model's; None for chat.
    encoder: EncoderSpec | None = None

    @property
    def kv_budget_bytes(self) -> int:
        return self.engine.kv_mem_mb * 2**20 if self.engine is not None else 0
