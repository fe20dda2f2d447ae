"""JSON pieces of tool calls: finding where a value ends, streaming arguments,
and reading call objects.

Models write a call either as its arguments alone (``[ARGS]{...}``,
``<function=f>{...}``) or as ``{"name": ..., "arguments": {...}}``. Both can
stream: ``JsonValueReader`` tracks brackets and strings to find where a value
ends without parsing it, and ``ArgsStream`` forwards the arguments object's
text as it comes. Validation happens once, at the end, with ``json.loads``.

The call-object rules follow mlx-lm (``tool_parsers/json_tools.py`` and
``mistral.py``): arguments may arrive JSON-encoded as a string, and a missing
``arguments`` means ``{}`` inside explicit call markers. We also accept Llama
3's ``parameters`` and OpenAI's ``{"type": "function", "function": {...}}``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from app.parsers.events import Event, ToolCallArgsDelta, ToolCallEnd

ARGUMENT_KEYS = ("arguments", "parameters")
# First keys a call object may open with; anything else is ordinary JSON.
CALL_KEYS = frozenset({"name", "arguments", "parameters", "function", "type", "id", "tool_name", "tool_call_id"})

_STRING = r'"(?:[^"\\]|\\.)*"'
# The head of a call object, up to where its arguments value starts.
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*(' + _STRING + r')\s*,\s*"(?:arguments|parameters)"\s*:')
_FIRST_KEY = re.compile(r"\s*\[?\s*\{\s*(" + _STRING + r")")
# A prefix that may still grow into ``[{"key"`` or ``{"key"``.
_OPENING = re.compile(r'\s*(?:\[\s*)?(?:\{\s*(?:"(?:[^"\\]|\\.)*\\?)?)?')


class JsonValueReader:
    """Finds where one JSON object, array or string ends in streamed text.

    It tracks nesting and string escapes only, so it cannot tell valid JSON
    from invalid; ``json.loads`` judges the complete text. ``kind`` is the
    value's first character; any other first character sets ``failed``.
    """

    def __init__(self) -> None:
        self.kind = ""
        self.done = False
        self.failed = False
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> int:
        """Read ``text``; return how many characters belong to the value."""
        for i, ch in enumerate(text):
            if self.done:
                return i
            if not self.kind:
                if ch.isspace():
                    continue
                self.kind = ch
                self.failed = ch not in '{["'
                self.done = self.failed
                if self.failed:
                    return i
            self._step(ch)
        return len(text)

    def _step(self, ch: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == '"':
                self._in_string = False
                self.done = self._depth == 0
        elif ch == '"':
            self._in_string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            self.done = self._depth == 0


class ArgsStream:
    """Forwards the text of an arguments object as ``ToolCallArgsDelta``s.

    Only an object streams; an arguments value of another kind (a JSON-encoded
    string, say) is read but not sent, and ``streamed`` stays ``None`` so that
    ``finish`` sends the decoded arguments instead.
    """

    def __init__(self, index: int) -> None:
        self.index = index
        self.reader = JsonValueReader()
        self.text = ""
        self._sent: list[str] = []

    @property
    def done(self) -> bool:
        """Whether the value is complete (or was not JSON at all)."""
        return self.reader.done

    @property
    def streamed(self) -> str | None:
        """The arguments text sent so far, or ``None`` if it is not streamed."""
        return "".join(self._sent) if self.reader.kind == "{" else None

    def push(self, text: str) -> tuple[list[Event], int]:
        """Read ``text``; return the deltas and how many characters it used."""
        if self.reader.done:
            return [], 0
        used = self.reader.feed(text)
        self.text += text[:used]
        piece = text[:used] if self._sent else text[:used].lstrip()
        if not piece or self.reader.kind != "{":
            return [], used
        self._sent.append(piece)
        return [ToolCallArgsDelta(self.index, piece)], used

    def finish(self, tail: str = "") -> list[Event] | str:
        """The events that close the call, or why its arguments are wrong.

        ``tail`` is the text between the value and the call's end marker.
        No value at all is a call without arguments: ``{}``.
        """
        if tail.strip():
            return "unexpected text after tool call arguments"
        if not self.reader.kind:
            return [ToolCallArgsDelta(self.index, "{}"), ToolCallEnd(self.index)]
        if not self.reader.done or self.reader.failed:
            return "tool call arguments are not complete JSON"
        value, error = decode(self.text)
        arguments = None if error else parse_arguments(value)
        if arguments is None:
            return error or "tool call arguments are not a JSON object"
        if self.streamed is not None:
            return [ToolCallEnd(self.index)]
        return [ToolCallArgsDelta(self.index, arguments), ToolCallEnd(self.index)]


@dataclass(frozen=True)
class CallSpec:
    """A parsed tool call: function name and arguments as JSON text."""

    name: str
    arguments_json: str


def decode(text: str) -> tuple[object, str | None]:
    """``json.loads`` that reports instead of raising: ``(value, error)``."""
    try:
        return json.loads(text), None
    except ValueError as exc:  # JSONDecodeError, or an integer too long to convert
        return None, f"invalid JSON in tool call: {getattr(exc, 'msg', exc)}"
    except RecursionError:  # nesting deeper than the decoder's stack
        return None, "invalid JSON in tool call: nested too deeply"


def parse_arguments(value: object) -> str | None:
    """Arguments as JSON object text, decoding a JSON-encoded string; else ``None``."""
    if isinstance(value, str):
        value, error = decode(value)
        if error:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def parse_calls(text: str, *, need_arguments: bool = False, keyed: bool = False) -> list[CallSpec] | str:
    """Read a call object or a list of them; return the calls or why not.

    ``need_arguments`` refuses objects without an arguments key: bare JSON
    output is only a call when it clearly says so. ``keyed``: a call object
    is ``{NAME: arguments}`` (Apertus).
    """
    value, error = decode(text)
    if error:
        lines = _json_lines(text)
        if lines is None:
            return error
        value = lines
    items = value if isinstance(value, list) else [value]
    if not items:
        return "empty tool call list"
    calls = []
    for item in items:
        if keyed and isinstance(item, dict) and len(item) == 1:
            (name, args), = item.items()
            item = {"name": name, "arguments": args}
        call = _call_from(item, need_arguments)
        if isinstance(call, str):
            return call
        calls.append(call)
    return calls


def _json_lines(text: str) -> list[Any] | None:
    """Several JSON values one after another (MiniMax M1's one call a line), or None."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while at < len(text):
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            break
        try:
            value, at = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        values.append(value)
    return values if len(values) > 1 else None


def _call_from(item: object, need_arguments: bool) -> CallSpec | str:
    if isinstance(item, dict) and isinstance(item.get("function"), dict):
        item = item["function"]
    if not isinstance(item, dict):
        return "tool call is not a JSON object"
    name = item.get("name", item.get("tool_name"))  # Cohere's actions say tool_name
    if not isinstance(name, str) or not name.strip():
        return "tool call has no function name"
    key = next((k for k in ARGUMENT_KEYS if k in item), None)
    if key is None and need_arguments:
        return "tool call has no arguments"
    arguments = parse_arguments(item[key] if key else {})
    if arguments is None:
        return f"arguments of tool call {name!r} are not a JSON object"
    return CallSpec(name.strip(), arguments)


def could_be_call(text: str) -> bool:
    """Whether bare JSON output starting with ``text`` may still be a call.

    Lets plain JSON answers (``{"answer": 42}``) go out as content as soon as
    their first key shows, instead of after the whole value.
    """
    match = _FIRST_KEY.match(text)
    if match:
        key, error = decode(match.group(1))
        return error is None and key in CALL_KEYS
    return _OPENING.fullmatch(text) is not None


def same_arguments(streamed: str, arguments_json: str) -> bool:
    """Whether streamed argument text decodes to the parsed arguments."""
    value, error = decode(streamed)
    return error is None and value == json.loads(arguments_json)
