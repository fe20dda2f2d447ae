"""Plain data passed between the API layer and the engine thread."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, already merged with the model's defaults."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None


class LogitsConstraint(Protocol):
    """A compiled constraint (``app.engine.grammar.Grammar``): one logits processor per sequence."""

    def processor(self, prompt_len: int) -> Callable[[Any, Any], Any]:
        """A fresh processor for a sequence whose first ``prompt_len`` context tokens are prompt."""
        ...


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to generate: token ids in, text out."""

    prompt_tokens: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    # Generation ends just before the first of these strings; it is not emitted.
    stop: tuple[str, ...] = ()
    # Length of a prompt prefix (system prompt, first message) worth caching on its own.
    cache_prefix_len: int | None = None
    request_id: str = ""
    # Constrained decoding (``app.engine.grammar``); None adds no processor and costs nothing.
    constraint: LogitsConstraint | None = None


@dataclass
class TokenDelta:
    """What the engine sends back for one sequence: new text, and the end when it comes."""

    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    # Set on the final delta only.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: BaseException | None = None


@dataclass
class EngineStats:
    """A snapshot for /health and /metrics."""

    alive: bool
    active: int
    waiting: int
    kv_budget_tokens: int
    kv_reserved_tokens: int
    prompt_cache_bytes: int
    prompt_cache_hits: int = 0
    prompt_cache_tokens_saved: int = 0
