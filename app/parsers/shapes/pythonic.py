"""Python-style calls: ``PythonicCalls`` (app.families.syntax).

Raw output (LFM2 and LFM2.5 between their call tokens; Llama 4 writes the list
alone as its whole answer)::

    <|tool_call_start|>[get_weather(city="Paris", days=3), get_time(tz='CET')]<|tool_call_end|>

Each call goes out as soon as its closing parenthesis arrives: the reader
tracks brackets and string quotes to find it, then reads the call with
Python's own parser (``ast``), never evaluating anything. Argument values are
Python or JSON literals (``True`` and ``true``, ``None`` and ``null``), strings
with Python's escapes, lists, dicts and tuples; anything else fails the call.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from typing import Any

from app.families.syntax import PythonicCalls
from app.parsers.calls import NAME, CallContext
from app.parsers.events import Event, ToolCallArgsDelta, ToolCallEnd

# What the start of a bare answer must look like to be a list of calls: "[name(".
_CALLS_START = re.compile(r"\s*\[\s*(?:[A-Za-z_][\w.]*\s*(?:\(.*)?)?$", re.S)
_LITERALS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}
# A list this long without its end is not a call list.
MAX_CALLS_CHARS = 1 << 20


@dataclass(frozen=True)
class PythonicFormat:
    """The reader's format: ``begin``, a Python list of calls, ``end``."""

    syntax: PythonicCalls

    @property
    def starts(self) -> tuple[str, ...]:
        return (self.syntax.begin.strip(),)

    def open(self, ctx: CallContext, marker: str) -> PythonicReader:
        """A reader for the list after ``marker``."""
        return PythonicReader(ctx, self.syntax.end.strip(), marker)


class PythonicReader:
    """Reads ``[f(...), g(...)]`` up to the end marker, a call at a time. Output that
    ends after the list's ``]`` with no end marker (the model's end token) is whole.
    ``bare`` (no markers, the whole answer: Llama 4): the list ends at its ``]``, and
    text that turns out not to be a list of calls (``[a link](url)``) is content."""

    def __init__(self, ctx: CallContext, end: str, prefix: str = "", *, bare: bool = False) -> None:
        self._ctx = ctx
        self._end = end
        self._prefix = prefix
        self._bare = bare
        self._text = ""  # the list's text so far
        self._after: str | None = None  # the text after the end marker, once seen
        self._scan = 0  # how far ``_text`` is scanned
        self._depth = 0
        self._quote = ""
        self._escaped = False
        self._call_from: int | None = None
        self._calls = 0
        self._dead = False
        self._closed = False  # the list's ``]`` was seen

    def feed(self, text: str) -> tuple[list[Event], str | None]:
        if self._dead:
            return self._ctx.content(text), None
        self._text += text
        events = self._read()
        if self._dead or self._after is None:
            return events, None
        rest, self._after = self._after, None
        return events + self._close(), rest

    def finish(self) -> tuple[list[Event], str]:
        if self._dead:
            return [], ""
        if self._bare and not self._calls:
            return self._decline(""), ""
        return self._close(cut=True), ""

    def _decline(self, rest: str) -> list[Event]:
        """Not a list of calls after all: its text is content, and so is the rest."""
        self._dead = True
        self._ctx.decline()
        text, self._text = self._text + rest, ""
        return self._ctx.content(text)

    def _read(self) -> list[Event]:
        """Scan the new text; each call that ends in it goes out. Outside the list's brackets
        the end marker is looked for (``_after`` holds what follows it once seen)."""
        events: list[Event] = []
        if len(self._text) > MAX_CALLS_CHARS:
            return self._fail("tool call list too long")
        while self._scan < len(self._text) and not self._dead:
            if not self._depth and not self._quote and self._end and self._text[self._scan] == self._end[0]:
                tail = self._text[self._scan:]
                if tail.startswith(self._end):
                    self._after = tail[len(self._end):]
                    self._text = self._text[: self._scan]
                    return events
                if self._end.startswith(tail):
                    return events  # maybe the end marker: wait for more
            ch = self._text[self._scan]
            self._scan += 1
            events += self._step(ch)
            if self._bare and not self._calls and not self._dead and not _CALLS_START.match(self._text[: self._scan]):
                return events + self._decline("")
            if self._bare and self._closed and not self._dead:
                self._after = self._text[self._scan:]
                self._text = self._text[: self._scan]
                return events
        return events

    def _step(self, ch: str) -> list[Event]:
        if self._quote:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == self._quote:
                self._quote = ""
            return []
        if ch in "\"'":
            self._quote = ch
        elif ch in "([{":
            if self._depth == 0 and (ch != "[" or self._closed):
                return self._fail("expected one list of tool calls")
            self._depth += 1
            if self._depth == 2 and ch == "(" and self._call_from is None:
                self._call_from = self._start_of_call()
        elif ch in ")]}":
            self._depth -= 1
            if self._depth == 1 and ch == ")" and self._call_from is not None:
                source, self._call_from = self._text[self._call_from : self._scan], None
                return self._emit(source)
            if self._depth == 0:
                self._closed = True
            elif self._depth < 0:
                return self._fail("unbalanced brackets in a tool call list")
        elif self._depth == 0 and not ch.isspace():
            return self._fail("expected one list of tool calls")
        return []

    def _start_of_call(self) -> int:
        """Where the call whose ``(`` was just read starts: after the last ``[`` or ``,``."""
        at = self._scan - 1
        while at > 0 and self._text[at - 1] not in "[,":
            at -= 1
        return at

    def _emit(self, source: str) -> list[Event]:
        call = read_call(source.strip())
        if isinstance(call, str):
            return self._decline("") if self._bare and not self._calls else self._fail(call)
        name, arguments = call
        start = self._ctx.start_call(name)
        self._calls += 1
        args = json.dumps(arguments, ensure_ascii=False)
        return [start, ToolCallArgsDelta(start.index, args), ToolCallEnd(start.index)]

    def _close(self, cut: bool = False) -> list[Event]:
        if (cut and not self._closed) or self._quote or self._depth:
            return self._fail("tool call cut off before its end")
        if not self._calls and self._text.strip() not in ("", "[]"):
            return self._fail("no tool call in the list")
        return []

    def _fail(self, message: str) -> list[Event]:
        self._dead = True
        raw = self._prefix + self._text + (self._end if self._after is not None else "") + (self._after or "")
        self._after = None
        return self._ctx.fail_call(message, raw)


def read_call(source: str) -> tuple[str, dict[str, Any]] | str:
    """``f(a=1, b="x")`` as its name and arguments, or why it is not a call."""
    try:
        node = ast.parse(source, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return "tool call is not a Python call"
    if not isinstance(node, ast.Call) or node.args:
        return "tool call must be a call with keyword arguments"
    name = _dotted(node.func)
    if name is None or not NAME.fullmatch(name):
        return "malformed tool call: no valid function name"
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            return "tool call arguments cannot be unpacked"
        try:
            arguments[keyword.arg] = literal(keyword.value)
        except ValueError as exc:
            return f"argument {keyword.arg!r}: {exc}"
    return name, arguments


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def literal(node: ast.expr) -> Any:
    """A Python or JSON literal's value; ``ValueError`` for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _LITERALS:
        return _LITERALS[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for key, value in zip(node.keys, node.values, strict=True):
            k = literal(key) if key is not None else None
            if not isinstance(k, str):
                raise ValueError("dict keys must be strings")
            out[k] = literal(value)
        return out
    raise ValueError("not a literal value")
