"""Stream parsers for reasoning and tool calls, one state machine run by each model family's data.

A parser turns a model's generated text, in chunks of any size, into events
(``events.py``); non-streaming feeds the whole text, then ``collect`` folds
the events. Nothing here imports the API, the engine, Litestar or MLX.

    make_parser("qwen", reasoning=True)          # the family named in models.yaml
    make_parser(detect_parser(name, template), reasoning=True, tools_offered=True)

The families themselves (markers, call syntax, detection hints) are data in
``app.families``; ``PARSERS`` is their registry, keyed by the ``tool_parser:``
value users type in models.yaml.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from app.errors import ConfigError
from app.families import FAMILIES, REASONING_MARKERS, Family, new_call_id
from app.parsers.base import FamilyParser, StreamParser
from app.parsers.detect import detect_parser, is_reasoning_model, template_opens_reasoning
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
    collect,
)
from app.parsers.harmony import HarmonyParser

# A parser family's name is its tool_parser (and reasoning_parser) value.
PARSERS: dict[str, Family] = FAMILIES


def make_parser(
    name: str,
    *,
    reasoning: bool,
    starts_in_reasoning: bool = False,
    tools_offered: bool = False,
    id_factory: Callable[[], str] | None = None,
    tools: Mapping[str, Any] | None = None,
    primer: str = "",
) -> StreamParser:
    """A fresh parser of family ``name`` for one response.

    ``reasoning``: reasoning markers are read (thinking is on for the request).
    ``starts_in_reasoning``: the prompt opened the reasoning block.
    ``tools_offered``: the request offered tools: call markers (and a bare JSON call
    object) are read as calls; otherwise they stay content.
    ``id_factory``: makes tool call ids (default ``call_`` + 24 random alphanumerics).
    ``tools``: the offered tools' parameter schemas by name, which say what arguments
    written as text mean (``arg_types``).
    ``primer``: a call marker the prompt ended with, read as if the model wrote it.
    """
    family = PARSERS.get(name)
    if family is None:
        raise ConfigError(f"unknown tool_parser {name!r}; known: {', '.join(sorted(PARSERS))}")
    return parser_for(family, reasoning=reasoning, starts_in_reasoning=starts_in_reasoning,
                      tools_offered=tools_offered, id_factory=id_factory, tools=tools, primer=primer)


def parser_for(
    family: Family,
    *,
    reasoning: bool,
    starts_in_reasoning: bool = False,
    tools_offered: bool = False,
    id_factory: Callable[[], str] | None = None,
    tools: Mapping[str, Any] | None = None,
    primer: str = "",
) -> StreamParser:
    """``make_parser`` for a ``Family`` value (detection tries one syntax of a family at a time)."""
    if family.channels:
        return HarmonyParser(family, tools_offered=tools_offered, id_factory=id_factory, tools=tools)
    return FamilyParser(
        family,
        reasoning=reasoning,
        starts_in_reasoning=starts_in_reasoning,
        tools_offered=tools_offered,
        id_factory=id_factory,
        tools=tools,
        primer=primer,
    )


__all__ = [
    "PARSERS",
    "REASONING_MARKERS",
    "ContentDelta",
    "Event",
    "Family",
    "ParsedOutput",
    "ParsedToolCall",
    "ReasoningDelta",
    "StreamParser",
    "ToolCallArgsDelta",
    "ToolCallEnd",
    "ToolCallError",
    "ToolCallStart",
    "collect",
    "detect_parser",
    "is_reasoning_model",
    "make_parser",
    "parser_for",
    "new_call_id",
    "template_opens_reasoning",
]
