"""What a generation gives back, typed, for every wire format to render.

Streaming yields one ``Step`` per engine delta (the parser's events for that
text, and on the last one the finish reason and usage); non-streaming folds the
same steps into one ``Completion``. Like llama.cpp's server task results, the
pipeline produces these once and each wire format renders them its own way
(``to_json_oaicompat_chat``, ``to_json_anthropic``, ...).

The events a step carries are the parsers' (``app/parsers/events.py``); this module
names them for the wire formats, which reach the rest of Tandem only through the
pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from app.parsers import collect
from app.parsers.events import (
    ContentDelta,
    Event,
    ParsedOutput,
    ParsedToolCall,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallError,
    ToolCallStart,
)
from app.pipeline.logprobs import LogprobInfo

__all__ = ["Completion", "ContentDelta", "Event", "ParsedOutput", "ParsedToolCall", "ReasoningDelta", "Step",
           "ToolCallArgsDelta", "ToolCallEnd", "ToolCallError", "ToolCallStart", "Usage", "total_usage"]


@dataclass(frozen=True)
class Usage:
    """Tokens one generation used."""

    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens whose KV came from the prefix cache.
    cached_tokens: int = 0
    # Of completion_tokens, those the model spent inside its reasoning block (markers aside).
    reasoning_tokens: int = 0
    # Of the prediction's tokens (OpenAI's Predicted Outputs), those that appear in the
    # completion and those that do not (``app.pipeline.predicted``).
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    # Prompt tokens written to the prefix cache where the request asked (its breakpoints), or a
    # decision's shared input; 0 for generations until the engine stores at breakpoints.
    cache_write_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Step:
    """What one engine delta became. A choice's first step is empty (``tokens`` 0): the
    engine has queued it, so a stream can start before the first token."""

    # The parser's events for this delta (empty for plain-text completions).
    events: list[Event]
    # The raw generated text of this delta (stop strings already cut).
    text: str = ""
    # Set on the last step: "stop" or "length".
    finish_reason: str | None = None
    usage: Usage | None = None
    # Which choice (n > 1) this step belongs to.
    index: int = 0
    # One per generated token of this step, when the request asked for logprobs.
    logprobs: list[LogprobInfo] = field(default_factory=list)
    # Set on the last step when one of the request's stop strings ended the generation.
    stop_sequence: str | None = None
    # Tokens generated in this step: one, or several the engine's channel merged for a slow
    # reader; 0 on the first step, which only says the request is queued.
    tokens: int = 1


@dataclass
class Completion:
    """A whole generation: the non-streaming answer of every wire format."""

    parsed: ParsedOutput
    # The raw generated text (what /v1/completions returns).
    text: str
    # "stop" or "length", as the engine ended it; formats map it ("tool_calls", "end_turn", ...).
    finish_reason: str
    usage: Usage
    events: list[Event] = field(default_factory=list)
    index: int = 0
    logprobs: list[LogprobInfo] = field(default_factory=list)
    # The stop string that ended the generation, if one did.
    stop_sequence: str | None = None

    @classmethod
    def fold(cls, steps: list[Step]) -> Completion:
        """The steps of one generation, folded; the last one carries the end."""
        last = steps[-1]
        assert last.finish_reason is not None and last.usage is not None
        events = [ev for s in steps for ev in s.events]
        return cls(collect(events), "".join(s.text for s in steps), last.finish_reason, last.usage, events,
                   last.index, [lp for s in steps for lp in s.logprobs], last.stop_sequence)

    @classmethod
    def fold_choices(cls, steps: list[Step]) -> list[Completion]:
        """The steps of ``n`` interleaved generations, folded per choice, in choice order."""
        by_index: dict[int, list[Step]] = {}
        for step in steps:
            by_index.setdefault(step.index, []).append(step)
        return [cls.fold(by_index[i]) for i in sorted(by_index)]


def total_usage(usages: list[Usage]) -> Usage:
    """One request's usage over its choices: the prompt counted once, completions summed."""
    return Usage(usages[0].prompt_tokens, sum(u.completion_tokens for u in usages), usages[0].cached_tokens,
                 sum(u.reasoning_tokens for u in usages), sum(u.accepted_prediction_tokens for u in usages),
                 sum(u.rejected_prediction_tokens for u in usages), usages[0].cache_write_tokens)
