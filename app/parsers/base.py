"""The stream parser: a small state machine driven by a family's markers.

    content ──opener──▶ reasoning ──closer──▶ content
       │                    │
       └──── call start ────┴──▶ call reader ──call end──▶ (back where it was)

A family declares its markers and call syntaxes (``app.families``);
``FamilyParser`` runs them. Text is scanned for the markers of the current
state; a suffix that could begin a marker is held back until the next chunk
shows what it is, so any chunking of the same text gives the same events,
concatenated.

Choices where models or specs leave room:

- Every family knows all reasoning marker pairs. Inside reasoning any closer
  ends it and a repeated opener is dropped (templates that open the block
  in the prompt sometimes get it again from the model).
- Output that starts inside reasoning (``starts_in_reasoning``) and never
  closes it stays reasoning: the deltas went out as reasoning already.
- With ``reasoning=False`` markers are text, except that an empty block
  (``<think>\\n\\n</think>``) is dropped; a stray closer in content is
  dropped when reasoning is on.
- Whitespace at the edges of each content or reasoning stretch is trimmed
  (``</think>\\n\\n`` leaves no leading newlines on the answer); whitespace
  between two stretches of the same kind is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from app.families import Family
from app.families.syntax import CallSyntax, PythonicCalls
from app.parsers.calls import BareJson, CallReader
from app.parsers.events import ContentDelta, Event, ReasoningDelta, ToolCallError, ToolCallStart
from app.parsers.formats import call_format
from app.parsers.shapes.pythonic import PythonicReader
from app.streamtext import split_marker


class StreamParser(Protocol):
    """Turns generated text, in chunks of any size, into events."""

    def feed(self, text: str) -> list[Event]:
        """Read the next chunk; return the events it completes."""

    def finish(self) -> list[Event]:
        """The output ended: release held-back text and close what is open."""


class Channel:
    """Content or reasoning text, trimmed at the edges of each stretch.

    Trailing whitespace waits until more text of the same kind shows it is
    inner whitespace; at the end of the output it is dropped.
    """

    def __init__(self, kind: type[ContentDelta] | type[ReasoningDelta]) -> None:
        self._kind = kind
        self._pending = ""
        self._fresh = True
        self.emitted = False

    def push(self, text: str) -> list[Event]:
        """Text of this kind; returns the delta that can go out now."""
        if self._fresh:
            text = text.lstrip()
            if not text:
                return []
            self._fresh = False
        body = text.rstrip()
        if not body:
            self._pending += text
            return []
        out, self._pending = self._pending + body, text[len(body) :]
        self.emitted = True
        return [self._kind(out)]

    def boundary(self) -> None:
        """A marker interrupted this kind of text: trim around it."""
        self._fresh = True

    def tail(self) -> list[Event]:
        """Whitespace that ended the output with no marker after it: kept, since
        a stop string or max_tokens may have cut the text just after it."""
        if self._fresh or not self._pending:
            return []
        out, self._pending = self._pending, ""
        return [self._kind(out)]


class FamilyParser:
    """The ``StreamParser`` for one response, run by a ``Family``'s markers and call syntaxes."""

    def __init__(
        self,
        family: Family,
        *,
        reasoning: bool,
        starts_in_reasoning: bool = False,
        tools_offered: bool = False,
        id_factory: Callable[[], str] | None = None,
        tools: Mapping[str, Any] | None = None,
        primer: str = "",
    ) -> None:
        self._reasoning_on = reasoning
        self._in_reasoning = reasoning and starts_in_reasoning
        # Calls are read only when the request offered tools (and allowed them), as OpenAI and
        # vLLM do; otherwise the model's call text stays content.
        self._bare_json = tools_offered and any(isinstance(s, CallSyntax) and s.bare for s in family.reads)
        # Llama 4 writes [f(x=1)] as its whole answer: Python calls with no markers.
        self._bare_python = tools_offered and any(isinstance(s, PythonicCalls) and not s.begin.strip()
                                                  for s in family.reads)
        self._new_id = id_factory or family.call_id
        self._tools = tools or {}
        self.calls_allowed = tools_offered
        # Recipient headers (Functionary's >>>all) are the answer's structure: read without tools too.
        formats = [fmt for syntax in family.reads if (fmt := call_format(syntax)) is not None
                   and (tools_offered or (isinstance(syntax, CallSyntax) and syntax.content_header))]
        self._formats = {start: fmt for fmt in formats for start in fmt.starts}
        self._closer_of = dict(family.reasoning_pairs)
        self._closers = frozenset(self._closer_of.values())
        self._dropped = frozenset((*family.dropped, *(family.sections if tools_offered else ())))
        starts, openers = tuple(self._formats), tuple(self._closer_of)
        structure = (*openers, *self._closers, *self._dropped)
        self._reasoning_markers = ((*starts,) if family.calls_in_reasoning else ()) + structure
        self._content_markers = starts + (structure if reasoning else (*openers, *self._dropped))
        self._content = Channel(ContentDelta)
        self._thought = Channel(ReasoningDelta)
        self._held = ""
        self._call: CallReader | None = None
        self._calls = 0
        self._finished = False
        if primer:  # the prompt opened a call header (Functionary's >>>): read it as the model's
            self._consume(primer, [])

    def feed(self, text: str) -> list[Event]:
        """Read the next chunk of generated text."""
        out: list[Event] = []
        if not self._finished:
            self._consume(text, out)
        return out

    def finish(self) -> list[Event]:
        """Close an open call and release held-back text."""
        out: list[Event] = []
        if self._finished:
            return out
        self._finished = True
        while self._call is not None:
            call, self._call = self._call, None
            events, rest = call.finish()
            out += events
            self._consume(rest, out)
        held, self._held = self._held, ""
        out += self._channel().push(held)
        if self._channel() is self._content:
            out += self._content.tail()
        return out

    # CallContext, for the call readers.

    def start_call(self, name: str) -> ToolCallStart:
        """Number the next call and give it an id."""
        self._calls += 1
        return ToolCallStart(self._calls - 1, self._new_id(), name)

    def fail_call(self, message: str, raw: str, index: int | None = None) -> list[Event]:
        """Report an unreadable call; its raw text goes out as content."""
        return [ToolCallError(message, raw, index), *self._content.push(raw)]

    def content(self, text: str) -> list[Event]:
        """Send ordinary content."""
        return self._content.push(text)

    def decline(self) -> None:
        """Bare JSON (or a bare Python list) was not a call: from here on it is all content."""
        self._bare_json = self._bare_python = False

    def schema(self, name: str) -> dict[str, Any] | None:
        """The parameters schema of the offered tool ``name``."""
        params = self._tools.get(name)
        return params if isinstance(params, dict) else None

    # The state machine.

    def _bare_reader(self, text: str) -> CallReader | str | None:
        """The reader for an answer that may be a call without markers: bare JSON (``{`` or
        ``[{``), a Python list of calls (``[name(``); "wait" while the text cannot tell."""
        if text[:1] == "{" and self._bare_json:
            return BareJson(self)
        if text[:1] != "[":
            return None
        rest = text[1:].lstrip()
        if not rest:
            return "wait"
        if self._bare_python and (rest[0].isalpha() or rest[0] == "_"):
            return PythonicReader(self, "", bare=True)
        return BareJson(self) if self._bare_json else None

    def _channel(self) -> Channel:
        return self._thought if self._in_reasoning else self._content

    def _consume(self, text: str | None, out: list[Event]) -> None:
        while text is not None:
            if self._call is None:
                text = self._scan(self._held + text, out)
                continue
            events, text = self._call.feed(text)
            out += events
            if text is not None:
                self._call = None

    def _scan(self, buf: str, out: list[Event]) -> str | None:
        """Release text up to the next marker and act on it; ``None`` when all is read."""
        self._held = ""
        if (self._bare_json or self._bare_python) and not self._in_reasoning and not self._content.emitted:
            stripped = buf.lstrip()
            reader = self._bare_reader(stripped)
            if isinstance(reader, str):  # too early to tell
                self._held = buf
                return None
            if reader is not None:
                self._call = reader
                return stripped
        markers = self._reasoning_markers if self._in_reasoning else self._content_markers
        before, marker, after = split_marker(buf, markers)
        if marker is not None and self._may_grow(marker, after, markers):
            after, marker = marker + after, None  # a longer marker may be on its way
        out += self._channel().push(before)
        if marker is None:
            self._held = after
            return None
        return self._on_marker(marker, after, out)

    @staticmethod
    def _may_grow(marker: str, after: str, markers: tuple[str, ...]) -> bool:
        """Whether ``marker`` and the text after it are a proper prefix of a longer marker
        (Gemma's ``<|channel>`` before ``<|channel>thought``)."""
        seen = marker + after
        return any(len(m) > len(seen) and m.startswith(seen) for m in markers)

    def _on_marker(self, marker: str, after: str, out: list[Event]) -> str | None:
        if marker in self._dropped:
            self._channel().boundary()
            return after
        if marker in self._formats:
            self._channel().boundary()
            if self._in_reasoning:  # a call written in the reasoning block ends it
                self._in_reasoning = False
                self._thought.boundary()
            self._call = self._formats[marker].open(self, marker)
            return after
        if marker in self._closers:
            if self._in_reasoning:
                self._in_reasoning = False
                self._thought.boundary()
                self._content.boundary()
            return after  # a stray closer in content is dropped
        if self._in_reasoning:
            return after  # the template opened reasoning and the model did again
        if self._reasoning_on:
            self._in_reasoning = True
            self._content.boundary()
            return after
        return self._skip_empty_block(marker, after, out)

    def _skip_empty_block(self, opener: str, after: str, out: list[Event]) -> str | None:
        """With reasoning off, drop ``<think></think>``; other blocks stay text."""
        closer = self._closer_of[opener]
        inner = after.lstrip()
        if inner.startswith(closer):
            self._content.boundary()
            return inner[len(closer) :]
        if closer.startswith(inner):
            self._held = opener + after  # too early to tell
            return None
        out += self._content.push(opener)
        return after
