"""Prompt-cache breakpoints: where a client's marked blocks end in the rendered prompt.

A client marks what the prefix cache should keep: Anthropic's ``cache_control`` on a
system block, a tool, a message or one of its content blocks; OpenAI's
``prompt_cache_breakpoint`` on a content part. Each adapter puts a ``CacheMark`` (its TTL
in seconds) on the part (``app.messages``) or the tool (``Tool.cache``). The chat template
then renders the conversation its own way (system messages gathered into one, turns
merged, tools as JSON or as a note), so where a part ends in the prompt's tokens is asked
of the template rather than computed: the request is rendered again with a sentinel just
after the marked part (after the marked tool, a sentinel tool), and the breakpoint is where
the two prompts' tokens part. Where the part's last token would merge with what follows
it, the breakpoint falls one token short of the block's end: the cached prefix is still a
prefix of the next request's prompt, which is all the cache needs.

The latest ``MAX_BREAKPOINTS`` marks are kept, in request order (tools, then messages):
Anthropic refuses more at its edge, and OpenAI writes up to four. Each becomes a
``CacheBreakpoint(tokens, ttl_s)`` on the ``GenerationRequest``, one per position (the
longest TTL where two fall together); a mark whose sentinel changes nothing (a tool the
request's ``tool_choice`` hides) gives none. Text prompts only: a native VLM's image runs
are not placed yet.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from app.engine import CacheBreakpoint
from app.pipeline.request import Message, TextPart, Tool

# What the second rendering adds: an invisible separator and a sign no template writes.
SENTINEL = "\u2063\u00a7"
MAX_BREAKPOINTS = 4

# Renders messages and tools as the request would be rendered, into its prompt's tokens.
Variant = Callable[[tuple[Message, ...], tuple[Tool, ...]], list[int]]


@dataclass(frozen=True)
class Mark:
    """A marked part (``message`` and ``part`` index) or tool (``message`` None, ``part`` its index)."""

    message: int | None
    part: int
    ttl_s: int


def marks(messages: Sequence[Message], tools: Sequence[Tool]) -> list[Mark]:
    """The latest ``MAX_BREAKPOINTS`` marks, in request order: tools, then messages."""
    found = [Mark(None, k, t.cache.ttl_s) for k, t in enumerate(tools) if t.cache is not None]
    found += [Mark(i, j, p.cache.ttl_s) for i, m in enumerate(messages) for j, p in enumerate(m.content)
              if p.cache is not None]
    return found[-MAX_BREAKPOINTS:]


def with_sentinel(messages: tuple[Message, ...], tools: tuple[Tool, ...], mark: Mark
                  ) -> tuple[tuple[Message, ...], tuple[Tool, ...]]:
    """The request's messages and tools with the sentinel just after ``mark``."""
    if mark.message is None:
        k = mark.part
        return messages, (*tools[:k + 1], Tool(SENTINEL, SENTINEL), *tools[k + 1:])
    message = messages[mark.message]
    parts = list(message.content)
    part = parts[mark.part]
    if isinstance(part, TextPart):
        parts[mark.part] = replace(part, text=part.text + SENTINEL)
    else:  # an image: the sentinel as the text that follows it
        parts.insert(mark.part + 1, TextPart(SENTINEL))
    changed = replace(message, content=tuple(parts))
    return (*messages[:mark.message], changed, *messages[mark.message + 1:]), tools


def breakpoints(tokens: Sequence[int], messages: tuple[Message, ...], tools: tuple[Tool, ...],
                variant: Variant) -> tuple[CacheBreakpoint, ...]:
    """Where each kept mark ends in ``tokens`` (the request's prompt), by rendering the
    request again with the sentinel after it (``variant``)."""
    at: dict[int, int] = {}
    for mark in marks(messages, tools):
        n = common_length(tokens, variant(*with_sentinel(messages, tools, mark)))
        if 0 < n < len(tokens):
            at[n] = max(at.get(n, 0), mark.ttl_s)
    return tuple(CacheBreakpoint(n, ttl) for n, ttl in sorted(at.items()))


def common_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
