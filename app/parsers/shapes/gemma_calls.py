"""Gemma 4's calls: ``GemmaCalls`` (app.families.syntax).

Raw output (strings between ``<|"|>`` tokens, keys bare, the rest as in JSON)::

    <|tool_call>call:get_weather{city:<|"|>Paris<|"|>,days:3,opts:{metric:true}}<tool_call|>

The call goes out when its object closes; its text is read by a small lexer
(``gemma_value``), never evaluated.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from app.families.syntax import GemmaCalls
from app.parsers.calls import MAX_HEADER, NAME, CallContext
from app.parsers.events import Event, ToolCallArgsDelta, ToolCallEnd
from app.streamtext import split_marker

_PREFIX = "call:"
# An argument object this long without its end is not a call.
MAX_CALL_CHARS = 1 << 20


@dataclass(frozen=True)
class GemmaFormat:
    """The reader's format."""

    syntax: GemmaCalls

    @property
    def starts(self) -> tuple[str, ...]:
        return (self.syntax.begin,)

    def open(self, ctx: CallContext, marker: str) -> GemmaReader:
        """A reader for one call after ``marker``."""
        return GemmaReader(ctx, self.syntax)


class GemmaReader:
    """``call:NAME{...}`` then the end marker."""

    def __init__(self, ctx: CallContext, syntax: GemmaCalls) -> None:
        self._ctx = ctx
        self._syntax = syntax
        self._header = ""
        self._body = ""
        self._held = ""
        self._name: str | None = None
        self._depth = 0
        self._in_string = False
        self._done = False
        self._dead = False
        self._pending: list[Event] = []

    def feed(self, text: str) -> tuple[list[Event], str | None]:
        if self._dead:
            return self._ctx.content(text), None
        buf, self._held = self._held + text, ""
        events: list[Event] = []
        if self._name is None:
            before, marker, after = split_marker(buf, ("{",))
            self._header += before
            if len(self._header) > MAX_HEADER:
                return self._fail("malformed tool call: no valid function name", after), None
            if marker is None:
                self._held = after
                return [], None
            name = self._header.strip().removeprefix(_PREFIX).strip()
            if not NAME.fullmatch(name):
                return self._fail("malformed tool call: no valid function name", marker + after), None
            self._name, self._depth, self._body, buf = name, 1, "{", after
        if not self._done:
            buf = self._read_body(buf)
            if self._dead:
                return self._pending, None
            if not self._done:
                return [], None
            events = self._emit()
            if self._dead:
                return events, None
        stripped = buf.lstrip()
        end = self._syntax.end
        if not stripped or (end.startswith(stripped) and stripped != end):
            self._held = buf
            return events, None
        if stripped.startswith(end):
            return events, stripped[len(end):]
        return events, buf  # no end marker after the object: the call stands

    def finish(self) -> tuple[list[Event], str]:
        if self._dead:
            return [], ""
        if self._done:
            return [], self._held
        return self._fail("tool call cut off before its end", self._held), ""

    def _read_body(self, buf: str) -> str:
        """Take the object's text from ``buf``; what follows its closing brace is returned."""
        quote = self._syntax.quote
        i = 0
        while i < len(buf):
            if buf.startswith(quote, i):
                self._in_string = not self._in_string
                i += len(quote)
                continue
            if quote.startswith(buf[i:]) and len(buf) - i < len(quote):
                self._held = buf[i:]  # maybe a quote token, split
                break
            ch = buf[i]
            i += 1
            if self._in_string:
                continue
            if ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._body += buf[: i]
                    self._done = True
                    return buf[i:]
        taken = buf[:i] if not self._held else buf[: len(buf) - len(self._held)]
        self._body += taken
        if len(self._body) > MAX_CALL_CHARS:
            self._pending = self._fail("tool call too long", "")
        return ""

    def _emit(self) -> list[Event]:
        assert self._name is not None
        try:
            value = gemma_value(self._body, self._syntax.quote)
        except ValueError as exc:
            return self._fail(f"tool call arguments: {exc}", "")
        if not isinstance(value, dict):
            return self._fail("tool call arguments are not an object", "")
        start = self._ctx.start_call(self._name)
        return [start, ToolCallArgsDelta(start.index, json.dumps(value, ensure_ascii=False)), ToolCallEnd(start.index)]

    def _fail(self, message: str, rest: str) -> list[Event]:
        self._dead = True
        raw = self._syntax.begin + self._header + (self._body if self._name else "") + self._held
        self._held = ""
        return self._ctx.fail_call(message, raw) + self._ctx.content(rest)


_TOKEN = re.compile(r'\s*(?:([{}\[\]:,])|("(?:[^"\\]|\\.)*")|([^{}\[\]:,\s][^{}\[\]:,]*))')


def gemma_value(text: str, quote: str) -> Any:
    """A Gemma 4 argument value as JSON data: ``{city:<|"|>Paris<|"|>,n:3}`` -> ``{"city": "Paris", "n": 3}``.
    JSON strings (``"Paris"``) read as strings too."""
    tokens: list[tuple[str, Any]] = []
    for i, piece in enumerate(text.split(quote)):
        if i % 2:
            tokens.append(("str", piece))
            continue
        pos = 0
        while pos < len(piece):
            m = _TOKEN.match(piece, pos)
            if m is None:
                break
            pos = m.end()
            if m.group(1):
                tokens.append((m.group(1), None))
            elif m.group(2):  # a JSON string (what the grammar writes inside objects)
                tokens.append(("str", json.loads(m.group(2))))
            elif m.group(3):
                tokens.append(("bare", m.group(3).strip()))
    value, at = _parse(tokens, 0)
    if at != len(tokens):
        raise ValueError("unexpected text after the value")
    return value


def _parse(tokens: list[tuple[str, Any]], at: int) -> tuple[Any, int]:
    if at >= len(tokens):
        raise ValueError("value cut off")
    kind, value = tokens[at]
    if kind == "str":
        return value, at + 1
    if kind == "bare":
        try:
            return json.loads(value), at + 1
        except ValueError:
            return value, at + 1  # a bare word: its text
    if kind == "{":
        out: dict[str, Any] = {}
        at += 1
        while True:
            if at < len(tokens) and tokens[at][0] == "}":
                return out, at + 1
            if at >= len(tokens) or tokens[at][0] not in ("bare", "str"):
                raise ValueError("expected a key")
            key = str(tokens[at][1])
            if at + 1 >= len(tokens) or tokens[at + 1][0] != ":":
                raise ValueError(f"expected ':' after {key!r}")
            out[key], at = _parse(tokens, at + 2)
            if at < len(tokens) and tokens[at][0] == ",":
                at += 1
    if kind == "[":
        items: list[Any] = []
        at += 1
        while True:
            if at < len(tokens) and tokens[at][0] == "]":
                return items, at + 1
            item, at = _parse(tokens, at)
            items.append(item)
            if at < len(tokens) and tokens[at][0] == ",":
                at += 1
    raise ValueError(f"unexpected {kind!r}")
