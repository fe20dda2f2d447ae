"""What stream parsers emit, and the fold of those events into one message.

A parser turns generated text into a flat list of events. Streaming renders
each event as it comes; non-streaming folds the very same events with
``collect``, so the two paths cannot disagree.

One tool call is ``ToolCallStart``, any number of ``ToolCallArgsDelta`` (their
texts concatenated are the JSON arguments object) and ``ToolCallEnd``. A call
that cannot be parsed ends with ``ToolCallError`` instead of ``ToolCallEnd``,
followed by a ``ContentDelta`` holding the raw text, so nothing is lost.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ReasoningDelta:
    """A piece of the model's reasoning, markers stripped."""

    text: str


@dataclass(frozen=True)
class ContentDelta:
    """A piece of the answer text, markers stripped."""

    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call began: its position in the message, id and function name."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgsDelta:
    """More of the arguments JSON of call ``index``."""

    index: int
    text: str


@dataclass(frozen=True)
class ToolCallEnd:
    """Call ``index`` is complete; its argument deltas form a JSON object."""

    index: int


@dataclass(frozen=True)
class ToolCallError:
    """Text that announced a tool call but could not be parsed.

    ``raw`` is the model's text, markers included; the parser also emits it as
    a ``ContentDelta``. ``index`` is set when a ``ToolCallStart`` for this call
    was already emitted (streamed formats find errors late); that call never
    gets a ``ToolCallEnd``.
    """

    message: str
    raw: str
    index: int | None = None


Event = ReasoningDelta | ContentDelta | ToolCallStart | ToolCallArgsDelta | ToolCallEnd | ToolCallError


@dataclass(frozen=True)
class ParsedToolCall:
    """One complete tool call, as a non-streaming response lists it."""

    id: str
    name: str
    arguments_json: str


@dataclass(frozen=True)
class ParsedOutput:
    """The non-streaming view of a parser's events.

    ``reasoning_chunks`` are the reasoning deltas as they were streamed, and
    ``tool_call_chunks`` the tool-call events of the completed calls in the
    shape of the response's ``extensions.tool_call_chunks``:
    ``{"type": "start", "tool_call_id", "tool_name"}``,
    ``{"type": "args", "tool_call_id", "delta"}``, ``{"type": "end", "tool_call_id"}``.
    """

    content: str
    reasoning: str
    tool_calls: list[ParsedToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    reasoning_chunks: list[str] = field(default_factory=list)
    tool_call_chunks: list[dict[str, str]] = field(default_factory=list)


def collect(events: Iterable[Event]) -> ParsedOutput:
    """Fold a parser's events into content, reasoning, complete calls and errors.

    Calls that started but never ended (their ``ToolCallError`` carries the
    index) are left out of ``tool_calls`` and ``tool_call_chunks``.
    """
    events = list(events)
    ended = {ev.index for ev in events if isinstance(ev, ToolCallEnd)}
    starts: dict[int, ToolCallStart] = {}
    args: dict[int, list[str]] = {}
    chunks: list[dict[str, str]] = []
    for ev in events:
        if isinstance(ev, ToolCallStart):
            starts[ev.index] = ev
            args[ev.index] = []
            if ev.index in ended:
                chunks.append({"type": "start", "tool_call_id": ev.id, "tool_name": ev.name})
        elif isinstance(ev, ToolCallArgsDelta) and ev.index in args:
            args[ev.index].append(ev.text)
            if ev.index in ended:
                chunks.append({"type": "args", "tool_call_id": starts[ev.index].id, "delta": ev.text})
        elif isinstance(ev, ToolCallEnd) and ev.index in starts:
            chunks.append({"type": "end", "tool_call_id": starts[ev.index].id})
    return ParsedOutput(
        content="".join(ev.text for ev in events if isinstance(ev, ContentDelta)),
        reasoning="".join(ev.text for ev in events if isinstance(ev, ReasoningDelta)),
        tool_calls=[
            ParsedToolCall(start.id, start.name, "".join(args[i]))
            for i, start in starts.items()
            if i in ended
        ],
        errors=[ev.message for ev in events if isinstance(ev, ToolCallError)],
        reasoning_chunks=[ev.text for ev in events if isinstance(ev, ReasoningDelta)],
        tool_call_chunks=chunks,
    )
