"""The engine's own frozen parameters, and every knob it has.

``app.config.mapping`` builds these from a models.yaml entry (pydantic, validated
there); the engine never sees pydantic. Each knob has its default here, once,
with a comment saying what it trades.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

PromptCacheMode = Literal["off", "system", "first_message", "prefix"]


@dataclass(frozen=True)
class LoadParams:
    """How a model's weights are loaded."""

    # Weight dtype for unquantized floating-point weights; None keeps the checkpoint's.
    dtype: Literal["float16", "bfloat16", "float32"] | None = None
    # Quantize at load ("q4" / "q8"); weights already quantized load as they are.
    quantization: Literal["q4", "q8"] | None = None
    # Group size for `quantization`.
    quantization_group_size: int = 64
    # Context length; None takes the model config's max_position_embeddings (never more).
    max_model_len: int | None = None
    # Quantized KV cache (4 / 8 bits per element); None keeps the activation dtype.
    kv_cache_bits: Literal[4, 8] | None = None
    # How the model is split over the ranks of a distributed launch (mlx.launch): "tensor", every
    # rank holds a slice of every layer (decoding gets faster); "pipeline", each rank holds a run
    # of layers (only a bigger model fits). Ignored in one process.
    distributed: Literal["tensor", "pipeline"] = "tensor"


@dataclass(frozen=True)
class EngineParams:
    """How one loaded chat model is scheduled: memory, batching, queueing, caching."""

    # KV-cache budget in MB; admission and the prefix cache both live inside it.
    kv_mem_mb: int = 1024
    # Sequences decoded together (BatchGenerator's completion batch size).
    max_num_seqs: int = 8
    # Largest prompt slice one step prefills, so running streams keep moving.
    prefill_chunk_size: int = 512
    # Prompts prefilled together in one step (BatchGenerator's prefill batch size);
    # capped at max_num_seqs. More pads short prompts to long ones' lengths.
    prefill_batch_size: int = 8
    # Requests waiting for the engine (admission queue and not-yet-drained inbox); one more is a 429.
    max_queue: int = 64
    # Seconds a request may wait for admission before a 503.
    queue_timeout_s: float = 120.0
    # A waiting request older than this stops smaller ones from passing it (backfill).
    starvation_s: float = 5.0
    # Which prompt prefixes keep their KV for later requests.
    prompt_cache: PromptCacheMode = "prefix"
    # Prefixes shorter than this many tokens are not worth caching.
    cache_min_tokens: int = 64
    # MB of kv_mem_mb the prefix cache may hold; None takes prompt_cache_share of it.
    prompt_cache_mb: int | None = None
    # The prefix cache's share of kv_mem_mb when prompt_cache_mb is not set.
    prompt_cache_share: float = 0.25
    # Most prefixes the prefix cache holds, whatever their size (LRU beyond).
    prompt_cache_entries: int = 256
    # MB of disk the prefix cache's disk tier may hold for this model (LRU beyond); 0 turns it off.
    # Prefixes cached in memory are also written there, so they survive restarts and unloads.
    prompt_cache_disk_mb: int = 4096
    # Where the disk tier lives; None: $TANDEM_PROMPT_CACHE_DIR, else <cache dir>/prompt-cache.
    prompt_cache_disk_dir: str | None = None
    # MB of KV the disk writer may have queued (one entry is always taken, whatever its size);
    # beyond it a write is dropped, never waited for. Queued KV is held, not copied.
    prompt_cache_disk_queue_mb: int = 1024
    # Background work (priority "background": titles, tags, follow-ups) may hold at most this
    # share of max_num_seqs while interactive work waits for its first token; the rest is paused.
    background_share: float = 0.25
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
class EncoderSpec:
    """How an embedding or rerank model batches (app.engine.encoder.EncoderLimits)."""

    max_batch: int = 32
    max_batch_tokens: int = 4096
    max_inputs: int = 2048
    max_length: int | None = None


@dataclass(frozen=True)
class VisionSpec:
    """A native VLM's image limits (``vision_mode: native``)."""

    max_pixels: int = 448 * 448
    min_pixels: int = 28 * 28
    max_images: int = 8


@dataclass(frozen=True)
class ModelSpec:
    """One served model, from its models.yaml entry."""

    name: str
    role: str  # chat | embedding | rerank | vision (a VLM that captions for proxy-mode chat models)
    source: ModelSource
    load: LoadParams = LoadParams()
    engine: EngineParams = EngineParams()
    encoder: EncoderSpec = EncoderSpec()
    # Set for a VLM served by mlx-vlm: a native chat model, or a vision entry.
    vision: VisionSpec | None = None
    aliases: tuple[str, ...] = ()
    preload: bool = False
    pin: bool = False
    # Seconds unused before it is unloaded; None: never (unless memory is needed).
    idle_unload_s: float | None = None

    @property
    def kv_budget_bytes(self) -> int:
        return self.engine.kv_mem_mb * 2**20 if self.role in ("chat", "vision") else 0
