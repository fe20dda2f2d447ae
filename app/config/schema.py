"""The models.yaml schema.

Everything engine-related for a model lives in its entry: where the weights
come from, how they are loaded, how much KV-cache memory it may use, how many
sequences run at once, default sampling and capabilities. Command-line flags
override a model's ``params``; ``mapping`` resolves both into the engine's frozen
``LoadParams`` and ``EngineParams`` (``app/engine/params.py``), logged once at start-up.

Every model is ``extra="forbid"``: a typo in models.yaml stops start-up with a
message naming the file, the key and the allowed values (see ``loader``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

Dtype = Literal["float16", "bfloat16", "float32"]
VisionMode = Literal["disabled", "proxy", "native"]
PromptCacheMode = Literal["off", "system", "first_message", "prefix"]
BUILTIN_MODELS = ("smollm2-135m-instruct", "all-minilm-l6-v2")
Role = Literal["chat", "vision", "embedding", "rerank"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelParams(_Strict):
    """A model entry's ``params``: how it is loaded and run. ``app.config.mapping`` turns it
    into the engine's frozen ``LoadParams`` / ``EngineParams``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Weight dtype for unquantized weights; None keeps the checkpoint's dtype.
    dtype: Dtype | None = None
    # Quantize at load ("q4" / "q8", also --isq). Already-quantized weights load as they are.
    quantization: Literal["q4", "q8"] | None = None
    # Quantization group size used with `quantization`.
    quantization_group_size: Literal[32, 64, 128] = 64
    # KV-cache memory budget in MB: admission and the prefix cache both live inside it.
    mem: int = Field(default=1024, ge=16)
    # Accepted for candle-vllm compatibility; on unified memory they add up to `mem` when set.
    kvcache_mem_gpu: int | None = Field(default=None, ge=0)
    kvcache_mem_cpu: int | None = Field(default=None, ge=0)
    # Quantized KV cache (4 or 8 bits) lowers the bytes per token; None keeps the model dtype.
    kv_cache_bits: Literal[4, 8] | None = None
    # Under mlx.launch (several ranks): "tensor" splits every layer over the ranks (faster
    # decoding), "pipeline" gives each rank a run of layers (a bigger model fits; mlx-lm supports it
    # for a few model types). Ignored in one process. Also --distributed.
    distributed: Literal["tensor", "pipeline"] = "tensor"
    # Sequences decoded together by the batch generator.
    max_num_seqs: int = Field(default=8, ge=1, le=256)
    # Largest prompt slice processed in one step, so decoding streams keep moving.
    prefill_chunk_size: int = Field(default=512, ge=16)
    # Prompts prefilled together in one step (capped at max_num_seqs).
    prefill_batch_size: int = Field(default=8, ge=1, le=256)
    # Context length; None takes the model config's max_position_embeddings.
    max_model_len: int | None = Field(default=None, ge=64)
    # Requests waiting for KV budget; one more gets 429 with Retry-After.
    max_queue: int = Field(default=64, ge=0)
    # Seconds a request may wait for admission before a 503.
    queue_timeout_s: float = Field(default=120.0, gt=0)
    # Which prompt prefixes keep their KV cache for later requests.
    prompt_cache: PromptCacheMode = "prefix"
    # Prefixes shorter than this many tokens are not worth caching.
    cache_min_tokens: int = Field(default=64, ge=1)
    # MB of `mem` the prefix cache may hold (None: a quarter of `mem`); evicted LRU beyond it.
    prompt_cache_mem: int | None = Field(default=None, ge=0)
    # Most prefixes the prefix cache holds, whatever their size.
    prompt_cache_entries: int = Field(default=256, ge=1)
    # MB of disk for this model's prefixes (the disk tier, LRU-evicted beyond it); 0 turns it off.
    prompt_cache_disk_mb: int = Field(default=4096, ge=0)
    # The disk tier's directory; None: $TANDEM_PROMPT_CACHE_DIR, else <cache dir>/prompt-cache.
    prompt_cache_disk_dir: str | None = None
    # Share of max_num_seqs background requests (priority "background", Open WebUI's
    # "### Task:" prompts) may hold while interactive requests wait for their first token.
    background_share: float = Field(default=0.25, ge=0.0, le=1.0)

    # Default sampling; each request may override these.
    temperature: float = Field(default=0.7, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    # 0 disables top-k.
    top_k: int = Field(default=0, ge=0)
    # 0 disables min-p.
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # 1.0 disables the repetition penalty.
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=3.0)
    # Completion length when a request names none.
    max_tokens: int = Field(default=512, ge=1)

    # Vision models only: pixel bounds the image is resized into before the VLM.
    max_pixels: int = Field(default=448 * 448, ge=28 * 28)
    min_pixels: int = Field(default=28 * 28, ge=1)
    # Vision models only: images one request may carry.
    max_images_per_request: int = Field(default=8, ge=1)

    # Embedding and rerank models only: inputs encoded together, padded tokens in one batch (one
    # engine step: this bounds how long chat decoding waits), and inputs one request may carry.
    max_batch: int = Field(default=32, ge=1)
    max_batch_tokens: int = Field(default=4096, ge=16)
    max_inputs: int = Field(default=2048, ge=1)

    @property
    def kv_mem_mb(self) -> int:
        """The KV budget: `mem`, or the gpu+cpu split when only that is given."""
        if "mem" not in self.model_fields_set and (
            self.kvcache_mem_gpu or self.kvcache_mem_cpu
        ):
            return (self.kvcache_mem_gpu or 0) + (self.kvcache_mem_cpu or 0)
        return self.mem


class VisionProxyConfig(_Strict):
    # The vision model: a models.yaml entry name (or its hf_id).
    model: str
    # Prompt given to the VLM; {user_text} is replaced by the user's own words.
    prompt_template: str | None = None
    # Caption length limit in tokens.
    max_tokens: int = Field(default=256, ge=1, le=4096)


class ModelCapabilities(_Strict):
    # How images reach this model: refused (disabled), captioned by a VLM (proxy), or sent
    # straight in to a VLM served with mlx-vlm (native; its processor places the images).
    vision_mode: VisionMode = "disabled"
    vision_proxy: VisionProxyConfig | None = None
    # Stream parser family for tool calls (app/parsers: qwen, mistral, llama, generic);
    # None detects it from the chat template.
    tool_parser: str | None = None
    # The model reasons, with this family's markers ("none": it does not);
    # None detects it from the chat template, then the model name.
    reasoning_parser: str | None = None
    # When the client sends a system prompt and the chat template has a default one (which it
    # then drops): "append" keeps the default first, then the client's; "replace" sends the
    # client's alone. None: "append" when the template has a default system prompt.
    system_prompt: Literal["replace", "append"] | None = None

    @model_validator(mode="after")
    def _proxy_needs_model(self) -> ModelCapabilities:
        if self.vision_mode == "proxy" and self.vision_proxy is None:
            raise ValueError("vision_mode 'proxy' needs vision_proxy.model")
        return self


class ModelEntry(_Strict):
    # The name clients send as "model".
    name: str = Field(min_length=1)
    # A Hugging Face repo id, loaded by mlx-lm / mlx-vlm (needs the hub or its cache).
    hf_id: str | None = None
    # A local mlx-lm / mlx-vlm model directory; wins over hf_id.
    local_path: str | None = None
    # A llama-architecture GGUF file, converted once into the cache directory.
    weight_file: str | None = None
    # A model shipped inside an installed package, prepared offline into the cache:
    # "smollm2-135m-instruct" (chat) or "all-minilm-l6-v2" (embeddings).
    builtin: Literal["smollm2-135m-instruct", "all-minilm-l6-v2"] | None = None
    # What this entry is for: chat, a VLM that captions for others (vision), embeddings
    # (/v1/embeddings and /v1/rerank by cosine), or a cross-encoder reranker (rerank).
    role: Role = "chat"
    # Load at start-up instead of on the first request.
    preload: bool = False
    # Never unload (idle or for room).
    pin: bool = False
    # Unload after this many seconds unused; overrides the file's idle_unload_secs (0: never).
    idle_unload_secs: int | None = Field(default=None, ge=0)
    params: ModelParams = ModelParams()
    capabilities: ModelCapabilities = ModelCapabilities()

    @model_validator(mode="after")
    def _has_source(self) -> ModelEntry:
        if not (self.hf_id or self.local_path or self.weight_file or self.builtin):
            raise ValueError(
                f"model {self.name!r} needs one of builtin, local_path, weight_file, hf_id"
            )
        return self


class ServerSettings(_Strict):
    """Limits and security of the HTTP side."""

    # Loopback only by default; set 0.0.0.0 deliberately to serve a LAN.
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    # When set, every /v1 request and /metrics need `Authorization: Bearer <api_key>` (or
    # `x-api-key`); a SecretStr, so printing the settings never shows it. Also TANDEM_API_KEY,
    # or --api-key-file, so the key never shows in `ps`.
    api_key: SecretStr | None = None
    # Several named keys (name -> key), one per user or agent; any of them is accepted.
    api_keys: dict[str, SecretStr] = {}
    # per_key: requests with different keys never share prefix-cache entries (one user cannot
    # probe another's prompts through cached_tokens or time to first token); shared: they do.
    prompt_cache_scope: Literal["per_key", "shared"] = "per_key"
    # Host names served besides loopback ones (DNS-rebinding guard; see README, Security).
    allowed_hosts: list[str] = []
    # Browser origins allowed by CORS; empty means CORS is off.
    cors_origins: list[str] = []
    # Largest request body in bytes (413 beyond).
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
    # JSON values a request body may hold (every array item, object member and container; 413
    # beyond), counted before decoding: ~70 bytes each once decoded, so 1M is ~70 MB of Python
    # objects, where 32 MB of `[{},{},...]` would be GBs. Room for a context's worth of token ids.
    max_json_values: int = Field(default=1_000_000, ge=1000)
    # Messages one chat request may carry.
    max_messages: int = Field(default=512, ge=1)
    # Open HTTP connections. At the limit, the connections idle longest (fresh or kept alive, no
    # byte of a request received) are closed to make room; when all are busy a request gets 503,
    # except /health.
    max_connections: int = Field(default=256, ge=1)
    # Seconds a connection has to send a complete request head, from connecting or from the first
    # byte of its next request; then it is closed (slowloris). Idle kept-alive connections close after 5 s.
    header_timeout_s: float = Field(default=5.0, gt=0)
    # Listen backlog, so a burst of connections is not reset.
    backlog: int = Field(default=2048, ge=16)
    # On SIGTERM/SIGINT: seconds running requests get to finish before they end with an error event.
    shutdown_grace_s: float = Field(default=30.0, ge=0)
    # Distributed serving (mlx.launch): seconds a batch step, or a rank's answer to rank 0's ping,
    # may take before rank 0 declares the rank lost and the engine dead (503). Long enough for the
    # slowest step: a prefill chunk (prefill_chunk_size tokens) of the biggest model on the slowest rank.
    distributed_timeout_s: float = Field(default=60.0, gt=0)
    # When the MLX engine thread dies: "exit" drains (running streams get their error event) and
    # exits with status 70, so launchd / systemd restart a fresh process; "stay" keeps the process
    # up, answering 503 until someone restarts it.
    on_engine_death: Literal["exit", "stay"] = "exit"
    # Which reasoning fields go out: OpenAI-compatible servers disagree on the name.
    reasoning_fields: list[Literal["reasoning_content", "reasoning"]] = [
        "reasoning_content",
        "reasoning",
    ]
    # file:// image URLs are allowed only under this directory; None turns them off.
    image_file_dir: str | None = None
    # http(s) image URLs: off by default.
    allow_remote_images: bool = False
    remote_image_hosts: list[str] = []
    allow_private_remote_images: bool = False
    remote_image_timeout_s: float = Field(default=10.0, gt=0)
    # Largest image in bytes, after base64 decoding or download.
    max_image_bytes: int = Field(default=20 * 1024 * 1024, ge=1024)
    # Largest decoded image in pixels (decompression-bomb guard).
    max_image_pixels: int = Field(default=40_000_000, ge=1024)
    # The process's memory budget in MB: weights plus KV budget (`mem`) of every loaded model
    # must fit in it. None: 75% of physical memory (unified memory on a Mac).
    memory_limit_mb: int | None = Field(default=None, ge=64)
    # Cached captions, keyed by image hash, prompt and model.
    caption_cache_entries: int = Field(default=512, ge=0)
    # Responses API (/v1/responses): responses kept for previous_response_id and GET, in memory,
    # least recently used out first; a restart forgets them, and `store: false` keeps nothing.
    responses_store_entries: int = Field(default=1024, ge=0)
    # ... and the JSON size they may take together, in MB.
    responses_store_mb: int = Field(default=64, ge=0)


class ModelsFile(_Strict):
    # Unload any model after this many seconds unused (pinned ones never); it loads again on
    # its next request. None: models stay loaded until memory is needed for another.
    idle_unload_secs: int | None = Field(default=None, ge=1)
    # The chat model /health and the CLI name first, loaded at start-up; None: the first
    # chat entry. Every entry is served under its name whatever this says.
    default_model: str | None = None
    server: ServerSettings = ServerSettings()
    models: list[ModelEntry] = Field(min_length=1)

    @model_validator(mode="after")
    def _names_unique_and_linked(self) -> ModelsFile:
        names = [m.name for m in self.models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate model names: {', '.join(dupes)}")
        for m in self.models:
            proxy = m.capabilities.vision_proxy
            if proxy and self.find(proxy.model) is None:
                raise ValueError(
                    f"model {m.name!r}: vision_proxy.model {proxy.model!r} is not an entry "
                    f"(entries: {', '.join(names)})"
                )
        if self.default_model and self.find(self.default_model) is None:
            raise ValueError(f"default_model {self.default_model!r} is not an entry")
        return self

    def find(self, name: str) -> ModelEntry | None:
        """The entry called `name`, or whose hf_id is `name`."""
        for m in self.models:
            if m.name == name:
                return m
        return next((m for m in self.models if m.hf_id == name), None)

    def capabilities_map(self) -> dict[str, ModelCapabilities]:
        return {m.name: m.capabilities for m in self.models}

    def params_map(self) -> dict[str, ModelParams]:
        return {m.name: m.params for m in self.models}
