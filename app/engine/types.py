"""Plain data passed between the request pipeline and the engine thread, and the
``Engine`` protocol at that seam."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from app.engine.prompt import Prompt, PromptBuilder


@dataclass
class DraftCounts:
    """Proposed and accepted tokens, for one drafter of one model (/metrics, /health)."""

    proposed: int = 0
    accepted: int = 0
    # Verify steps that carried this drafter's proposals.
    steps: int = 0


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, already merged with the model's defaults.

    No defaults here: a request's values come from the request, else from its model's
    models.yaml params (``ChatParams``: temperature 0.7 unless the entry says), merged by
    ``pipeline.sampling_for``. ``GREEDY`` names the neutral values, for generations that
    no request or model default applies to (a caption)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    frequency_penalty: float
    presence_penalty: float
    repetition_penalty: float
    seed: int | None
    # Token id -> bias added to its logit before sampling.
    logit_bias: tuple[tuple[int, float], ...]


# Each transform off: temperature 0 takes the most likely token; top_p 1, top_k 0 and min_p 0 keep
# every token; penalties 0 (repetition 1) change nothing.
GREEDY = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, frequency_penalty=0.0,
                        presence_penalty=0.0, repetition_penalty=1.0, seed=None, logit_bias=())


class ConstraintProcessor(Protocol):
    """One sequence's constraint: an mlx-lm logits processor ``(context, logits) -> logits``
    that never raises, and says afterwards whether it failed."""

    def __call__(self, tokens: Any, logits: Any) -> Any: ...

    def failure(self) -> BaseException | None:
        """Why the constraint stopped holding (a grammar limit hit mid-run), or None. The
        processor then allows only EOS; the engine ends the sequence with this error, never
        as a normal stop, since the text so far does not follow the constraint."""
        ...


@runtime_checkable
class SpeculableConstraint(ConstraintProcessor, Protocol):
    """A constraint a speculating row can carry (``app.engine.step.verify``): it cuts a
    proposal where it would refuse it, and gives back what a verify step rejected. A row
    whose constraint lacks these does not speculate."""

    def allowed(self, tokens: Sequence[int], draft: Sequence[int]) -> int:
        """How many of ``draft``'s tokens it accepts after ``tokens`` (the row's context)."""
        ...

    def rewind(self, context_len: int) -> None:
        """The row's context is ``context_len`` tokens again: forget what came after."""
        ...


class LogitsConstraint(Protocol):
    """A compiled constraint (``app.engine.constrain.grammar.Grammar``): one logits processor per sequence."""

    def processor(self, prompt_len: int) -> ConstraintProcessor:
        """A fresh processor for a sequence whose first ``prompt_len`` context tokens are prompt."""
        ...


@dataclass(frozen=True)
class ReasoningBlock:
    """The reasoning block a generation may write, as the engine tracks it
    (``app.engine.step.reasoning``): counted token by token, and closed by force
    when ``budget`` runs out."""

    opener: str
    closer: str
    # The closer as token ids, emitted in turn when the budget is spent ([/THINK] is one
    # special token in Mistral tokenizers; </think> one in Qwen3's).
    close_ids: tuple[int, ...]
    # The prompt opened the block (Qwen3's generation prompt ends in "<think>\n"): output starts inside it.
    started: bool = False
    # Reasoning tokens allowed before the block is closed; None: no limit but max_tokens.
    budget: int | None = None


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to generate: a prompt in (``app.engine.prompt``), text out."""

    prompt: Prompt
    max_tokens: int
    sampling: SamplingParams = GREEDY
    # Generation ends just before the first of these strings; it is not emitted.
    stop: tuple[str, ...] = ()
    # Length of a prompt prefix (system prompt, first message) worth caching on its own.
    cache_prefix_len: int | None = None
    request_id: str = ""
    # "background" work yields batch slots to "interactive" work waiting for its first token.
    priority: str = "interactive"
    # Prefix-cache partition: cached prefixes are shared only between requests with the same one.
    cache_namespace: str = ""
    # Per generated token: its logprob and this many alternatives (None: no logprobs).
    logprobs: int | None = None
    # Keep this prompt (all but its last token) in the prefix cache whatever the cache mode,
    # for sibling generations of the same request (n > 1) to reuse.
    share_prefix: bool = False
    # Constrained decoding (``app.engine.constrain.grammar``); None adds no processor and costs nothing.
    constraint: LogitsConstraint | None = None
    # The reasoning block the model may write: its tokens counted (``TokenDelta.reasoning_tokens``)
    # and, with a budget, ended by force. None: the output is not read for reasoning.
    reasoning: ReasoningBlock | None = None
    # The stream's first delta is an empty one (``tokens`` 0) as soon as the request is
    # queued, its submission checks passed: a streaming answer can start before the
    # queue wait and the prefill, which take minutes for a long prompt on a small machine.
    announce_queued: bool = False
    # Speculative decoding for this request (``app.engine.speculative``): None takes the
    # model's defaults (models.yaml ``speculative``).
    speculation: SpeculationRequest | None = None
    # A prefill-only row (a score row of the engine's step): the prompt's log-probabilities are
    # read and nothing is generated (``max_tokens`` is ignored); the final delta carries them,
    # with finish reason ``SCORED``.
    score: ScoreRequest | None = None
    # Where the client asked the prefix cache to keep this prompt (Anthropic's ``cache_control``,
    # OpenAI's ``prompt_cache_breakpoint``), in prompt order: the engine stores an entry ending
    # exactly at each (or, cached already, pins that one) and keeps it for its TTL ahead of
    # unmarked entries, within the tier's ``pin_share``.
    cache_breakpoints: tuple[CacheBreakpoint, ...] = ()
    # Whether the engine may also cache this prompt where it chooses (OpenAI's
    # ``prompt_cache_options.mode`` "implicit", the default: the conversation at its end, the
    # prefix ``cache_prefix_len`` names); False ("explicit"): only at ``cache_breakpoints``.
    cache_implicit: bool = True

    @property
    def prompt_tokens(self) -> list[int]:
        """The prompt's exact token ids (a multimodal prompt's image runs expanded)."""
        return self.prompt.tokens


@dataclass(frozen=True)
class SpeculationRequest:
    """What one request asks of speculative decoding (``app.engine.speculative``)."""

    # OpenAI's Predicted Outputs: the predicted content's token ids, proposed where the
    # output so far matches them (empty: no prediction).
    prediction: tuple[int, ...] = ()
    # Per-request switches for the model's drafters; None keeps the models.yaml setting.
    prompt_lookup: bool | None = None
    draft: bool | None = None


# The finish reason (and outcome) of a prefill-only row: read, nothing generated.
SCORED = "scored"


@dataclass(frozen=True)
class ScoreRequest:
    """What a prefill-only row reads (``GenerationRequest.score``; the step's score rows,
    ``app.engine.step``). Its answer is a ``ScoreResult`` on the final delta, whose ``tokens`` is 0."""

    # Log-probabilities of the prompt's last ``tail`` tokens, each given every token before it
    # (a whole option scored as a token sequence). At most the prompt's length less one.
    tail: int = 0
    # log p(token | the whole prompt) for each of these token ids (options told apart by their
    # first token, read at the answer's first position).
    next_tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class ScoreResult:
    """A prefill-only row's answer: natural-log probabilities, in the request's order."""

    # One per token of ``ScoreRequest.tail``, the earliest first.
    tail: tuple[float, ...] = ()
    # One per id of ``ScoreRequest.next_tokens``.
    next_tokens: tuple[float, ...] = ()


@dataclass(frozen=True)
class CacheBreakpoint:
    """A point a client asked the prefix cache to keep: the prompt's first ``tokens`` tokens
    (where the marked block ends), for ``ttl_s`` seconds."""

    tokens: int
    ttl_s: int


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability, and the most likely alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class TokenDelta:
    """What the engine sends back for one sequence: new text, and the end when it comes."""

    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    # One per generated token in this delta, when the request asked for logprobs.
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # Set on the final delta only.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # Of completion_tokens, those written inside the reasoning block (its markers aside).
    reasoning_tokens: int = 0
    # The stop string that ended the generation (finish_reason "stop"), if one did.
    stop_sequence: str | None = None
    # Of the tokens the client's prediction proposed (``SpeculationRequest.prediction``),
    # those the model kept and those it refused (OpenAI's Predicted Outputs usage).
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    # Prompt tokens whose KV this generation wrote to the prefix cache where the request asked
    # (``cache_breakpoints``) or, for a scored row, where its shared prefix ends: the last such
    # point's length less what was read from the cache.
    cache_write_tokens: int = 0
    # A scored row's answer (``GenerationRequest.score``), on its final delta.
    scores: ScoreResult | None = None
    error: BaseException | None = None


@dataclass(frozen=True)
class GenerationRecord:
    """A generation that ended, however it ended: what the engine tells its listeners
    (metrics, the log) once, from the MLX thread. Cancelled and failed generations
    report the tokens they really used."""

    request_id: str
    model: str
    # "stop" | "length" (finished), "scored" (a prefill-only row read), "cancelled" (the client
    # left or shutdown), "error"
    outcome: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    # From submission (queue wait and prefill included) to the first token; None if none came.
    ttft_s: float | None
    total_s: float
    # Seconds between consecutive generated tokens.
    token_gaps_s: tuple[float, ...] = ()
    # The error code (or type name) when outcome is "error".
    error: str | None = None


@dataclass
class CacheTierStats:
    """One cache's (or prefix-cache tier's: ``memory``, ``disk``) figures, for /health and /metrics."""

    hits: int = 0
    # Lookups that found nothing (counted by the vision-feature cache).
    misses: int = 0
    # Prompt tokens served from this tier (prefill they saved).
    tokens: int = 0
    bytes: int = 0
    entries: int = 0
    evictions: int = 0
    budget_bytes: int = 0
    # Disk tier only: writes done, dropped (queue full, or larger than the budget), failed;
    # files found damaged and ignored; writes queued now.
    writes: int = 0
    write_drops: int = 0
    write_errors: int = 0
    damaged: int = 0
    pending: int = 0


@dataclass
class EngineStats:
    """A snapshot for /health and /metrics."""

    alive: bool
    active: int
    waiting: int
    kv_budget_tokens: int
    kv_reserved_tokens: int
    prompt_cache_bytes: int
    # The KV budget and what the admitted rows may make MLX hold, in bytes (every layer as it
    # grows: ``app.engine.kv.geometry``).
    kv_budget_bytes: int = 0
    kv_reserved_bytes: int = 0
    # Per layer kind ("kv", "quantized", "rotating", "state"): layers, bytes per token, bytes
    # per row, window (``KVGeometry.summary``).
    kv_layers: dict[str, Any] = field(default_factory=dict)
    prompt_cache_hits: int = 0
    prompt_cache_tokens_saved: int = 0
    # Background sequences paused for interactive work: now, and pauses so far.
    paused: int = 0
    background_pauses: int = 0
    # Rows paused because the KV budget could not take their growth (their KV to the prefix cache).
    memory_pauses: int = 0
    # Bytes MLX's KV caches hold now (batch rows, paused sequences, the memory tier), measured
    # after each step; kv_reserved_bytes plus prompt_cache_bytes bounds it from above.
    kv_cache_bytes: int = 0
    # The longest prompt + max_tokens one request can have within the KV budget.
    kv_max_sequence_tokens: int = 0
    # Per prefix-cache tier: "memory", and "disk" when it is on.
    prompt_cache_tiers: dict[str, CacheTierStats] = field(default_factory=dict)
    # A native VLM's vision-feature cache (None: none); its ``tokens`` are image tokens served.
    vision_feature_cache: CacheTierStats | None = None
    # Images the vision tower encoded, and its seconds in all.
    vision_encoded_images: int = 0
    vision_encode_s: float = 0.0
    # Speculative decoding per drafter ("prediction", "prompt_lookup", "draft"): tokens
    # proposed and accepted so far (``app.engine.speculative.DraftCounts``).
    speculation: dict[str, DraftCounts] = field(default_factory=dict)


class ModelHandle(Protocol):
    """What the registry and shutdown need of any loaded model, whatever its role
    (``app/engine/roles.py``): a chat engine, a VLM, an encoder."""

    @property
    def name(self) -> str:
        """The model's name (its models.yaml entry)."""

    @property
    def in_flight(self) -> int:
        """Requests queued or running."""

    def stop_accepting(self) -> None:
        """Refuse new requests (shutdown)."""

    def abort_all(self, exc: BaseException) -> Future[None]:
        """End every queued and running request with ``exc``."""

    def end_streams(self, exc: BaseException) -> None:
        """End every open stream with ``exc`` from the event loop, without the MLX thread."""

    def finish_writes(self, timeout: float) -> bool:
        """Finish background work already queued at shutdown; whether in time."""

    def close(self) -> None:
        """Free the model (the registry's unload; MLX thread)."""


class Engine(ModelHandle, Protocol):
    """A chat model's generation engine, as the pipeline and the app state see it."""

    tokenizer: Any
    # Renders this model's requests into prompts (its chat template, its processor).
    prompts: PromptBuilder

    @property
    def max_model_len(self) -> int:
        """The context length in tokens."""

    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary size, when its config says."""

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV cache one token takes."""

    def stream(self, req: GenerationRequest) -> AsyncGenerator[TokenDelta, None]:
        """Deltas of one generation, the last carrying finish_reason; errors are raised. With
        ``req.announce_queued``, an empty delta (``tokens`` 0) first, once it is queued."""

    def stats(self) -> EngineStats:
        """A snapshot for /health and /metrics."""

    def add_listener(self, listener: Callable[[GenerationRecord], None]) -> None:
        """Be told of every generation that ends."""
