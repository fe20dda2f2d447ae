"""Calls whose arguments are elements holding text: ``XmlCalls`` (app.families.syntax).

Raw output of the shapes this reads (one reader; each family's format strings
say which tags)::

    <tool_call>                             Qwen3-Coder, Qwen3.5, Nemotron 3, StepFun
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

    <tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>     GLM, Ling
    <minimax:tool_call><invoke name="get_weather"><parameter name="city">Paris</parameter></invoke></minimax:tool_call>
    <｜DSML｜function_calls><｜DSML｜invoke name="f"><｜DSML｜parameter name="n" string="false">5</｜DSML｜parameter>...

The state machine::

    call tags ──▶ name ──▶ params ──param tags──▶ key ──▶ value ──▶ params
                                            │
                                     end tags ──▶ back to the parser

Tags are found without the whitespace at their edges, and any whitespace may
stand between two tags (GLM-4.6 writes newlines where GLM-4.7 writes none).
A value's text is read by the offered tool's schema (``arg_types``); a value
that is a string there streams as a JSON string while it is written. A tag
the format does not expect where it stands, or output that ends inside a call,
fails the call (``ToolCallError``; its text goes out as content, and so does
the rest of the output).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from app.families.syntax import XmlCalls, format_parts
from app.parsers.calls import MAX_HEADER, NAME, CallContext
from app.parsers.events import Event, ToolCallArgsDelta, ToolCallEnd
from app.parsers.shapes.arg_types import is_text, property_schema, value_of
from app.streamtext import split_marker


def tags(literal: str) -> list[str]:
    """The tags of a literal piece of a format, one per line, edge whitespace dropped."""
    return [t.strip() for t in literal.split("\n") if t.strip()]


@dataclass(frozen=True)
class Header:
    """An element's opening: ``tags`` before it, its ``opener``, the text up to its
    ``terminator`` matched by ``pattern`` (the placeholders as named groups)."""

    tags: tuple[str, ...]
    opener: str
    terminator: str
    pattern: re.Pattern[str]
    trailing: str  # text of the format after the terminator (a value's layout)

    @classmethod
    def of(cls, fmt: str, until: str | None = None) -> Header:
        """The header of ``fmt`` up to placeholder ``until`` (the end of the format when None)."""
        parts = format_parts(fmt)
        first_literal, _ = parts[0]
        *before, opener = tags(first_literal) or [""]
        body: list[str] = []
        terminator, trailing = "", ""
        for i, (literal, placeholder) in enumerate(parts):
            if i and literal:
                last = i + 1 == len(parts) or parts[i][1] == until
                if last:
                    *middle, terminator = tags(literal) or [""]
                    body += [r"\s*" + re.escape(t) for t in middle]
                    trailing = literal[literal.rfind(terminator) + len(terminator):] if terminator else literal
                    break
                body.append(_loose(literal))
            if placeholder == until:
                break
            if placeholder:
                body.append(f"(?P<{placeholder}>.*?)")
        pattern = re.compile(r"\s*" + "".join(body) + r"\s*", re.S)
        return cls(tuple(before), opener, terminator, pattern, trailing)


def _loose(literal: str) -> str:
    """A literal inside a header, any run of whitespace in it matching any other."""
    return r"\s*".join(re.escape(piece) for piece in literal.split()) if literal.strip() else r"\s*"


@dataclass(frozen=True)
class XmlFormat:
    """What the reader looks for, compiled from an ``XmlCalls``."""

    call: Header
    param: Header
    value_close: str
    value_lead: bool  # the format puts a newline before each value
    value_trail: bool  # ... and after it
    end: tuple[str, ...]

    @classmethod
    def of(cls, syntax: XmlCalls) -> XmlFormat:
        param = Header.of(syntax.param, until="value")
        after_value = format_parts(syntax.param)[-1][0]
        value_close = tags(after_value)[0]
        return cls(Header.of(syntax.call), param, value_close, param.trailing.endswith("\n"),
                   after_value.startswith("\n"), tuple(tags(syntax.end)))

    @property
    def starts(self) -> tuple[str, ...]:
        """Markers that open a call: each tag before its name (a model may leave out the
        wrapper: Qwen3-Coder writes a bare ``<function=``), and the name's opener."""
        return (*self.call.tags, self.call.opener)

    def open(self, ctx: CallContext, marker: str) -> XmlCallReader:
        """A reader for one call from ``marker`` on."""
        return XmlCallReader(ctx, self, marker)


_CALL, _NAME, _PARAMS, _KEY, _VALUE, _END, _DONE, _DEAD = range(8)
_CDATA, _CDATA_END = "<![CDATA[", "]]>"


class XmlCallReader:
    """Reads one ``XmlCalls`` call from the marker that opened it. A section around the
    calls (``<minimax:tool_call>``) is the parser's to drop, like any call section."""

    def __init__(self, ctx: CallContext, fmt: XmlFormat, marker: str) -> None:
        self._ctx = ctx
        self._fmt = fmt
        self._raw = marker  # the failing call's text, for its error
        self._buf = ""
        self._state, self._tag = _NAME, 0
        self._index: int | None = None
        self._name = ""
        self._header = ""
        self._key: dict[str, str] = {}
        self._value = ""
        self._sent_value = False
        self._stream_value = False
        self._params = 0
        self._pending_tags: list[str] = []
        self._lead = False
        self._cdata: bool | None = None  # None: not known yet whether the value is CDATA
        if marker != fmt.call.opener:  # one of the tags before the name
            self._state, self._tag = _CALL, fmt.call.tags.index(marker) + 1

    # ---- the reader's interface ---------------------------------------------------------

    def feed(self, text: str) -> tuple[list[Event], str | None]:
        self._buf += text
        out: list[Event] = []
        while True:
            if self._state == _DEAD:
                rest, self._buf = self._buf, ""
                return out + self._ctx.content(rest), None
            if self._state == _DONE:
                rest, self._buf = self._buf, ""
                return out, rest
            progressed = self._step(out)
            if not progressed:
                return out, None

    def finish(self) -> tuple[list[Event], str]:
        out: list[Event] = []
        if self._state == _END:
            return out, self._buf  # a whole call; what is left is ordinary output
        if self._state in (_DONE, _DEAD):
            return out, "" if self._state == _DEAD else self._buf
        rest, self._buf = self._buf, ""
        return self._fail("tool call cut off before its end", rest), ""

    # ---- the states -----------------------------------------------------------------------

    def _step(self, out: list[Event]) -> bool:
        state = self._state
        if state == _CALL:
            tag = self._fmt.call.tags[self._tag] if self._tag < len(self._fmt.call.tags) else self._fmt.call.opener
            return self._expect((tag,), out, self._on_call_tag)
        if state == _NAME:
            return self._read_name(out)
        if state == _PARAMS:
            first = self._fmt.param.tags[0] if self._fmt.param.tags else self._fmt.param.opener
            return self._expect((first, self._fmt.end[0]), out, self._on_params)
        if state == _KEY:
            return self._read_key(out)
        if state == _VALUE:
            return self._read_value(out)
        return self._read_end(out)

    def _expect(self, markers: tuple[str, ...], out: list[Event], then: Any) -> bool:
        """Whitespace, then one of ``markers``; anything else fails the call."""
        stripped = self._buf.lstrip()
        if not stripped:
            return False
        for marker in markers:
            if stripped.startswith(marker):
                self._raw += self._buf[: len(self._buf) - len(stripped) + len(marker)]
                self._buf = stripped[len(marker):]
                then(marker, out)
                return True
        if any(marker.startswith(stripped) for marker in markers):
            return False  # too early to tell
        out += self._fail(f"unexpected text in a tool call (expected {markers[0]!r})", "")
        return True

    def _on_call_tag(self, marker: str, out: list[Event]) -> None:
        if marker == self._fmt.call.opener:
            self._state = _NAME
        else:
            self._tag += 1

    def _read_name(self, out: list[Event]) -> bool:
        call = self._fmt.call
        if call.terminator:
            ends: tuple[str, ...] = (call.terminator,)
        else:  # GLM: the name ends at its line, its first argument or the call's end
            ends = (self._param_start, self._fmt.end[0], "\n")
        before, marker, after = split_marker(self._buf, ends)
        if marker is None:
            self._header += before
            self._buf = after
            if len(self._header) > MAX_HEADER:
                out += self._fail("malformed tool call: no valid function name", "")
                return True
            return False
        header = self._header + before
        self._header = ""
        match = call.pattern.fullmatch(header)
        name = match.group("name").strip() if match else ""
        if not NAME.fullmatch(name):
            self._raw += header
            out += self._fail("malformed tool call: no valid function name", marker)
            return True
        self._raw += header + (marker if marker == call.terminator or marker == "\n" else "")
        self._buf = after if marker in (call.terminator, "\n") else marker + after
        start = self._ctx.start_call(name)
        self._index, self._name, self._params = start.index, name, 0
        out += [start, ToolCallArgsDelta(start.index, "{")]
        self._state = _PARAMS
        return True

    @property
    def _param_start(self) -> str:
        return self._fmt.param.tags[0] if self._fmt.param.tags else self._fmt.param.opener

    def _on_params(self, marker: str, out: list[Event]) -> None:
        if marker == self._fmt.end[0]:
            assert self._index is not None
            out += [ToolCallArgsDelta(self._index, "}"), ToolCallEnd(self._index)]
            self._index = None
            self._state, self._tag = _END, 1
        else:
            # The tags before the key's opener, the first of them just read.
            self._pending_tags = [*self._fmt.param.tags, self._fmt.param.opener][1:]
            self._state, self._header = _KEY, ""

    def _read_key(self, out: list[Event]) -> bool:
        if self._pending_tags:
            return self._expect((self._pending_tags[0],), out, lambda m, o: self._pending_tags.pop(0))
        param = self._fmt.param
        before, marker, after = split_marker(self._buf, (param.terminator,))
        if marker is None:
            self._header += before
            self._buf = after
            if len(self._header) > MAX_HEADER:
                out += self._fail("malformed tool call argument: no end to its key", "")
                return True
            return False
        header, self._header = self._header + before, ""
        self._raw += header + marker
        self._buf = after
        match = param.pattern.fullmatch(header)
        key = match.group("key").strip() if match else ""
        if not key:
            out += self._fail("malformed tool call argument: no key", "")
            return True
        self._key = {k: v for k, v in (match.groupdict() if match else {}).items() if v is not None}
        self._key["key"] = key
        self._value, self._sent_value, self._lead = "", False, self._fmt.value_lead
        self._cdata = None
        schema = property_schema(self._ctx.schema(self._name), key)
        self._stream_value = is_text(schema) or (schema is None and self._key.get("string") == "true")
        self._state = _VALUE
        return True

    def _read_value(self, out: list[Event]) -> bool:
        assert self._index is not None
        if self._lead:
            if not self._buf:
                return False
            self._lead = False
            if self._buf.startswith("\n"):
                self._raw += "\n"
                self._buf = self._buf[1:]
        if self._cdata is None and not self._value:
            # A value may be CDATA (MiniCPM wraps one that holds its closing tag so).
            if _CDATA.startswith(self._buf) and len(self._buf) < len(_CDATA):
                return False
            self._cdata = self._buf.startswith(_CDATA)
            if self._cdata:
                self._raw += _CDATA
                self._buf = self._buf[len(_CDATA):]
        if self._cdata:
            before, marker, after = split_marker(self._buf, (_CDATA_END,))
            self._buf = after
            self._take_value(before, out)
            if marker is None:
                return False
            self._raw += marker
            self._cdata = False
            return True
        before, marker, after = split_marker(self._buf, (self._fmt.value_close,))
        if marker is None:
            # Hold back a newline at the end: it is the layout's if the closer follows.
            keep = len(after) + (1 if before.endswith("\n") else 0)
            ready = self._buf[: len(self._buf) - keep]
            self._buf = self._buf[len(ready):]
            self._take_value(ready, out)
            return False
        if self._fmt.value_trail and before.endswith("\n"):
            before = before[:-1]
        self._take_value(before, out)
        self._raw += marker
        self._buf = after
        out += self._close_value()
        self._state = _PARAMS
        return True

    def _take_value(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        self._raw += text
        self._value += text
        if self._stream_value:
            assert self._index is not None
            if not self._sent_value:
                self._sent_value = True
                out.append(ToolCallArgsDelta(self._index, self._prefix() + '"'))
            out.append(ToolCallArgsDelta(self._index, json.dumps(text, ensure_ascii=False)[1:-1]))

    def _prefix(self) -> str:
        sep = ", " if self._params else ""
        return f"{sep}{json.dumps(self._key['key'], ensure_ascii=False)}: "

    def _close_value(self) -> list[Event]:
        assert self._index is not None
        prefix = self._prefix()
        self._params += 1
        if self._stream_value:
            return [ToolCallArgsDelta(self._index, '"' if self._sent_value else prefix + '""')]
        schema = property_schema(self._ctx.schema(self._name), self._key["key"])
        hint = {"true": False, "false": True}.get(self._key.get("string", ""))
        if hint is None and "type" in self._key:
            hint = self._key["type"] != "string"
        value = value_of(self._value, schema, json_hint=hint)
        return [ToolCallArgsDelta(self._index, prefix + json.dumps(value, ensure_ascii=False))]

    def _read_end(self, out: list[Event]) -> bool:
        """After a call's first end tag: its other end tags if they follow, then the next call."""
        if self._tag < len(self._fmt.end):
            stripped = self._buf.lstrip()
            tag = self._fmt.end[self._tag]
            if not stripped or (tag.startswith(stripped) and stripped != tag):
                return False
            if stripped.startswith(tag):
                self._raw += self._buf[: len(self._buf) - len(stripped) + len(tag)]
                self._buf = stripped[len(tag):]
                self._tag += 1
                return True
        self._state = _DONE
        return True

    def _fail(self, message: str, tail: str) -> list[Event]:
        raw = self._raw + self._header + tail  # a value's text is in _raw as it is read
        self._state = _DEAD
        self._header = ""
        return self._ctx.fail_call(message, raw, self._index)
