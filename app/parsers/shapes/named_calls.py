"""Calls whose name is in a header before the arguments (a ``CallSyntax`` with ``args``).

    NamedTag      <function=f>{...}</function>                     Llama, Functionary v3.1
    NameThenArgs  [TOOL_CALLS]f[ARGS]{...}                         Mistral; with an end marker
                  <｜tool▁call▁begin｜>f<｜tool▁sep｜>{...}<｜tool▁call▁end｜>   DeepSeek, Kimi, Functionary v3.2

The header may hold more than the name: ``header`` is its format
(``functions.{name}:{index}``), matched once the arguments marker shows where
it ends. A header that is not one (no valid name) turns the rest of the output
into content.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from app.families.syntax import CallSyntax, format_parts
from app.parsers.calls import (
    HEADER_ERROR,
    MAX_HEADER,
    NAME,
    BareJson,
    CallContext,
    CallFormat,
    CallReader,
    TaggedJson,
)
from app.parsers.events import Event, ToolCallStart
from app.parsers.json_args import ArgsStream
from app.streamtext import split_marker


def json_format(syntax: CallSyntax) -> CallFormat:
    """The format that reads a JSON ``syntax``, found by its markers without their edge whitespace.

    Bare JSON has no marker: the parser opens ``BareJson`` itself, when tools were offered.
    """
    begin, end = syntax.begin.strip(), syntax.end.strip()
    if not begin:
        raise ValueError(f"a call syntax with markers needs a begin marker: {syntax}")
    if syntax.args is not None:
        header = header_pattern(syntax.header)
        if end and not syntax.section[0]:
            return NamedTag(begin, syntax.args.strip(), end, header)
        # In a section (DeepSeek, Kimi) a model may leave a call's end marker out and
        # begin the next call: the arguments end with their JSON value, the marker may follow.
        return NameThenArgs(begin, syntax.args.strip() or syntax.args, syntax.id_marker, header, end,
                            syntax.content_header)
    return TaggedJson(begin, end, syntax.keyed)


def header_pattern(fmt: str) -> re.Pattern[str] | None:
    """A header format ("functions.{name}:{index}") as a pattern with named groups;
    None for the plain name."""
    if fmt == "{name}":
        return None
    body = "".join(re.escape(literal) + (f"(?P<{ph}>.*?)" if ph else "") for literal, ph in format_parts(fmt))
    return re.compile(r"\s*" + body + r"\s*", re.S)


def header_name(header: str, pattern: re.Pattern[str] | None) -> str:
    """The function name in a call header ("" when the header is not one)."""
    if pattern is None:
        return header.strip()
    match = pattern.fullmatch(header)
    return match.group("name").strip() if match else ""


class _HeaderReader:
    """Shared by formats that put the function name in a header before the
    arguments: reads the header, then the arguments value."""

    def __init__(self, ctx: CallContext, start: str) -> None:
        self._ctx = ctx
        self._raw = start
        self._header = ""
        self._held = ""
        self._args: ArgsStream | None = None
        self._dead = False

    def _die(self, rest: str = "") -> tuple[list[Event], str | None]:
        """The header is wrong: report it; the rest of the output is content."""
        self._dead = True
        raw, self._held = self._raw + self._header + self._held, ""
        return self._ctx.fail_call(HEADER_ERROR, raw) + self._ctx.content(rest), None

    def _begin(self, name: str, marker: str) -> ToolCallStart:
        self._raw += self._header + marker
        start = self._ctx.start_call(name)
        self._args = ArgsStream(start.index)
        return start

    def _close(self, tail: str = "", end: str = "") -> list[Event]:
        assert self._args is not None
        result = self._args.finish(tail)
        if isinstance(result, str):
            raw = self._raw + self._args.text + tail + end
            return self._ctx.fail_call(result, raw, self._args.index)
        return result


@dataclass(frozen=True)
class NamedTag:
    """The name in the opening tag, the arguments as its body: ``<function=f>{...}</function>``."""

    start: str
    name_end: str
    end: str
    header: re.Pattern[str] | None = None

    @property
    def starts(self) -> tuple[str, ...]:
        return (self.start,)

    def open(self, ctx: CallContext, marker: str) -> CallReader:
        """A reader for the name, then the body up to the end tag."""
        return _NamedTagReader(ctx, self)


class _NamedTagReader(_HeaderReader):
    def __init__(self, ctx: CallContext, fmt: NamedTag) -> None:
        super().__init__(ctx, fmt.start)
        self._fmt = fmt
        self._tail = ""

    def feed(self, text: str) -> tuple[list[Event], str | None]:
        if self._dead:
            return self._ctx.content(text), None
        if self._args is None:
            return self._feed_name(text)
        return self._feed_body(text)

    def finish(self) -> tuple[list[Event], str]:
        if self._dead:
            return [], ""
        if self._args is None:
            return self._die()[0], ""
        return self._close(self._tail, self._held), ""

    def _feed_name(self, text: str) -> tuple[list[Event], str | None]:
        before, marker, after = split_marker(self._held + text, (self._fmt.name_end,))
        self._header += before
        self._held = "" if marker else after
        if len(self._header) > MAX_HEADER:
            return self._die(marker + after if marker else "")
        if marker is None:
            return [], None
        name = header_name(self._header, self._fmt.header)
        if not NAME.fullmatch(name):
            return self._die(marker + after)
        start = self._begin(name, marker)
        events, rest = self._feed_body(after)
        return [start, *events], rest

    def _feed_body(self, text: str) -> tuple[list[Event], str | None]:
        assert self._args is not None
        before, marker, after = split_marker(self._held + text, (self._fmt.end,))
        self._held = "" if marker else after
        events, used = self._args.push(before)
        self._tail += before[used:]
        if marker is None:
            return events, None
        return events + self._close(self._tail, marker), after


@dataclass(frozen=True)
class NameThenArgs:
    """A start marker, the name, an arguments marker and the arguments:
    ``[TOOL_CALLS]f[ARGS]{...}``. A JSON value right after the start marker
    is a call object or a list of them instead: ``[TOOL_CALLS][{"name": ...}]``.
    ``id_marker`` splits a model-written call id off the name (ignored).
    """

    start: str
    args_marker: str
    id_marker: str = ""
    header: re.Pattern[str] | None = None
    end: str = ""
    content_header: str = ""

    @property
    def starts(self) -> tuple[str, ...]:
        return (self.start,)

    def open(self, ctx: CallContext, marker: str) -> CallReader:
        """A reader for the header, then the self-delimiting arguments value."""
        return _NameThenArgsReader(ctx, self)


class _NameThenArgsReader(_HeaderReader):
    def __init__(self, ctx: CallContext, fmt: NameThenArgs) -> None:
        super().__init__(ctx, fmt.start)
        self._fmt = fmt
        self._json: BareJson | None = None
        self._after: str | None = None  # after the arguments: the text that may be the end marker

    def feed(self, text: str) -> tuple[list[Event], str | None]:
        if self._dead:
            return self._ctx.content(text), None
        if self._after is not None:
            return [], self._end_marker(text)
        if self._json is not None:
            return self._json.feed(text)
        if self._args is None:
            return self._feed_header(text)
        return self._feed_args(text)

    def finish(self) -> tuple[list[Event], str]:
        if self._dead:
            return [], ""
        if self._after is not None:
            rest, self._after = self._after, None
            return [], rest
        if self._json is not None:
            return self._json.finish()
        if self._args is None:
            return self._die()[0], ""
        return self._close(), ""

    def _feed_header(self, text: str) -> tuple[list[Event], str | None]:
        buf, self._held = self._held + text, ""
        if not self._header.strip() and (self._header + buf).lstrip()[:1] in ("[", "{"):
            self._json = BareJson(self._ctx, strict=True, prefix=self._fmt.start)
            return self._json.feed(self._header + buf)
        before, marker, after = split_marker(buf, (self._fmt.args_marker,))
        self._header += before
        if len(self._header) > MAX_HEADER:
            return self._die(marker + after if marker else "")
        if marker is None:
            self._held = after
            return [], None
        header = self._header.split(self._fmt.id_marker)[0] if self._fmt.id_marker else self._header
        if self._fmt.content_header and header.strip() == self._fmt.content_header:
            return [], after  # not a call: the answer follows
        if not self._ctx.calls_allowed:
            return self._ctx.content(self._fmt.start + self._header + marker), after
        name = header_name(header, self._fmt.header)
        if not NAME.fullmatch(name):
            return self._die(marker + after)
        start = self._begin(name, marker)
        events, rest = self._feed_args(after)
        return [start, *events], rest

    def _feed_args(self, text: str) -> tuple[list[Event], str | None]:
        assert self._args is not None
        events, used = self._args.push(text)
        if not self._args.done:
            return events, None
        events += self._close()
        if not self._fmt.end or self._dead:
            return events, text[used:]
        self._after = ""
        return events, self._end_marker(text[used:])

    def _end_marker(self, text: str) -> str | None:
        """The optional end marker after the arguments: consumed when it comes, else the
        text goes back to the parser once it cannot be the marker."""
        assert self._after is not None
        buf = self._after + text
        stripped, end = buf.lstrip(), self._fmt.end
        if not stripped or (end.startswith(stripped) and stripped != end):
            self._after = buf
            return None
        self._after = None
        return stripped[len(end):] if stripped.startswith(end) else buf
