"""Tool-call formats: how a call is read once its start marker is seen.

A family (``app.families``) describes its calls as a ``CallSyntax``;
``formats.call_format`` turns one into the format that reads it. Each format opens a
reader that takes the text after the marker and emits call events until the
call ends, then hands back the text that follows. The formats:

    TaggedJson    <tool_call>{"name": "f", "arguments": {...}}</tool_call>
    bare JSON     {"name": "f", "arguments": {...}} as the whole output

and the formats that put the name in a header (``named_calls``)::

    NamedTag      <function=f>{...}</function>
    NameThenArgs  [TOOL_CALLS]f[ARGS]{...}   or   [TOOL_CALLS][{"name": "f", ...}]

A call that cannot be read becomes ``ToolCallError`` plus its raw text as
content. A call header that goes wrong (no valid name where one belongs)
turns the rest of the output into content: where exactly it went wrong may
depend on how the text was chunked, and the result must not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

from app.parsers.events import Event, ToolCallArgsDelta, ToolCallEnd, ToolCallStart
from app.parsers.json_args import (
    HEAD,
    ArgsStream,
    CallSpec,
    JsonValueReader,
    could_be_call,
    decode,
    parse_calls,
    same_arguments,
)
from app.streamtext import split_marker

# Function names: OpenAI allows [A-Za-z0-9_-]; MCP-style names add dots and colons.
NAME = re.compile(r"[\w.:-]{1,128}")
# A call header longer than this is not a header.
MAX_HEADER = 512
HEADER_ERROR = "malformed tool call: no valid function name"


class CallContext(Protocol):
    """What a call reader needs from the parser that opened it."""

    def start_call(self, name: str) -> ToolCallStart:
        """Number the next call and give it an id."""

    def fail_call(self, message: str, raw: str, index: int | None = None) -> list[Event]:
        """Report a call that cannot be read, and keep its raw text as content."""

    def content(self, text: str) -> list[Event]:
        """Send ordinary content."""

    def decline(self) -> None:
        """Bare JSON was not a call after all: stop looking for one."""

    def schema(self, name: str) -> dict[str, Any] | None:
        """The parameters schema of the offered tool ``name`` (None when it has none)."""

    @property
    def calls_allowed(self) -> bool:
        """Whether the request offered tools (a recipient header is read without them)."""


class CallReader(Protocol):
    """Reads a tool call (or a run of them) from the text after its marker."""

    def feed(self, text: str) -> tuple[list[Event], str | None]:
        """Events so far, and once the call has ended the text after it."""

    def finish(self) -> tuple[list[Event], str]:
        """Output ended inside the call: events, and text to read as ordinary output."""


class CallFormat(Protocol):
    """A tool-call format, known by the markers that start it."""

    @property
    def starts(self) -> tuple[str, ...]:
        """The markers that open a call."""

    def open(self, ctx: CallContext, marker: str) -> CallReader:
        """A reader for one call whose start ``marker`` was just seen."""


def emit_calls(ctx: CallContext, calls: list[CallSpec]) -> list[Event]:
    """Events for calls that were parsed whole."""
    events: list[Event] = []
    for call in calls:
        start = ctx.start_call(call.name)
        events += [start, ToolCallArgsDelta(start.index, call.arguments_json), ToolCallEnd(start.index)]
    return events


class _ObjectCall:
    """A ``{"name": ..., "arguments": {...}}`` call whose text arrives in pieces.

    Once the head up to the arguments value is in, the call starts and the
    arguments stream; with another key order it is parsed whole at the end.
    """

    def __init__(self, ctx: CallContext, *, need_arguments: bool = False, keyed: bool = False) -> None:
        self._ctx = ctx
        self._need_arguments = need_arguments
        self._keyed = keyed
        self.text = ""
        self.index: int | None = None
        self._args: ArgsStream | None = None
        self._tail = ""

    def push(self, text: str) -> list[Event]:
        """Read more of the call's text."""
        self.text += text
        if self._args is None:
            return self._try_start()
        return self._push_args(text)

    def _try_start(self) -> list[Event]:
        match = HEAD.match(self.text)
        if match is None:
            return []
        name, error = decode(match.group(1))
        if error or not isinstance(name, str) or not name.strip():
            return []  # close() reports it
        start = self._ctx.start_call(name.strip())
        self.index = start.index
        self._args = ArgsStream(start.index)
        return [start, *self._push_args(self.text[match.end() :])]

    def _push_args(self, text: str) -> list[Event]:
        assert self._args is not None
        events, used = self._args.push(text)
        self._tail += text[used:]
        return events

    def close(self) -> list[Event] | str:
        """The events that complete the call(s), or why the text is not a call."""
        calls = parse_calls(self.text, need_arguments=self._need_arguments, keyed=self._keyed)
        if self._args is None or self.index is None:
            return calls if isinstance(calls, str) else emit_calls(self._ctx, calls)
        if isinstance(calls, list) and calls:
            # One call, or the first of a block of call objects one a line (MiniMax M1).
            rest = emit_calls(self._ctx, calls[1:])
            streamed = self._args.streamed
            if streamed is None:
                return [ToolCallArgsDelta(self.index, calls[0].arguments_json), ToolCallEnd(self.index), *rest]
            if same_arguments(streamed, calls[0].arguments_json):
                return [ToolCallEnd(self.index), *rest]
            return "tool call arguments are ambiguous"
        if self._args.done and not self._tail.strip():
            # Models sometimes drop the object's final brace; the arguments are whole.
            return self._args.finish()
        return calls if isinstance(calls, str) else "expected one tool call"


@dataclass(frozen=True)
class TaggedJson:
    """A call object (or a list of them) after a tag: ``<tool_call>{"name": ..., "arguments":
    ...}</tool_call>``; with no end tag, up to where the JSON value ends (GigaChat)."""

    start: str
    end: str
    keyed: bool = False

    @property
    def starts(self) -> tuple[str, ...]:
        return (self.start,)

    def open(self, ctx: CallContext, marker: str) -> CallReader:
        """A reader for the call object up to the end tag."""
        if not self.end:
            return BareJson(ctx, strict=True, prefix=self.start, keyed=self.keyed)
        return _TaggedJsonReader(ctx, self)


class _TaggedJsonReader:
    def __init__(self, ctx: CallContext, fmt: TaggedJson) -> None:
        self._ctx = ctx
        self._fmt = fmt
        self._body = _ObjectCall(ctx, keyed=fmt.keyed)
        self._held = ""

    def feed(self, text: str) -> tuple[list[Event], str | None]:
        before, marker, after = split_marker(self._held + text, (self._fmt.end,))
        events = self._body.push(before)
        if marker is None:
            self._held = after
            return events, None
        return events + self._close(marker), after

    def finish(self) -> tuple[list[Event], str]:
        # No end tag (cut off or forgotten): the body may still be a whole call.
        return self._close(self._held), ""

    def _close(self, end: str) -> list[Event]:
        result = self._body.close()
        if isinstance(result, str):
            return self._ctx.fail_call(result, self._fmt.start + self._body.text + end, self._body.index)
        return result


class _CallList:
    """A JSON list of call objects whose elements go out as calls as each one closes, so a
    list that max_tokens cuts keeps its complete calls (issue 30: a forced call's list)."""

    def __init__(self, ctx: CallContext, *, need_arguments: bool, keyed: bool) -> None:
        self._ctx = ctx
        self._need_arguments = need_arguments
        self._keyed = keyed
        self.text = ""
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._element = -1  # where the open element starts in ``text``
        self.calls = 0
        self.failed: str | None = None
        self.declined = False

    def push(self, text: str) -> list[Event]:
        events: list[Event] = []
        for ch in text:
            self.text += ch
            if self.failed or self.declined:
                continue
            if self._in_string:
                self._escaped = not self._escaped and ch == "\\"
                self._in_string = self._escaped or ch != '"'
                continue
            if ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
                if self._depth == 2:
                    self._element = len(self.text) - 1
            elif ch in "]}":
                self._depth -= 1
                if self._depth == 1 and self._element >= 0:
                    events += self._close_element(self.text[self._element:])
                    self._element = -1
        return events

    def _close_element(self, source: str) -> list[Event]:
        calls = parse_calls(source, need_arguments=self._need_arguments, keyed=self._keyed)
        if isinstance(calls, str) or len(calls) != 1:
            if not self.calls and self._need_arguments:
                self.declined = True  # bare JSON that is not a list of calls: an answer
            else:
                self.failed = calls if isinstance(calls, str) else "expected one tool call a list element"
            return []
        self.calls += 1
        return emit_calls(self._ctx, calls)

    @property
    def cut(self) -> str:
        """The text of the element output ended in (what max_tokens cut)."""
        return self.text[self._element:] if self._element >= 0 else ""


class BareJson:
    """``{"name": ..., "arguments": ...}`` or a list of those, without markers.

    Not a marker format: the parser opens it when content starts with ``{`` or
    ``[`` and tools were offered. ``strict`` (after an explicit call marker)
    reports what is not a call as an error; otherwise it goes out as content.
    A list's calls go out one by one as their objects close; a list cut short
    keeps its complete calls, and the cut one is an error.
    """

    def __init__(self, ctx: CallContext, *, strict: bool = False, prefix: str = "", keyed: bool = False) -> None:
        self._ctx = ctx
        self._strict = strict
        self._prefix = prefix
        self._reader = JsonValueReader()
        self._text = ""
        self._body = _ObjectCall(ctx, need_arguments=not strict, keyed=keyed)
        self._list = _CallList(ctx, need_arguments=not strict, keyed=keyed)

    def feed(self, text: str) -> tuple[list[Event], str | None]:
        """Read until the JSON value ends."""
        used = self._reader.feed(text)
        self._text += text[:used]
        if self._reader.kind == "[":
            events = self._list.push(text[:used])
            if self._list.declined:
                return self._decline(text[used:])
            if self._reader.done or self._list.failed:
                return self._close_list(events, text[used:])
        else:
            events = self._body.push(text[:used])
            if self._reader.done:
                return self._close(events, text[used:])
        if not self._strict and not self._started and not could_be_call(self._text):
            return self._decline(text[used:])
        return events, None

    @property
    def _started(self) -> bool:
        return self._body.index is not None or self._list.calls > 0

    def finish(self) -> tuple[list[Event], str]:
        """Output ended before the value did."""
        if not self._started and not self._strict:
            return self._decline("")
        if self._reader.kind == "[":
            # The complete calls stand; what was cut is reported, its text kept as content.
            cut = self._list.cut if self._list.calls else self._prefix + self._text
            message = f"tool call list cut off after {self._list.calls} complete call(s)"
            return (self._ctx.fail_call(message, cut) if cut.strip() else []), ""
        return self._close([], "")

    def _close_list(self, events: list[Event], rest: str) -> tuple[list[Event], str]:
        if self._list.failed:
            self._list.declined = True  # read no more of it
            return events + self._ctx.fail_call(self._list.failed, self._prefix + self._text), rest
        if not self._list.calls and not self._strict:
            return self._decline(rest)  # an empty list is an answer
        if not self._list.calls:
            return events + self._ctx.fail_call("empty tool call list", self._prefix + self._text), rest
        return events, rest

    def _close(self, events: list[Event], rest: str) -> tuple[list[Event], str]:
        # Until a call has started, bare JSON may turn out to be an answer.
        tentative = not self._strict and self._body.index is None
        if tentative and not could_be_call(self._text):
            return self._decline(rest)
        result = self._body.close()
        if isinstance(result, str):
            if tentative:
                return self._decline(rest)
            return events + self._ctx.fail_call(result, self._prefix + self._text, self._body.index), rest
        return events + result, rest

    def _decline(self, rest: str) -> tuple[list[Event], str]:
        self._ctx.decline()
        return [], self._text + rest
