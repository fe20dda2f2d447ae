"""llama.cpp's parser test cases, read out of ``tests/test-chat.cpp``.

The cases are C++ builder chains::

    auto tst = peg_tester("models/templates/Qwen3.5-4B.jinja", detailed_debug);
    tst.test("I'm\\nthinking\\n</think>\\n\\nHello")
        .reasoning_format(COMMON_REASONING_FORMAT_AUTO)
        .tools({ special_function_tool })
        .expect(message_assist_thoughts)
        .run();

This module runs the small part of C++ those chains are written in: string
literals (raw ones too) and their concatenation, the file's tool and message
constants and helper functions, brace lists, local ``std::string`` and
``common_chat_msg`` variables, ``for (... : { ... })`` loops over templates
and ``test_lfm2_parser(path)``. Any other statement (the few blocks that call
llama.cpp's API directly) is skipped and counted in ``Corpus.skipped``, so a
new construct in a later llama.cpp shows up as fewer cases, not as wrong ones.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

_TOKEN = re.compile(
    r"""
    (?P<ws>\s+)
  | (?P<comment>//[^\n]*|/\*.*?\*/)
  | (?P<raw>(?:u8|L|u|U)?R"(?P<delim>[^(\s]{0,16})\((?P<rawbody>.*?)\)(?P=delim)")
  | (?P<str>(?:u8|L|u|U)?"(?:[^"\\\n]|\\.)*")
  | (?P<char>'(?:[^'\\\n]|\\.)+')
  | (?P<num>\d[\w.]*)
  | (?P<id>[A-Za-z_]\w*(?:::[A-Za-z_]\w*)*)
  | (?P<op>->|::|==|!=|<=|>=|&&|\|\||\+=|[{}()\[\];,.=+\-*/<>&!?:|%^~#])
    """,
    re.S | re.X,
)
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\", '"': '"', "'": "'", "a": "\a",
            "b": "\b", "f": "\f", "v": "\v", "?": "?"}


@dataclass(frozen=True)
class Tok:
    kind: str  # str | num | id | op
    text: str
    value: Any = None


def tokenize(src: str) -> list[Tok]:
    """C++ tokens, comments and whitespace dropped, string literals decoded."""
    out: list[Tok] = []
    pos = 0
    while pos < len(src):
        m = _TOKEN.match(src, pos)
        if m is None:
            raise ValueError(f"cannot read C++ at {src[pos:pos + 40]!r}")
        pos = m.end()
        kind = m.lastgroup if m.lastgroup not in ("delim", "rawbody") else "raw"
        if kind in ("ws", "comment"):
            continue
        if m.group("raw") is not None:
            out.append(Tok("str", m.group(0), m.group("rawbody")))
        elif kind == "str":
            out.append(Tok("str", m.group(0), _unescape(m.group(0)[m.group(0).index('"') + 1 : -1])))
        else:
            out.append(Tok(kind or "op", m.group(0)))
    return out


def _unescape(body: str) -> str:
    out: list[str] = []
    data = bytearray()

    def flush() -> None:
        if data:
            out.append(data.decode("utf-8", errors="replace"))
            data.clear()

    i = 0
    while i < len(body):
        ch = body[i]
        if ch != "\\":
            flush()
            out.append(ch)
            i += 1
            continue
        nxt = body[i + 1]
        if nxt == "x":
            m = re.match(r"[0-9a-fA-F]+", body[i + 2 :])
            assert m
            data.append(int(m.group(0), 16))
            i += 2 + len(m.group(0))
        elif nxt in "01234567" and re.match(r"[0-7]{2,3}", body[i + 1 :]):
            m = re.match(r"[0-7]{1,3}", body[i + 1 :])
            assert m
            data.append(int(m.group(0), 8))
            i += 1 + len(m.group(0))
        elif nxt in "uU":
            n = 4 if nxt == "u" else 8
            flush()
            out.append(chr(int(body[i + 2 : i + 2 + n], 16)))
            i += 2 + n
        else:
            flush()
            out.append(_ESCAPES.get(nxt, nxt))
            i += 2
    flush()
    return "".join(out)


@dataclass
class Msg:
    """A ``common_chat_msg``: what a test expects, or a message of its conversation."""

    role: str = ""
    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[dict[str, str]] = field(default_factory=list)
    tool_name: str = ""
    tool_call_id: str = ""
    content_parts: list[dict[str, str]] = field(default_factory=list)

    def copy(self) -> Msg:
        return Msg(self.role, self.content, self.reasoning_content, [dict(c) for c in self.tool_calls],
                   self.tool_name, self.tool_call_id, [dict(p) for p in self.content_parts])


@dataclass
class Case:
    """One ``tst.test(...)...run()`` chain."""

    template: str  # file name under models/templates
    line: int
    input: str
    params: dict[str, Any] = field(default_factory=dict)
    expect: Msg = field(default_factory=Msg)
    tools: list[dict[str, Any]] = field(default_factory=list)
    messages: list[Msg] = field(default_factory=list)

    @property
    def id(self) -> str:
        return f"{self.template.removesuffix('.jinja')}:{self.line}"


@dataclass
class Corpus:
    cases: list[Case]
    skipped: list[tuple[int, str]]


def _simple_assist(content: str = "", reasoning: str = "", name: str = "", arguments: str = "", id: str = "") -> Msg:
    msg = Msg("assistant", content, reasoning)
    if name or id:
        msg.tool_calls.append({"name": name, "arguments": arguments, "id": id})
    return msg


def _tool(vals: list[Any]) -> dict[str, Any]:
    """``common_chat_tool{name, description, parameters}`` as an OpenAI function tool's ``function``."""
    return {"name": vals[0], "description": vals[1], "parameters": json.loads(vals[2]) if vals[2].strip() else {}}


def _brace_msg(vals: list[Any]) -> Msg:
    """``common_chat_msg{role, content, content_parts, tool_calls, reasoning, tool_name, tool_call_id}``."""
    vals = vals + [""] * (7 - len(vals))
    parts = [{"type": p[0], "text": p[1]} for p in vals[2] or []]
    calls = [{"name": c[0], "arguments": c[1], "id": c[2] if len(c) > 2 else ""} for c in vals[3] or []]
    return Msg(vals[0], vals[1], vals[4], calls, vals[5], vals[6], parts)


def _calls_msg(reasoning: str, content: str, calls: list[list[str]]) -> Msg:
    msg = Msg("assistant", content, reasoning)
    msg.tool_calls = [{"name": c[0], "arguments": c[1], "id": ""} for c in calls]
    return msg


HELPERS = {
    "simple_assist_msg": _simple_assist,
    "message_with_tool_calls": lambda name, args: _simple_assist("", "", name, args),
    "message_with_tool_calls_and_reasoning": lambda name, args, r: _simple_assist("", r, name, args),
    "message_with_reasoning_content_and_multiple_tool_calls": _calls_msg,
    "message_with_content_and_tool_call": lambda c, name, args: _simple_assist(c, "", name, args),
    "message_with_reasoning_and_tool_call": lambda r, name, args: _simple_assist("", r, name, args),
}
ENUMS = {
    "COMMON_REASONING_FORMAT_NONE": "none", "COMMON_REASONING_FORMAT_AUTO": "auto",
    "COMMON_REASONING_FORMAT_DEEPSEEK": "deepseek", "COMMON_REASONING_FORMAT_DEEPSEEK_LEGACY": "deepseek_legacy",
    "COMMON_CHAT_CONTINUATION_NONE": "none", "COMMON_CHAT_CONTINUATION_CONTENT": "content",
    "COMMON_CHAT_CONTINUATION_REASONING": "reasoning",
    "COMMON_CHAT_TOOL_CHOICE_AUTO": "auto", "COMMON_CHAT_TOOL_CHOICE_REQUIRED": "required",
    "COMMON_CHAT_TOOL_CHOICE_NONE": "none",
    "true": True, "false": False, "detailed_debug": False,
}


class _Skip(Exception):
    """A statement this reader does not run."""


class Reader:
    """Runs the test functions of ``test-chat.cpp`` and collects their cases."""

    def __init__(self, src: str) -> None:
        self.toks = tokenize(src)
        self.lines = _line_index(src, self.toks)
        self.globals: dict[str, Any] = {}
        self.cases: list[Case] = []
        self.skipped: list[tuple[int, str]] = []
        self.functions: dict[str, tuple[list[str], int, int]] = {}
        self._read_globals()

    # ---- the file's top level ----------------------------------------------------------

    def _read_globals(self) -> None:
        toks, i = self.toks, 0
        while i < len(toks):
            t = toks[i]
            if t.text in ("static", "const") or (t.kind == "id" and t.text == "common_chat_tool"):
                j = i + (t.text in ("static", "const"))
                j += toks[j].text == "const"
                kind = toks[j].text
                if kind in ("common_chat_tool", "common_chat_msg") and toks[j + 1].kind == "id":
                    name = toks[j + 1].text
                    if toks[j + 2].text == "{" and kind == "common_chat_tool":
                        end = _match(toks, j + 2)
                        items = self._split(j + 3, end)
                        self.globals[name] = _tool([self._eval(a, b, {}) for a, b in items])
                        i = end + 1
                        continue
                    if toks[j + 2].text == "=":
                        end = self._stmt_end(j + 3)
                        try:
                            self.globals[name] = self._eval(j + 3, end, {})
                        except _Skip:
                            pass
                        i = end + 1
                        continue
                    if toks[j + 2].text == "{" and kind == "common_chat_msg":
                        end = _match(toks, j + 2)
                        vals = [self._eval(a, b, {}) for a, b in self._split(j + 3, end)]
                        self.globals[name] = _brace_msg(vals)
                        i = end + 1
                        continue
            if t.text == "static" and toks[i + 1].text == "void" and toks[i + 2].kind == "id":
                name = toks[i + 2].text
                close = _match(toks, i + 3)
                params = [toks[k - 1].text for k in range(i + 4, close + 1)
                          if toks[k].text in (",", ")") and toks[k - 1].kind == "id"]
                body = close + 1
                if toks[body].text == "{":
                    end = _match(toks, body)
                    self.functions[name] = (params, body, end)
                    i = end + 1
                    continue
            i += 1
        if "tools" not in self.globals:
            self.globals["tools"] = []

    def run(self, function: str = "test_template_output_peg_parsers") -> Corpus:
        _, body, end = self.functions[function]
        self._block(body + 1, end, [{}], template=None)
        return Corpus(self.cases, self.skipped)

    # ---- statements --------------------------------------------------------------------

    def _block(self, i: int, end: int, scopes: list[dict[str, Any]], template: str | None) -> None:
        scopes = [*scopes, {}]
        while i < end:
            i = self._statement(i, scopes, template)

    def _statement(self, i: int, scopes: list[dict[str, Any]], template: str | None) -> int:
        toks = self.toks
        t = toks[i]
        if t.text == "{":
            close = _match(toks, i)
            self._block(i + 1, close, scopes, template)
            return close + 1
        if t.text == ";":
            return i + 1
        if t.text == "for":
            return self._for(i, scopes, template)
        if t.text in ("if", "while", "try", "switch"):
            return self._skip_compound(i)
        end = self._stmt_end(i)
        try:
            self._simple(i, end, scopes)
        except _Skip as exc:
            self.skipped.append((self.lines[i], str(exc)))
        return end + 1

    def _skip_compound(self, i: int) -> int:
        toks = self.toks
        self.skipped.append((self.lines[i], toks[i].text))
        j = i + 1
        if toks[j].text == "(":
            j = _match(toks, j) + 1
        j = _match(toks, j) + 1 if toks[j].text == "{" else self._stmt_end(j) + 1
        while j < len(toks) and toks[j].text in ("else", "catch"):
            j += 1
            if toks[j].text == "(":
                j = _match(toks, j) + 1
            if toks[j].text == "if":
                return self._skip_compound(j) if False else self._skip_tail(j)
            j = _match(toks, j) + 1 if toks[j].text == "{" else self._stmt_end(j) + 1
        return j

    def _skip_tail(self, j: int) -> int:
        return self._skip_compound(j)

    def _for(self, i: int, scopes: list[dict[str, Any]], template: str | None) -> int:
        toks = self.toks
        close = _match(toks, i + 1)
        colon = next(k for k in range(i + 2, close) if toks[k].text == ":")
        var = toks[colon - 1].text
        body = close + 1
        body_end = _match(toks, body) if toks[body].text == "{" else self._stmt_end(body)
        try:
            values = self._eval(colon + 1, close, scopes)
        except _Skip:
            self.skipped.append((self.lines[i], "for"))
            return body_end + 1
        for value in values:
            inner = [*scopes, {var: value}]
            if toks[body].text == "{":
                self._block(body + 1, body_end, inner, template)
            else:
                self._statement(body, inner, template)
        return body_end + 1

    def _simple(self, i: int, end: int, scopes: list[dict[str, Any]]) -> None:
        toks = self.toks
        # Declarations: [static] [const] TYPE [*|&] NAME [= EXPR | { ... }]
        j = i + (toks[i].text == "static")
        j += toks[j].text == "const"
        if toks[j].text == "common_chat_tool" and toks[j + 2].text == "{":
            vals = [self._eval(a, b, scopes) for a, b in self._split(j + 3, _match(toks, j + 2))]
            scopes[-1][toks[j + 1].text] = _tool(vals)
            return
        if toks[j].kind == "id" and toks[j].text in ("auto", "std::string", "common_chat_msg", "char", "json",
                                                      "std::vector", "common_chat_tool"):
            k = j + 1
            if toks[j].text == "std::vector":
                k = _match_angle(toks, k) + 1
            while toks[k].text in ("*", "&"):
                k += 1
            if toks[k].kind == "id":
                name = toks[k].text
                if k + 1 == end:
                    scopes[-1][name] = Msg() if toks[j].text == "common_chat_msg" else ""
                    return
                if toks[k + 1].text == "=":
                    value = self._eval(k + 2, end, scopes)
                    scopes[-1][name] = value.copy() if isinstance(value, Msg) else value
                    return
                raise _Skip(f"declaration of {name}")
        # Member assignment: NAME.field = EXPR
        if toks[i].kind == "id" and toks[i + 1].text == "." and toks[i + 3].text == "=":
            target = self._lookup(toks[i].text, scopes)
            if isinstance(target, Msg):
                setattr(target, toks[i + 2].text, self._eval(i + 4, end, scopes))
                return
        # A call of a test function: test_lfm2_parser(path, ...)
        if toks[i].kind == "id" and toks[i].text in self.functions and toks[i + 1].text == "(":
            params, body, fend = self.functions[toks[i].text]
            args = [self._eval(a, b, scopes) for a, b in self._split(i + 2, _match(toks, i + 1))]
            self._block(body + 1, fend, [{**self.globals, **dict(zip(params, args, strict=False))}], None)
            return
        # A test chain: tst.test(INPUT).m(...)...run()
        if toks[i].kind == "id" and toks[i + 1].text == "." and toks[i + 2].text == "test":
            self._chain(i, end, scopes)
            return
        raise _Skip(toks[i].text)

    def _chain(self, i: int, end: int, scopes: list[dict[str, Any]]) -> None:
        toks = self.toks
        tester = self._lookup(toks[i].text, scopes)
        if not isinstance(tester, _Tester):
            raise _Skip("not a peg_tester")
        case = Case(tester.template, self.lines[i], "")
        k = i + 1
        while k < end:
            assert toks[k].text == ".", toks[k]
            method = toks[k + 1].text
            close = _match(toks, k + 2)
            args = [self._eval(a, b, scopes) for a, b in self._split(k + 3, close)]
            _apply(case, method, args)
            k = close + 1
        self.cases.append(case)

    # ---- expressions -------------------------------------------------------------------

    def _eval(self, i: int, end: int, scopes: list[dict[str, Any]]) -> Any:
        terms = self._split(i, end, sep="+")
        values = [self._term(a, b, scopes) for a, b in terms]
        out = values[0]
        for v in values[1:]:
            out = out + v
        return out

    def _term(self, i: int, end: int, scopes: list[dict[str, Any]]) -> Any:
        toks = self.toks
        t = toks[i]
        if t.kind == "str":
            if not all(toks[k].kind == "str" for k in range(i, end)):
                raise _Skip("string expression")
            return "".join(toks[k].value for k in range(i, end))
        if t.text == "{":
            close = _match(toks, i)
            return [self._eval(a, b, scopes) for a, b in self._split(i + 1, close)]
        if t.kind == "id" and end == i + 1:
            if t.text in ENUMS:
                return ENUMS[t.text]
            return self._lookup(t.text, scopes)
        if t.kind == "id" and toks[i + 1].text == "(" and _match(toks, i + 1) == end - 1:
            args = [self._eval(a, b, scopes) for a, b in self._split(i + 2, end - 1)]
            if t.text in HELPERS:
                return HELPERS[t.text](*args)
            if t.text == "peg_tester":
                return _Tester(args[0].rsplit("/", 1)[-1])
            if t.text in ("std::string", "std::string_view"):
                return args[0]
            raise _Skip(f"call of {t.text}")
        raise _Skip(" ".join(toks[k].text for k in range(i, min(end, i + 6))))

    def _lookup(self, name: str, scopes: list[dict[str, Any]]) -> Any:
        for scope in reversed(scopes):
            if name in scope:
                return scope[name]
        if name in self.globals:
            return self.globals[name]
        raise _Skip(f"unknown name {name}")

    # ---- token helpers -----------------------------------------------------------------

    def _split(self, i: int, end: int, sep: str = ",") -> list[tuple[int, int]]:
        """Top-level pieces of tokens ``[i, end)`` between ``sep``s."""
        out, start, k = [], i, i
        while k < end:
            text = self.toks[k].text
            if text in "({[" and self.toks[k].kind == "op":
                k = _match(self.toks, k) + 1
                continue
            if text == sep and self.toks[k].kind == "op":
                out.append((start, k))
                start = k + 1
            k += 1
        if start < end:
            out.append((start, end))
        return out

    def _stmt_end(self, i: int) -> int:
        k = i
        while self.toks[k].text != ";":
            k = _match(self.toks, k) + 1 if self.toks[k].text in "({[" and self.toks[k].kind == "op" else k + 1
        return k


@dataclass(frozen=True)
class _Tester:
    template: str


def _apply(case: Case, method: str, args: list[Any]) -> None:
    if method == "test":
        case.input = args[0]
    elif method == "tools":
        case.tools = [t if isinstance(t, dict) else _tool(t) for t in args[0]]
    elif method == "messages":
        case.messages = [m.copy() for m in args[0]]
    elif method == "expect":
        case.expect = args[0].copy()
    elif method == "expect_content":
        case.expect.content = args[0]
    elif method == "expect_reasoning":
        case.expect.reasoning_content = args[0]
    elif method == "expect_tool_calls":
        case.expect.tool_calls = [{"name": c[0], "arguments": c[1], "id": c[2] if len(c) > 2 and c[2] else ""}
                                  for c in args[0]]
    elif method == "expect_reconstruction":
        case.params["expect_reconstruction"] = args[0] if args else True
    elif method == "run":
        pass
    else:
        case.params[method] = args[0]


def _match(toks: list[Tok], i: int) -> int:
    """The index of the bracket that closes the one at ``i``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    opener, depth = toks[i].text, 0
    for k in range(i, len(toks)):
        if toks[k].kind != "op":
            continue
        if toks[k].text == opener:
            depth += 1
        elif toks[k].text == pairs[opener]:
            depth -= 1
            if depth == 0:
                return k
    raise ValueError(f"unbalanced {opener}")


def _match_angle(toks: list[Tok], i: int) -> int:
    depth = 0
    for k in range(i, len(toks)):
        if toks[k].text == "<":
            depth += 1
        elif toks[k].text == ">":
            depth -= 1
            if depth == 0:
                return k
    raise ValueError("unbalanced <")


def _line_index(src: str, toks: list[Tok]) -> list[int]:
    """The source line of each token."""
    lines, pos = [], 0
    line = 1
    for t in toks:
        at = src.index(t.text, pos) if t.kind != "str" else src.index(t.text, pos)
        line += src.count("\n", pos, at)
        lines.append(line)
        line += t.text.count("\n")
        pos = at + len(t.text)
    return lines


def read_cases(src: str) -> Corpus:
    """Every case of ``test_template_output_peg_parsers`` (and the LFM2 tests it calls)."""
    return Reader(src).run()


def iter_templates(corpus: Corpus) -> Iterator[str]:
    """The templates the cases use, in order."""
    yield from dict.fromkeys(c.template for c in corpus.cases)
