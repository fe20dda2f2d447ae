"""gpt-oss's Harmony format: messages on channels, not tags.

Raw output (the generation prompt ends with ``<|start|>assistant``)::

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>

    <|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Paris is sunny.

Each message is a header up to ``<|message|>`` and a body up to ``<|end|>``,
``<|call|>``, ``<|return|>`` or the next ``<|start|>``. What the header says
decides what the body is:

    to=functions.NAME (any channel)     a call; the body is its JSON arguments, streamed
    to=another recipient                a built-in tool (python, browser): dropped
    channel analysis                    reasoning
    channel final, commentary, none     content

Output that does not start with a header is content, as if on ``final``.

muse-glimmer's messages (``RecipientCalls``) are read the same way, by their
recipient alone: ``to=user`` is content, ``to=self`` reasoning, ``to=NAME`` a
message to a tool whose body holds its calls in ATEM XML (read by the XML call
reader when the message ends); its messages end at ``<|eom|>`` or ``<|eot|>``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from app.families import Family
from app.families.syntax import HarmonyCalls, RecipientCalls
from app.parsers.base import Channel, FamilyParser
from app.parsers.events import (
    ContentDelta,
    Event,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallError,
    ToolCallStart,
)
from app.parsers.json_args import ArgsStream
from app.streamtext import split_marker

MESSAGE = "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_HEADER_STARTS = ("<|start|>", "<|channel|>", " to=", "to=")
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=<\||\s|$)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
MAX_HEADER = 512
FUNCTIONS = "functions."


class HarmonyParser:
    """The ``StreamParser`` of a Harmony model."""

    def __init__(self, family: Family, *, tools_offered: bool = False,
                 id_factory: Callable[[], str] | None = None, tools: Mapping[str, Any] | None = None) -> None:
        syntax = next(s for _, s in family.templated if isinstance(s, (HarmonyCalls, RecipientCalls)))
        self._recipients = syntax if isinstance(syntax, RecipientCalls) else None
        self._ends = (*syntax.ends, "<|start|>") if isinstance(syntax, RecipientCalls) else ENDS
        self._family = family
        self._tools = tools
        self._tools_offered = tools_offered
        self._new_id = id_factory or family.call_id
        self._content = Channel(ContentDelta)
        self._thought = Channel(ReasoningDelta)
        self._held = ""
        self._header: str | None = ""  # None: in a body
        self._kind = ""  # the body's kind: content, reasoning, call, drop
        self._args: ArgsStream | None = None
        self._raw = ""
        self._calls = 0
        self._finished = False

    def feed(self, text: str) -> list[Event]:
        """Read the next chunk of generated text."""
        if self._finished:
            return []
        out: list[Event] = []
        buf, self._held = self._held + text, ""
        while buf:
            buf = self._step(buf, out)
        return out

    def finish(self) -> list[Event]:
        """The output ended: close an open call, release held-back text."""
        if self._finished:
            return []
        self._finished = True
        out: list[Event] = []
        held, self._held = self._held, ""
        if self._header is not None:
            if held.strip():
                self._begin_body("content", held)
                self._body(held, out)
        else:
            self._body(held, out)
        self._end_body(out)
        return out + self._content.tail()

    def _step(self, buf: str, out: list[Event]) -> str:
        if self._header is None:
            before, marker, after = split_marker(buf, self._ends)
            if marker is None:
                self._held = after
                self._body(before, out)
                return ""
            self._body(before, out)
            self._end_body(out)
            self._header = "<|start|>" if marker == "<|start|>" else ""
            return after
        header = self._header + buf
        if not self._header and not any(header.startswith(s) or s.startswith(header) for s in _HEADER_STARTS):
            self._begin_body("content", "")  # no header: plain content
            return buf
        before, marker, after = split_marker(header, (MESSAGE,))
        if marker is None:
            if len(header) > MAX_HEADER:
                self._begin_body("content", "")
                return header
            self._header, self._held = "", header
            return ""
        self._begin_body(self._kind_of(before), before + marker)
        if self._kind == "call":
            out += self._start_call(before)
        return after

    def _kind_of(self, header: str) -> str:
        recipient = _RECIPIENT.search(header)
        channels = _CHANNEL.findall(header)
        target = recipient.group(1) if recipient else ""
        if self._recipients is not None:
            if target == self._recipients.thought:
                return "reasoning"
            if not target or target == self._recipients.answer or not self._tools_offered:
                return "content"
            return "body"  # a message to a tool: its calls, read when it ends
        if target.startswith(FUNCTIONS):
            return "call" if self._tools_offered else "content"
        if target and target != "assistant":
            return "drop"  # a built-in tool's message
        return "reasoning" if channels and channels[-1] == "analysis" else "content"

    def _begin_body(self, kind: str, raw: str) -> None:
        self._header, self._kind, self._raw = None, kind, raw
        (self._thought if kind == "reasoning" else self._content).boundary()

    def _start_call(self, header: str) -> list[Event]:
        match = _RECIPIENT.search(header)
        assert match is not None
        self._calls += 1
        start = ToolCallStart(self._calls - 1, self._new_id(), match.group(1)[len(FUNCTIONS):])
        self._args = ArgsStream(start.index)
        return [start]

    def _body(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        if self._kind == "reasoning":
            out += self._thought.push(text)
        elif self._kind == "content":
            out += self._content.push(text)
        elif self._kind == "call":
            assert self._args is not None
            self._raw += text
            events, _ = self._args.push(text)
            out += events
        elif self._kind == "body":
            self._raw += text

    def _end_body(self, out: list[Event]) -> None:
        if self._kind == "body" and self._recipients is not None:
            out += self._body_calls(self._raw.split(MESSAGE, 1)[-1] if MESSAGE in self._raw else self._raw)
        if self._kind == "call" and self._args is not None:
            result = self._args.finish()
            if isinstance(result, str):
                out += [ToolCallError(result, self._raw, self._args.index), *self._content.push(self._raw)]
            else:
                out += result
        self._args, self._kind = None, ""
        self._thought.boundary()
        self._content.boundary()

    def _body_calls(self, body: str) -> list[Event]:
        """The calls in a message to a tool, read by its body syntax's parser, numbered on."""
        assert self._recipients is not None
        reader = FamilyParser(replace(self._family, templated=(("", self._recipients.body),), also_reads=(),
                                      reasoning=(), dropped=()),
                              reasoning=False, tools_offered=True, id_factory=self._new_id, tools=self._tools)
        out: list[Event] = []
        base = self._calls
        for ev in [*reader.feed(body), *reader.finish()]:
            if isinstance(ev, ToolCallStart):
                self._calls = max(self._calls, base + ev.index + 1)
                ev = ToolCallStart(base + ev.index, ev.id, ev.name)
            elif isinstance(ev, (ToolCallArgsDelta, ToolCallEnd)):
                ev = replace(ev, index=base + ev.index)
            elif isinstance(ev, ToolCallError) and ev.index is not None:
                ev = replace(ev, index=base + ev.index)
            elif isinstance(ev, ContentDelta):
                out += self._content.push(ev.text)
                continue
            out.append(ev)
        return out
