"""What a constrained request must generate, and the Lark grammar that says it.

A request's constraint is one of ``JsonSchema`` (``response_format``
``json_schema``, Responses ``text.format``), ``JsonObject`` (``json_object``)
or ``ToolCalls`` (``tool_choice`` required / named / Anthropic ``any`` /
``tool``), optionally after a free ``Reasoning`` block. ``to_lark`` writes it
in llguidance's Lark dialect; JSON bodies are inline ``%json`` schemas, so no
JSON grammar is written by hand here. Tool calls keep the family's own syntax:
the ``CallSyntax`` its module in ``app.families`` declares, the one its parser
reads (the pipeline picks it per model: ``Family.call_syntax``):

    Mistral   [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]...
    Qwen      <tool_call>\\n{"name": "get_weather", "arguments": {...}}\\n</tool_call>\\n<tool_call>...
    Llama     <function=get_weather>{"city": "Paris"}</function>   or   {"name": ..., "parameters": {...}}
    generic   {"name": "get_weather", "arguments": {...}}   or, parallel, a list of them

A marker that is one special token of the tokenizer (``[TOOL_CALLS]``,
``[THINK]``) must be that token, not its spelling in text; ``to_lark`` asks
the ``special`` callback for each marker piece.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from app.families import BARE_JSON, CallSyntax

# JSON whitespace allowed at each place JSON allows it: a few spaces, or one line
# break and an indent. Bounded, so a small model cannot pad forever.
JSON_WHITESPACE = r"[ \t]{0,4}|\r?\n[ \t]{0,32}"
# Between the end of reasoning and the constrained output (``</think>\n\n``).
_AFTER_REASONING_WS = r"/[ \t\r\n]{0,4}/"


@dataclass(frozen=True)
class JsonSchema:
    """Output is one JSON value that follows ``schema``.

    ``strict``: every keyword is enforced and one llguidance does not support is
    an error (400); otherwise such keywords and formats are ignored.
    """

    schema: dict[str, Any]
    strict: bool = False


@dataclass(frozen=True)
class JsonObject:
    """Output is any one JSON object (``response_format: json_object``)."""


@dataclass(frozen=True)
class Tool:
    """A function the model may call; ``parameters`` is its arguments' JSON schema."""

    name: str
    parameters: dict[str, Any] | None = None
    strict: bool = False


@dataclass(frozen=True)
class ToolCalls:
    """Output is one or more calls (exactly one when not ``parallel``) of ``tools``.

    For ``tool_choice`` naming a function, pass just that tool. ``answer``: the
    model may write this JSON instead of calling (``tool_choice: auto`` with a
    ``response_format``, as pydantic-ai's native output asks).
    """

    tools: tuple[Tool, ...]
    syntax: CallSyntax = BARE_JSON
    parallel: bool = True
    answer: JsonSchema | JsonObject | None = None


@dataclass(frozen=True)
class Reasoning:
    """A reasoning block the model may write, unconstrained, before the constrained output.

    ``started``: the prompt already opened it (Qwen3 ends its generation prompt
    with ``<think>\\n``), so output starts inside it and must close it.
    """

    open: str
    close: str
    started: bool = False


Constraint = JsonSchema | JsonObject | ToolCalls
# Token id of a marker that is one special token, else None.
SpecialLookup = Callable[[str], int | None]


@dataclass
class _Lark:
    """A grammar under construction: named rules, in order."""

    special: SpecialLookup
    special_texts: Sequence[str]
    eos: Sequence[int]
    rules: list[str] = field(default_factory=list)

    def rule(self, name: str, body: str) -> str:
        self.rules.append(f"{name}: {body}")
        return name

    def text(self, s: str) -> str:
        """Lark items spelling ``s``: special tokens as ``<[id]>``, the rest as literals."""
        items: list[str] = []
        rest = s
        while rest:
            at, tok = min(((rest.find(t), t) for t in self.special_texts if t in rest), default=(-1, ""))
            if at < 0:
                items.append(_literal(rest))
                break
            if at:
                items.append(_literal(rest[:at]))
            items.append(f"<[{self.special(tok)}]>")
            rest = rest[at + len(tok):]
        return " ".join(items)


def _literal(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def json_item(schema: dict[str, Any], strict: bool) -> str:
    """An inline ``%json`` item with our whitespace bound (the user's own options are replaced)."""
    options = {"whitespace_pattern": JSON_WHITESPACE, "lenient": not strict}
    return "%json " + json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)


def arguments_schema(tool: Tool) -> dict[str, Any]:
    """A tool's arguments: an object, following ``parameters`` when it says more."""
    params = dict(tool.parameters or {})
    params.setdefault("type", "object")
    return params


def call_object_schema(tools: Sequence[Tool], key: str = "arguments") -> dict[str, Any]:
    """``{"name": <one of tools>, "arguments": <that tool's parameters>}``."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, key: arguments_schema(t)},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _tool_calls(g: _Lark, spec: ToolCalls) -> str:
    syntax, strict = spec.syntax, all(t.strict for t in spec.tools)
    if syntax.args is not None:
        names = [
            g.rule(f"fn_{i}", f"{_literal(t.name)} {g.text(syntax.args)} {json_item(arguments_schema(t), t.strict)}")
            for i, t in enumerate(spec.tools)
        ]
        body = " | ".join(names)
    elif not syntax.begin and spec.parallel:
        one = call_object_schema(spec.tools, syntax.arguments_key)
        body = json_item({"anyOf": [one, {"type": "array", "items": one, "minItems": 1}]}, strict)
    else:
        body = json_item(call_object_schema(spec.tools, syntax.arguments_key), strict)
    parts = [p for p in (g.text(syntax.begin), f"({body})", g.text(syntax.end)) if p]
    call = g.rule("call", " ".join(parts))
    if not spec.parallel or (not syntax.begin and syntax.args is None):
        return call
    sep = g.text(syntax.separator)
    return g.rule("calls", f"{call} ({sep} {call})*" if sep else f"{call}+")


def _body(g: _Lark, spec: Constraint) -> str:
    if isinstance(spec, JsonSchema):
        return g.rule("answer", json_item(spec.schema, spec.strict))
    if isinstance(spec, JsonObject):
        return g.rule("answer", json_item({"type": "object"}, strict=True))
    calls = _tool_calls(g, spec)
    if spec.answer is None:
        return calls
    return g.rule("body", f"{calls} | {_body(g, spec.answer)}")


def _reasoning_to_close(g: _Lark, r: Reasoning) -> str:
    """Free text up to and including the closing marker."""
    close_id = g.special(r.close)
    if close_id is not None:
        # Any token but the closer and EOS: the output cannot end inside reasoning.
        banned = ",".join(str(t) for t in (close_id, *g.eos))
        return g.rule("reasoning", f"<[^{banned}]>* <[{close_id}]>")
    # A text closer: the shortest text that ends with it (llguidance's lazy suffix).
    g.rule(f"reasoning[suffix={_literal(r.close)}]", r"/(.|\n)*/")
    return "reasoning"


def to_lark(
    spec: Constraint,
    reasoning: Reasoning | None,
    special: SpecialLookup,
    special_texts: Sequence[str],
    eos: Sequence[int],
) -> str:
    """The Lark grammar (llguidance dialect) for ``spec`` after optional ``reasoning``.

    ``special(text)`` is the id of a marker that is one special token, else None;
    ``special_texts`` are all special tokens' texts, found inside longer markers.
    """
    g = _Lark(special, special_texts, eos)
    body = _body(g, spec)
    if reasoning is None:
        start = body
    elif reasoning.started:
        start = f"{_reasoning_to_close(g, reasoning)} {_AFTER_REASONING_WS} {body}"
    else:
        think = g.rule("think", f"{g.text(reasoning.open)} {_reasoning_to_close(g, reasoning)} {_AFTER_REASONING_WS}")
        start = f"{think}? {body}"
    return "\n".join([f"start: {start}", *g.rules]) + "\n"
