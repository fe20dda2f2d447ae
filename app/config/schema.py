"""The models.yaml schema.

Everything engine-related for a model lives in its entry: where the weights
come from, how they are loaded, how much KV-cache memory it may use, how many
sequences run at once, default sampling and capabilities. An entry is one of a
union keyed on ``role`` (``ROLE_ENTRIES``, one row per role): each role has its own
``params`` model, so a key that belongs to another role (``temperature`` on an
embedding model) stops start-up instead of being ignored. Command-line flags override
the served chat model's ``params``; ``app/specs.py`` resolves both into the engine's frozen
``LoadParams`` / ``EngineParams`` / ``EncoderLimits`` (``app/engine/params.py``),
which carry no defaults of their own: each default is written here, once, with its
description; the CLI's flags and the docs' reference tables are generated from
these fields.

Every model is ``extra="forbid"``: a typo in models.yaml stops start-up with a
message naming the file, the key and the allowed values (see ``loader``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, SecretStr, Tag, create_model, model_validator

from app.kinds import Distributed, Dtype, KVBits, PromptCacheMode, Quantization

VisionMode = Literal["disabled", "proxy", "native"]
BUILTIN_MODELS = ("smollm2-135m-instruct", "all-minilm-l6-v2")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Params(_Strict):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---- params, in groups; each role's params model is the groups it uses ---------------------------


class _WeightParams(_Params):
    dtype: Dtype | None = Field(
        default=None, description="Weight dtype for unquantized weights; None keeps the checkpoint's dtype.")
    max_model_len: int | None = Field(
        default=None, ge=64, description="Context length in tokens (for an encoder: tokens per input); None takes "
        "the model config's max_position_embeddings.")


class _BatchParams(_Params):
    quantization: Quantization | None = Field(
        default=None, description="Quantize at load (also --isq); already-quantized weights load as they are.")
    quantization_group_size: Literal[32, 64, 128] = Field(
        default=64, description="Quantization group size used with `quantization`.")
    kv_cache_bits: KVBits | None = Field(
        default=None, description="Quantized KV cache (4 or 8 bits) lowers the bytes per token of the model's "
        "full-attention layers (sliding windows and recurrent state stay as they are); a model whose attention "
        "reads plain K/V only (attention sinks: gpt-oss; Gemma 4) keeps it quantized and dequantizes it each step. "
        "None keeps the model dtype.")
    distributed: Distributed = Field(
        default="tensor", description="Under mlx.launch (several ranks): \"tensor\" splits every layer over the "
        "ranks (faster decoding), \"pipeline\" gives each rank a run of layers (a bigger model fits; mlx-lm "
        "supports it for a few model types). Ignored in one process.")
    mem: int = Field(
        default=1024, ge=16, description="KV-cache memory budget in MB: admission and the prefix cache both live "
        "inside it.")
    kvcache_mem_gpu: int | None = Field(
        default=None, ge=0, description="Accepted for candle-vllm compatibility: when `mem` is not set, "
        "kvcache_mem_gpu + kvcache_mem_cpu is the budget (one unified memory).")
    kvcache_mem_cpu: int | None = Field(
        default=None, ge=0, description="See kvcache_mem_gpu.")
    max_num_seqs: int = Field(
        default=8, ge=1, le=256, description="Sequences decoded together by the batch generator.")
    prefill_chunk_size: int = Field(
        default=512, ge=16, description="Largest prompt slice prefilled in one step, so decoding streams keep moving.")
    prefill_batch_size: int = Field(
        default=8, ge=1, le=256, description="Prompts prefilled together in one step (capped at max_num_seqs).")
    prefill_step_ms: int = Field(
        default=250, ge=0, description="Each prefill chunk is sized (at most prefill_chunk_size) so that a batch "
        "step takes about this long, at the prefill rate measured on this model: a long prompt never stalls the "
        "streams beside it, nor a request that arrives, for more than about this. 0: always prefill_chunk_size.")

    @property
    def kv_mem_mb(self) -> int:
        """The KV budget: `mem`, or the gpu+cpu split when only that is given."""
        if "mem" not in self.model_fields_set and (self.kvcache_mem_gpu or self.kvcache_mem_cpu):
            return (self.kvcache_mem_gpu or 0) + (self.kvcache_mem_cpu or 0)
        return self.mem


class _QueueParams(_Params):
    max_queue: int = Field(
        default=64, ge=0, description="Requests waiting for the model (its KV budget, or its load); one more gets "
        "429 with Retry-After.")
    queue_timeout_s: float = Field(
        default=120.0, gt=0, description="Seconds a request may wait for admission (or the model's load) before a 503.")


class _PromptCacheParams(_Params):
    prompt_cache: PromptCacheMode = Field(
        default="prefix", description="Which prompt prefixes keep their KV cache for later requests.")
    cache_min_tokens: int = Field(
        default=64, ge=1, description="Prefixes shorter than this many tokens are not worth caching.")
    prompt_cache_mem: int | None = Field(
        default=None, ge=0, description="MB of `mem` the prefix cache may hold (None: a quarter of `mem`); evicted "
        "LRU beyond it.")
    prompt_cache_entries: int = Field(
        default=256, ge=1, description="Most prefixes the prefix cache holds, whatever their size.")
    prompt_cache_disk_mb: int = Field(
        default=4096, ge=0, description="MB of disk for this model's prefixes (the disk tier, LRU-evicted beyond "
        "it); 0 turns it off.")
    prompt_cache_disk_dir: str | None = Field(
        default=None, description="The disk tier's directory; None: $TANDEM_PROMPT_CACHE_DIR, else "
        "<cache dir>/prompt-cache.")
    prompt_cache_key_share: float = Field(
        default=0.5, gt=0.0, le=1.0, description="Share of the prefix cache (in memory, and on disk) one cache "
        "partition (an API key, a cache_salt) may hold before its own prefixes are evicted first: one client's "
        "abandoned prompts cannot push out everyone else's. 1.0: least recently used first, whoever's.")
    prompt_cache_pin_share: float = Field(
        default=0.5, ge=0.0, le=1.0, description="Share of the prefix cache (in memory, and on disk) that prefixes "
        "clients asked to keep (cache breakpoints: Anthropic's cache_control, OpenAI's prompt_cache_breakpoint) may "
        "hold ahead of the rest for their TTL; pins past it, or expired, are evicted least recently used like "
        "any other. 0: breakpoints store their prefixes but keep none ahead.")
    background_share: float = Field(
        default=0.25, ge=0.0, le=1.0, description="Share of max_num_seqs that background requests (priority "
        "\"background\", Open WebUI's \"### Task:\" prompts) may hold while interactive requests wait for their "
        "first token.")


class _DefaultSampling(_Params):
    # The model's defaults for requests; each request may override them. (The engine's
    # SamplingParams has none: the pipeline always fills it from these and the request.)
    temperature: float = Field(
        default=0.7, ge=0.0, le=2.0, description="Default sampling temperature; 0 picks the most likely token.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Default nucleus sampling; 1.0 disables it.")
    top_k: int = Field(default=0, ge=0, description="Default top-k; 0 disables it.")
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="Default min-p; 0 disables it.")
    frequency_penalty: float = Field(
        default=0.0, ge=-2.0, le=2.0, description="Default frequency penalty (OpenAI's); 0 disables it.")
    presence_penalty: float = Field(
        default=0.0, ge=-2.0, le=2.0, description="Default presence penalty (OpenAI's); 0 disables it.")
    repetition_penalty: float = Field(
        default=1.0, gt=0.0, le=3.0, description="Default repetition penalty; 1.0 disables it.")
    max_tokens: int = Field(default=512, ge=1, description="Completion length when a request names none.")


class _ImageParams(_Params):
    max_pixels: int = Field(
        default=448 * 448, ge=28 * 28, description="Largest image (in pixels) the VLM sees: bigger ones are resized "
        "into it.")
    min_pixels: int = Field(
        default=28 * 28, ge=1, description="Smallest image (in pixels) the VLM sees: smaller ones are resized up.")
    max_images_per_request: int = Field(default=8, ge=1, description="Images one request may carry.")
    vision_feature_cache_mb: int = Field(
        default=64, ge=0, description="MB for the vision tower's output per image (keyed by the image's decoded "
        "pixels, its processor settings and the request's cache scope), so an image seen before skips the tower; "
        "counted in the model's memory next to its weights, LRU-evicted beyond it; 0 turns it off.")


class SpeculativeConfig(_Params):
    """A chat entry's ``params.speculative``: who proposes tokens for the batch to verify in one
    forward pass (``app.engine.speculative``). The answer is what it would have been without:
    proposals only make decoding faster when they are accepted. A request may turn a drafter
    off for itself (``speculative: {prompt_lookup: false, draft: false}`` in a chat or text
    completion's body); OpenAI's ``prediction`` adds the client's predicted text as a drafter
    of its own (docs/guides/speculative.md)."""

    prompt_lookup: bool = Field(
        default=True, description="Propose continuations of n-grams found in the prompt and the output so far (no "
        "extra model: a lookup per row and step); pays when the answer repeats the prompt (code edits, quotes). "
        "The adaptive rule proposes fewer tokens to a row whose proposals are not accepted.")
    draft: str | None = Field(
        default=None, description="Another chat entry of this file that drafts for this one (a smaller model with "
        "the same tokenizer: checked at load). It is loaded with this model, counts in server.memory_limit_mb with "
        "its weights and its KV for this model's rows, and stays loaded while this model is. None: no draft model.")
    tokens: int = Field(
        default=4, ge=0, le=16, description="The most tokens a row proposes per step; the adaptive rule picks fewer "
        "when a longer proposal does not pay on this machine. 0 turns speculative decoding off for this model, "
        "requests' predictions included.")


class _SpeculativeParams(_Params):
    speculative: SpeculativeConfig = Field(
        default=SpeculativeConfig(), description="Speculative decoding: prompt lookup, a draft model.")


class ChatParams(_SpeculativeParams, _ImageParams, _DefaultSampling, _PromptCacheParams, _QueueParams, _BatchParams,
                 _WeightParams):
    """A chat entry's ``params`` (``role: chat``, the default): loading, KV memory, batching,
    queueing, the prefix cache, default sampling, speculative decoding, and image bounds for a
    native VLM (``vision_mode: native``)."""


class VisionParams(_ImageParams, _QueueParams, _BatchParams, _WeightParams):
    """A vision entry's ``params`` (``role: vision``: a VLM that captions images for
    ``vision_mode: proxy`` models): loading, KV memory, batching and queueing of its VLM
    engine, and image bounds. Captions are greedy (no sampling keys) and never continued
    (no prefix cache)."""

    mem: int = Field(
        default=256, ge=16, description="KV-cache memory budget in MB of the captioning engine: a caption is one "
        "image's tokens and a short answer, so less than a chat model needs.")
    vision_feature_cache_mb: int = Field(
        default=0, ge=0, description="MB for the vision tower's output per image; off by default here, since the "
        "proxy's caption cache already keys captions by the image's pixels.")


class EncoderParams(_QueueParams, _WeightParams):
    """An embedding or rerank entry's ``params`` (``role: embedding`` / ``rerank``): loading,
    queueing, and batching (one batch is one engine step: it bounds how long chat decoding waits)."""

    max_batch: int = Field(default=32, ge=1, description="Inputs encoded together in one batch.")
    max_batch_tokens: int = Field(
        default=4096, ge=16, description="Padded tokens (inputs x longest) in one batch.")
    max_inputs: int = Field(default=2048, ge=1, description="Inputs (or documents) one request may carry.")
    max_jobs: int = Field(
        default=8, ge=1, le=256, description="Requests encoded at once, taking turns one batch at a time (more wait "
        "in the queue, up to max_queue).")
    max_step_ms: int = Field(
        default=200, ge=1, description="Target milliseconds of one encoder batch: batches are cut below "
        "max_batch_tokens to stay near it, so chat streams keep getting tokens during a job. One input that alone "
        "takes longer still runs in one step.")
    truncate: bool = Field(
        default=True, description="Cut an input longer than max_model_len to its first tokens (counted in the "
        "response's usage.truncated_tokens and in /metrics), as Ollama and text-embeddings-inference do for the "
        "clients that cannot ask (Open WebUI); false: such an input is a 400 context_length_exceeded. A request's "
        "own \"truncate\" wins.")


# ---- capabilities (chat entries) --------------------------------------------------------------------


class VisionProxyConfig(_Strict):
    """``capabilities.vision_proxy``: the VLM that captions a proxy-mode model's images."""

    model: str = Field(description="The vision model: a models.yaml entry name (or its hf_id).")
    prompt_template: str | None = Field(
        default=None, description="Prompt given to the VLM; {user_text} is replaced by the user's own words. "
        "None: the built-in captioning prompt.")
    max_tokens: int = Field(default=256, ge=1, le=4096, description="Caption length limit in tokens.")


class ReasoningBudgets(_Strict):
    """Thinking budgets per effort level: how many tokens a request that names a level may
    reason before its block is closed (docs/guides/reasoning.md maps each client's effort
    onto these). Each is clamped to the model's context."""

    minimal: int = Field(default=256, ge=0, description="Tokens of reasoning at effort \"minimal\".")
    low: int = Field(default=1024, ge=0, description="Tokens of reasoning at effort \"low\".")
    medium: int = Field(default=4096, ge=0, description="Tokens of reasoning at effort \"medium\".")
    high: int = Field(default=16384, ge=0, description="Tokens of reasoning at effort \"high\" (and \"xhigh\", "
                      "Anthropic's \"max\").")


class ModelCapabilities(_Strict):
    """A chat entry's ``capabilities``: images, tool calls, reasoning, system prompt."""

    vision_mode: VisionMode = Field(
        default="disabled", description="How images reach this model: refused (disabled), captioned by a VLM "
        "(proxy), or sent straight in to a VLM served with mlx-vlm (native; its processor places the images).")
    vision_proxy: VisionProxyConfig | None = Field(
        default=None, description="The captioning VLM; needed with vision_mode proxy.")
    vision_unavailable: Literal["placeholder", "refuse"] = Field(
        default="placeholder", description="When a proxy-mode model gets images and its vision model is not "
        "available (it failed to load, or --no-vision): \"placeholder\" answers with each image replaced by a line "
        "saying so and a warning (the x-tandem-warning header on every format, and in the body where the format has "
        "room); \"refuse\" answers 400, so the client knows the model never saw them.")
    tool_parser: str | None = Field(
        default=None, description="Model family for tool calls and reasoning (app/families: qwen, qwen3_coder, "
        "glm, deepseek_v3, kimi, gpt_oss, gemma4, lfm2, mistral, llama, generic, ...; the list is in the tool-calls "
        "guide); None detects it by rendering the chat template with a probe call.")
    reasoning_parser: str | None = Field(
        default=None, description="The model reasons, with this family's markers (\"none\": it does not); None "
        "detects it from the chat template, then the model name.")
    system_prompt: Literal["replace", "append"] | None = Field(
        default=None, description="When the client sends a system prompt and the chat template has a default one "
        "(which it then drops): \"append\" keeps the default first, then the client's; \"replace\" sends the "
        "client's alone. None: \"append\" when the template has a default system prompt.")
    reasoning_budgets: ReasoningBudgets = Field(
        default_factory=ReasoningBudgets, description="Tokens a request may reason at each effort level "
        "(reasoning_effort, reasoning.effort, output_config.effort); an explicit budget (thinking.budget_tokens) "
        "wins. At the budget the engine writes the model's own closing marker and the answer follows.")

    @model_validator(mode="after")
    def _proxy_needs_model(self) -> ModelCapabilities:
        if self.vision_mode == "proxy" and self.vision_proxy is None:
            raise ValueError("vision_mode 'proxy' needs vision_proxy.model")
        return self


# ---- entries: one per role, told apart by `role` ---------------------------------------------------


class ModelEntryBase(_Strict):
    """What every models.yaml entry has, whatever its role: a name, where its weights come
    from, when it is loaded, and its role's ``params``."""

    name: str = Field(min_length=1, description="The name clients send as \"model\".")
    hf_id: str | None = Field(
        default=None, description="A Hugging Face repo id, loaded by mlx-lm / mlx-vlm (needs the hub or its cache).")
    local_path: str | None = Field(
        default=None, description="A local mlx-lm / mlx-vlm model directory; wins over hf_id.")
    weight_file: str | None = Field(
        default=None, description="A llama-architecture GGUF file, converted once into the cache directory.")
    builtin: Literal["smollm2-135m-instruct", "all-minilm-l6-v2"] | None = Field(
        default=None, description="A model shipped inside an installed package, prepared offline into the cache: "
        "\"smollm2-135m-instruct\" (chat) or \"all-minilm-l6-v2\" (embeddings).")
    # Each role's entry narrows ``role`` and ``params`` (``ROLE_ENTRIES``).
    role: str = Field(
        default="chat", description="What this entry is for (a key of ``ROLE_ENTRIES``); it decides which params "
        "(and capabilities) the entry takes.")
    preload: bool = Field(default=False, description="Load at start-up instead of on the first request.")
    pin: bool = Field(default=False, description="Never unload (idle or for room).")
    idle_unload_secs: int | None = Field(
        default=None, ge=0, description="Unload after this many seconds unused; overrides the file's "
        "idle_unload_secs (0: never).")
    params: _Params = Field(default=_Params(), description="How the model is loaded and run (its role's params).")

    @model_validator(mode="after")
    def _has_source(self) -> ModelEntryBase:
        if not (self.hf_id or self.local_path or self.weight_file or self.builtin):
            raise ValueError(f"model {self.name!r} needs one of builtin, local_path, weight_file, hf_id")
        return self


class ChatEntry(ModelEntryBase):
    """``role: chat`` (the default): a model served on the chat, completions, Responses and
    Messages APIs."""

    role: Literal["chat"] = Field(default="chat", description="chat (the default).")
    params: ChatParams = Field(default=ChatParams(), description="How the model is loaded and run (ChatParams).")
    capabilities: ModelCapabilities = Field(
        default=ModelCapabilities(), description="Images, tool calls, reasoning (ModelCapabilities).")


def role_entry(role: str, params: type[_Params], what: str) -> type[ModelEntryBase]:
    """The entry type of a role whose entries hold nothing but ``params`` besides the common
    keys: ``VisionEntry`` for ``role_entry("vision", VisionParams, ...)``."""
    doc = f"``role: {role}``: {what}."
    fields: dict[str, Any] = {
        "role": (Literal[role], Field(description=f"{role}.")),
        "params": (params, Field(default=params(), description=f"How the model is loaded and run "
                                 f"({params.__name__}).")),
    }
    return create_model(f"{role.capitalize()}Entry", __base__=ModelEntryBase, __module__=__name__, __doc__=doc,
                        **fields)


# The table of roles: each role's entry type, and through it, its params. A role whose entries
# take only params is one row here (and one in ``app/engine/roles.py``'s ``ROLES``).
ROLE_ENTRIES: dict[str, type[ModelEntryBase]] = {
    "chat": ChatEntry,
    "vision": role_entry("vision", VisionParams, "a VLM that captions images for ``vision_mode: proxy`` chat models"),
    "embedding": role_entry("embedding", EncoderParams,
                            "an embedding model for /v1/embeddings (and /v1/rerank by cosine)"),
    "rerank": role_entry("rerank", EncoderParams, "a cross-encoder for /v1/rerank"),
}


def _role_of(entry: Any) -> Any:
    """The entry's role; an entry without one is a chat model."""
    if isinstance(entry, dict):
        return entry.get("role", "chat")
    return getattr(entry, "role", None)


if TYPE_CHECKING:
    # To the type checker an entry is a ChatEntry or another role's (narrow with isinstance).
    ModelEntry = ModelEntryBase
else:
    # One of ``ROLE_ENTRIES``, picked by ``role`` (``Union[...]``: a union of the table's rows).
    ModelEntry = Annotated[Union[tuple(Annotated[e, Tag(r)] for r, e in ROLE_ENTRIES.items())],  # noqa: UP007
                           Discriminator(_role_of)]


def role_params(role: str) -> type[BaseModel]:
    """The params model of a role's entries."""
    return ROLE_ENTRIES[role].model_fields["params"].annotation  # type: ignore[return-value]


# ---- the HTTP side and the file ---------------------------------------------------------------------


class ApiKey(_Strict):
    """A named key and its role (Security: key roles); a key written alone (`alice: sk-...`) is
    `{key: sk-..., role: user}`."""

    key: SecretStr = Field(description="The key itself, as clients send it.")
    role: Literal["admin", "user"] = Field(
        default="user", description="admin: also `/v1/admin/*` (load, unload, pin) and every key's requests on the "
        "dashboard; user: the API, and its own requests on the dashboard only.")

    @model_validator(mode="before")
    @classmethod
    def _key_alone(cls, data: Any) -> Any:
        return {"key": data} if isinstance(data, str) else data


class ServerSettings(_Strict):
    """The file's ``server``: limits and security of the HTTP side."""

    host: str = Field(
        default="127.0.0.1", description="Bind address: loopback only by default; set 0.0.0.0 deliberately to "
        "serve a LAN.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port to listen on.")
    api_key: SecretStr | None = Field(
        default=None, description="When set, every /v1 request and /metrics need `Authorization: Bearer <api_key>` "
        "(or `x-api-key`). Also TANDEM_API_KEY, or --api-key-file, so the key never shows in `ps`. The one key of a "
        "single-user set-up, so an admin key (named \"default\").")
    api_keys: dict[str, ApiKey] = Field(
        default={}, description="Several named keys (name -> key, or name -> {key, role}), one per user or agent; any "
        "of them is accepted. A key given alone has the role `user`.")
    prompt_cache_scope: Literal["per_key", "shared"] = Field(
        default="per_key", description="per_key: requests with different keys never share prefix-cache entries (one "
        "user cannot probe another's prompts through cached_tokens or time to first token); shared: they do.")
    allowed_hosts: list[str] = Field(
        default=[], description="Host names served besides loopback ones (DNS-rebinding guard; see Security).")
    cors_origins: list[str] = Field(default=[], description="Browser origins allowed by CORS; empty means CORS is off.")
    dashboard: bool = Field(
        default=True, description="Serve the dashboard at `/` and `/ui` (models, memory, live charts, requests, a "
        "playground) and its event stream `/ui/events`; false: those paths are 404.")
    openapi_schema: bool = Field(
        default=False, description="Serve the API's OpenAPI schema as JSON at `/docs/openapi.json` (and `/docs`), "
        "behind the key when keys are set; off: `/docs` is a 404. No viewer page is served: Swagger UI and its kin "
        "load scripts from a CDN, which would run in the API's origin.")
    max_body_bytes: int = Field(
        default=32 * 1024 * 1024, ge=1024, description="Largest request body in bytes (413 beyond).")
    max_json_values: int = Field(
        default=1_000_000, ge=1000, description="JSON values a request body may hold (every array item, object member "
        "and container; 413 beyond), counted before decoding: ~70 bytes each once decoded, so 1M is ~70 MB of Python "
        "objects, where 32 MB of `[{},{},...]` would be GBs. Room for a context's worth of token ids.")
    max_messages: int = Field(
        default=10_000, ge=1, description="Messages one chat request may carry: a bound only an attack reaches. Long "
        "agent sessions (Claude Code, Codex: every tool call and result is a message) pass 512; a request is bounded "
        "first by its bytes, JSON values and tokens (the context).")
    max_connections: int = Field(
        default=256, ge=1, description="Open HTTP connections. At the limit, the connections idle longest (fresh or "
        "kept alive, no byte of a request received) are closed to make room; when all are busy a request gets 503, "
        "except /health.")
    max_event_streams: int = Field(
        default=16, ge=0, description="Dashboard event streams (`/ui/events`) open at once, from every client "
        "together; never more than half of `max_connections`, so the API always has connections left. 429 beyond.")
    max_event_streams_per_client: int = Field(
        default=4, ge=0, description="Dashboard event streams one client (an API key; with no keys, an address) may "
        "hold open at once: a few tabs. 429 beyond.")
    header_timeout_s: float = Field(
        default=5.0, gt=0, description="Seconds a connection has to send a complete request head, from connecting or "
        "from the first byte of its next request; then it is closed (slowloris). Idle kept-alive connections close "
        "after 5 s.")
    backlog: int = Field(default=2048, ge=16, description="Listen backlog, so a burst of connections is not reset.")
    sse_keepalive_s: float = Field(
        default=10.0, ge=0, description="Seconds a stream may stay silent (queued, or prefilling a long prompt) "
        "before a keep-alive goes out: `event: ping` on /v1/messages, as Anthropic sends it, an SSE comment line "
        "(`: keep-alive`) on the OpenAI formats; proxies and clients drop silent streams. 0 sends none.")
    shutdown_grace_s: float = Field(
        default=30.0, ge=0, description="On SIGTERM/SIGINT: seconds running requests get to finish before they end "
        "with an error event.")
    distributed_timeout_s: float = Field(
        default=60.0, gt=0, description="Distributed serving (mlx.launch): seconds a batch step, or a rank's answer "
        "to rank 0's ping, may take before rank 0 declares the rank lost and the engine dead (503). Long enough for "
        "the slowest step: a prefill chunk of the biggest model on the slowest rank.")
    on_engine_death: Literal["exit", "stay"] = Field(
        default="exit", description="When the MLX engine thread dies: \"exit\" drains (running streams get their "
        "error event) and exits with status 70, so launchd / systemd restart a fresh process; \"stay\" keeps the "
        "process up, answering 503 until someone restarts it.")
    reasoning_fields: list[Literal["reasoning_content", "reasoning"]] = Field(
        default=["reasoning_content", "reasoning"], description="Which reasoning fields go out: OpenAI-compatible "
        "servers disagree on the name.")
    image_file_dir: str | None = Field(
        default=None, description="file:// image URLs are allowed only under this directory; None turns them off.")
    allow_remote_images: bool = Field(default=False, description="Allow http(s) image URLs.")
    remote_image_hosts: list[str] = Field(
        default=[], description="With allow_remote_images: the host names image URLs may use (exact, or "
        "\"*.example.com\"); empty: any host.")
    allow_private_remote_images: bool = Field(
        default=False, description="With allow_remote_images: also fetch from hosts that resolve to loopback, private "
        "or link-local addresses (off: the SSRF guard).")
    remote_image_timeout_s: float = Field(
        default=10.0, gt=0, description="Seconds one image download may take (lookup, connect, TLS, headers and "
        "body together).")
    max_image_bytes: int = Field(
        default=20 * 1024 * 1024, ge=1024, description="Largest image in bytes, after base64 decoding or download.")
    max_image_pixels: int = Field(
        default=40_000_000, ge=1024, description="Largest decoded image in pixels (decompression-bomb guard).")
    memory_limit_mb: int | None = Field(
        default=None, ge=64, description="The process's memory budget in MB: weights plus KV budget (`mem`) of every "
        "loaded model must fit in it. None: 75% of physical memory (unified memory on a Mac).")
    caption_cache_entries: int = Field(
        default=512, ge=0, description="Cached captions, keyed by image pixels, prompt and model, and partitioned as "
        "the prefix cache is (per key under `prompt_cache_scope: per_key`, and per `cache_salt`).")
    responses_store_entries: int = Field(
        default=1024, ge=0, description="Responses API (/v1/responses): responses kept for previous_response_id and "
        "GET, in memory, least recently used out first; a restart forgets them, and `store: false` keeps nothing.")
    responses_store_mb: int = Field(
        default=64, ge=0, description="The memory the stored responses may take together, in MB (each is kept as "
        "its JSON text).")

    @model_validator(mode="after")
    def _keys_tell_clients_apart(self) -> ServerSettings:
        # A request is known by its key: two names for one key would give it two names and maybe two roles.
        named = {name: entry.key for name, entry in self.api_keys.items()}
        if self.api_key is not None:
            if "default" in named:
                raise ValueError('api_keys has a key named "default", the name of api_key: rename one of them')
            named["default"] = self.api_key
        seen: dict[str, str] = {}
        for name, secret in named.items():
            if (other := seen.setdefault(secret.get_secret_value(), name)) != name:
                raise ValueError(f"api keys {other!r} and {name!r} are the same key: give each its own")
        return self


class ModelsFile(_Strict):
    """The whole models.yaml file."""

    idle_unload_secs: int | None = Field(
        default=None, ge=1, description="Unload any model after this many seconds unused (pinned ones never); it "
        "loads again on its next request. None: models stay loaded until memory is needed for another.")
    default_model: str | None = Field(
        default=None, description="The chat model /health and the CLI name first, loaded at start-up; None: the "
        "first chat entry. Every entry is served under its name whatever this says.")
    server: ServerSettings = Field(default=ServerSettings(), description="Limits and security (ServerSettings).")
    models: list[ModelEntry] = Field(
        min_length=1, description="The models, each of its role's entry type (ROLE_ENTRIES).")

    @model_validator(mode="after")
    def _names_unique_and_linked(self) -> ModelsFile:
        names = [m.name for m in self.models]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate model names: {', '.join(dupes)}")
        for m in self.models:
            proxy = m.capabilities.vision_proxy if isinstance(m, ChatEntry) else None
            if proxy and self.find(proxy.model) is None:
                raise ValueError(
                    f"model {m.name!r}: vision_proxy.model {proxy.model!r} is not an entry "
                    f"(entries: {', '.join(names)})"
                )
        if self.default_model and self.find(self.default_model) is None:
            raise ValueError(f"default_model {self.default_model!r} is not an entry")
        for i, m in enumerate(self.models):
            if isinstance(m, ChatEntry) and (problem := self.draft_problem(m)):
                raise ValueError(f"models[{i}].params.speculative.draft: {problem}")
        return self

    def draft_problem(self, entry: ChatEntry) -> str | None:
        """Why ``entry``'s draft model cannot draft for it, or None (no draft, or a good one): it
        must be another text chat entry of this file, one without a draft of its own."""
        name = entry.params.speculative.draft
        if name is None:
            return None
        if entry.capabilities.vision_mode == "native":
            return f"model {entry.name!r} is a native VLM (mlx-vlm): only text models take a draft model"
        draft = self.find(name)
        chat = [m.name for m in self.models if isinstance(m, ChatEntry) and m.name != entry.name]
        if draft is None:
            return (f"model {entry.name!r}: draft {name!r} is not an entry (chat entries: "
                    f"{', '.join(chat) or 'none but this one'})")
        if not isinstance(draft, ChatEntry):
            return f"model {entry.name!r}: draft {name!r} has role {draft.role}; a draft model is a chat entry"
        if draft.name == entry.name:
            return f"model {entry.name!r}: a model cannot draft for itself"
        if draft.capabilities.vision_mode == "native":
            return f"model {entry.name!r}: draft {name!r} is a native VLM (mlx-vlm); a draft model is a text model"
        if draft.params.speculative.draft is not None:
            return (f"model {entry.name!r}: draft {name!r} has a draft of its own "
                    f"({draft.params.speculative.draft!r}); a draft model drafts alone")
        return None

    def find(self, name: str) -> ModelEntry | None:
        """The entry called `name`, or whose hf_id is `name`."""
        for m in self.models:
            if m.name == name:
                return m
        return next((m for m in self.models if m.hf_id == name), None)
