"""Arguments as nested elements: ``NestedXmlCalls`` (app.families.syntax), MiniMax M3.

Raw output (every tag after the ``]<]minimax[>[`` token; objects nest their
members, arrays their ``<item>``s)::

    ]<]minimax[>[<tool_call>
    ]<]minimax[>[<invoke name="get_weather">]<]minimax[>[<city>Paris]<]minimax[>[</city>
    ]<]minimax[>[<days>3]<]minimax[>[</days>]<]minimax[>[</invoke>
    ]<]minimax[>[</tool_call>

A call goes out when its ``</invoke>`` arrives. The offered tool's schema says
what each element is: a string parameter keeps its inner text as written
(tags included), one with child elements is an object (or, with ``<item>``
children, an array), any other is read as ``arg_types`` reads text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from app.families.syntax import NestedXmlCalls, format_parts
from app.parsers.calls import MAX_HEADER, NAME, CallContext
from app.parsers.events import Event, ToolCallArgsDelta, ToolCallEnd
from app.parsers.shapes.arg_types import property_schema, types_of, value_of
from app.streamtext import split_marker

MAX_CALL_CHARS = 1 << 20


@dataclass(frozen=True)
class NestedXmlFormat:
    """The reader's format: ``call`` holds ``{name}``; ``end`` closes the call."""

    syntax: NestedXmlCalls

    @property
    def starts(self) -> tuple[str, ...]:
        return (format_parts(self.syntax.call)[0][0].strip(),)

    def open(self, ctx: CallContext, marker: str) -> NestedXmlReader:
        """A reader for one call after its opener."""
        return NestedXmlReader(ctx, self.syntax, marker)


@dataclass
class Element:
    """One element: its key, its inner text as written, its children."""

    key: str
    text: str = ""
    children: list[Element] = field(default_factory=list)


class NestedXmlReader:
    """The name up to the header's end, then the body up to ``end``."""

    def __init__(self, ctx: CallContext, syntax: NestedXmlCalls, marker: str) -> None:
        self._ctx = ctx
        self._syntax = syntax
        self._raw = marker
        self._name_end = format_parts(syntax.call)[1][0].strip()
        self._end = syntax.end.strip()
        self._name: str | None = None
        self._text = ""
        self._dead = False

    def feed(self, text: str) -> tuple[list[Event], str | None]:
        if self._dead:
            return self._ctx.content(text), None
        self._text += text
        if self._name is None:
            before, marker, after = split_marker(self._text, (self._name_end,))
            if marker is None:
                if len(before) > MAX_HEADER:
                    return self._fail("malformed tool call: no valid function name"), None
                return [], None
            if not NAME.fullmatch(before.strip()):
                return self._fail("malformed tool call: no valid function name"), None
            self._name, self._raw, self._text = before.strip(), self._raw + before + marker, after
        body, marker, after = split_marker(self._text, (self._end,))
        if marker is None:
            if len(self._text) > MAX_CALL_CHARS:
                return self._fail("tool call too long"), None
            return [], None
        self._text = body
        return self._emit(body), after

    def finish(self) -> tuple[list[Event], str]:
        if self._dead:
            return [], ""
        return self._fail("tool call cut off before its end"), ""

    def _emit(self, body: str) -> list[Event]:
        assert self._name is not None
        root = parse_elements(body, self._syntax.tag)
        if root is None:
            return self._fail("malformed tool call arguments")
        schema = self._ctx.schema(self._name)
        arguments = {child.key: convert(child, property_schema(schema, child.key)) for child in root.children}
        start = self._ctx.start_call(self._name)
        args = json.dumps(arguments, ensure_ascii=False)
        return [start, ToolCallArgsDelta(start.index, args), ToolCallEnd(start.index)]

    def _fail(self, message: str) -> list[Event]:
        self._dead = True
        raw, self._text = self._raw + self._text, ""
        return self._ctx.fail_call(message, raw)


def parse_elements(body: str, tag: str) -> Element | None:
    """The elements of a call's body as a tree under a root; None when the tags do not nest."""
    pattern = re.compile(re.escape(tag) + r"<(/?)([^<>\s/]+)>")
    root = Element("")
    stack: list[tuple[Element, int]] = [(root, 0)]
    at = 0
    for m in pattern.finditer(body):
        element, start = stack[-1]
        if m.group(1):  # a closing tag
            if len(stack) == 1 or element.key != m.group(2):
                return None
            element.text = body[start : m.start()]
            stack.pop()
        else:
            if len(stack) == 1 and body[at : m.start()].strip():
                return None  # text between the call's elements
            child = Element(m.group(2))
            element.children.append(child)
            stack.append((child, m.end()))
        at = m.end()
    if len(stack) != 1 or body[at:].strip():
        return None
    return root


def convert(element: Element, schema: Any) -> Any:
    """An element's value under its schema (see the module docstring)."""
    types = types_of(schema)
    if not element.children:
        return value_of(element.text, schema)
    if "string" in types:
        return element.text  # a string may hold tags: kept as written
    if all(c.key == "item" for c in element.children) and ("array" in types or "object" not in types):
        items = _branch(schema, "array").get("items") if isinstance(schema, dict) else None
        return [convert(c, items) for c in element.children]
    branch = _branch(schema, "object")
    return {c.key: convert(c, property_schema(branch, c.key)) for c in element.children}


def _branch(schema: Any, kind: str) -> dict[str, Any]:
    """The part of a (union) schema for ``kind``."""
    if not isinstance(schema, dict):
        return {}
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            if kind in types_of(sub):
                return sub if isinstance(sub, dict) else {}
    return schema
