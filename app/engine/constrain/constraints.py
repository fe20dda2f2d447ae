"""What a constrained request must generate, and the Lark grammar that says it.

A request's constraint is one of ``JsonSchema`` (``response_format``
``json_schema``, Responses ``text.format``), ``JsonObject`` (``json_object``)
or ``ToolCalls`` (``tool_choice`` required / named / Anthropic ``any`` /
``tool``), optionally after a free ``Reasoning`` block. ``to_lark`` writes it
in llguidance's Lark dialect; JSON bodies are inline ``%json`` schemas, so no
JSON grammar is written by hand here. Tool calls keep the family's own syntax:
the shape its module in ``app.families`` declares, the one its parser reads
(the pipeline picks it per model: ``Family.call_syntax``). The JSON shapes are
written here, the others (XML parameters, Python calls, Gemma 4, Harmony) in
``call_shapes``:

    Mistral   [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]...
    Qwen      <tool_call>\\n{"name": "get_weather", "arguments": {...}}\\n</tool_call>\\n<tool_call>...
    Kimi      <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{...}...
    generic   {"name": "get_weather", "arguments": {...}}   or, parallel, a list of them

Parallel calls are bounded: at most ``ToolCalls.max_calls`` (``MAX_PARALLEL_CALLS``
unless the request says less), so a small model that repeats a call cannot fill
max_tokens with copies and cut the list. A marker that is one special token of the
tokenizer (``[TOOL_CALLS]``, ``[THINK]``) must be that token, not its spelling in
text; ``to_lark`` asks the ``special`` callback for each marker piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.engine.constrain.call_shapes import shape_calls
from app.engine.constrain.lark import JSON_WHITESPACE, Lark, SpecialLookup, json_item, literal
from app.families import BARE_JSON
from app.families.syntax import CallSyntax, HarmonyCalls, RecipientCalls, Syntax, format_parts

# Between the end of reasoning and the constrained output (``</think>\n\n``).
_AFTER_REASONING_WS = r"/[ \t\r\n]{0,4}/"
# The most calls one forced answer may hold when parallel calls are allowed: a bound the
# grammar keeps, so a model that repeats a call stops instead of running into max_tokens.
MAX_PARALLEL_CALLS = 8

__all__ = ["JSON_WHITESPACE", "MAX_PARALLEL_CALLS", "SpecialLookup", "json_item"]


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
    syntax: Syntax = BARE_JSON
    parallel: bool = True
    answer: JsonSchema | JsonObject | None = None
    # The most calls when ``parallel``.
    max_calls: int = MAX_PARALLEL_CALLS

    @property
    def most(self) -> int:
        """How many calls the grammar lets through."""
        return max(1, self.max_calls) if self.parallel else 1


@dataclass(frozen=True)
class Reasoning:
    """A reasoning block the model may write, unconstrained, before the constrained output.

    ``started``: the prompt already opened it (Qwen3 ends its generation prompt
    with ``<think>\\n``), so output starts inside it and must close it.
    ``closed``: the block is closed at once, empty (thinking is off, and a template with
    no switch opened the block anyway: MiniMax M2's always does).
    """

    open: str
    close: str
    started: bool = False
    closed: bool = False


Constraint = JsonSchema | JsonObject | ToolCalls


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


def _tool_calls(g: Lark, spec: ToolCalls, reasoning: bool = False) -> str:
    if not isinstance(spec.syntax, CallSyntax):
        tools = [(t.name, arguments_schema(t), t.strict) for t in spec.tools]
        return shape_calls(g, spec.syntax, tools, spec.most, reasoning)
    syntax, strict = spec.syntax, all(t.strict for t in spec.tools)
    if syntax.args is not None:
        header = format_parts(syntax.header)
        names = [
            g.rule(f"fn_{i}", " ".join(p for p in (
                *(_header_item(g, lit, ph, t.name) for lit, ph in header),
                g.text(syntax.args), json_item(arguments_schema(t), t.strict)) if p))
            for i, t in enumerate(spec.tools)
        ]
        body = " | ".join(names)
    elif syntax.keyed:
        body = json_item(_keyed_list(spec.tools, spec.most) if syntax.listed else _keyed(spec.tools), strict)
    elif syntax.lines:
        line = json_item(call_object_schema(spec.tools, syntax.arguments_key), strict)
        body = g.bounded(line, literal("\n"), spec.most)
    elif syntax.listed or (not syntax.begin and spec.parallel):
        one = call_object_schema(spec.tools, syntax.arguments_key)
        array = {"type": "array", "items": one, "minItems": 1, "maxItems": spec.most}
        body = json_item(array if syntax.listed else {"anyOf": [one, array]}, strict)
    else:
        body = json_item(call_object_schema(spec.tools, syntax.arguments_key), strict)
    parts = [p for p in (g.text(syntax.begin), f"({body})", g.text(syntax.end)) if p]
    call = g.rule("call", " ".join(parts))
    if syntax.bare or syntax.listed or syntax.lines:
        calls = call  # one JSON value (or one block) holds them all
    else:
        calls = g.rule("calls", g.bounded(call, g.text(syntax.separator), spec.most))
    opener, closer = syntax.section
    if not opener.strip():
        return calls
    return g.rule("section", " ".join(p for p in (g.text(opener), calls, g.text(closer)) if p))


def _header_item(g: Lark, text: str, placeholder: str, name: str) -> str:
    """A header's literal piece and its placeholder: the name, or a call index."""
    value = {"name": literal(name), "index": "/[0-9]{1,2}/", "id": "/[A-Za-z0-9_]{1,32}/"}.get(placeholder, "")
    return " ".join(p for p in (g.text(text) if text else "", value) if p)


def _keyed(tools: Sequence[Tool]) -> dict[str, Any]:
    """``{NAME: arguments}`` for one of ``tools`` (Apertus)."""
    options = [{"type": "object", "properties": {t.name: arguments_schema(t)}, "required": [t.name],
                "additionalProperties": False} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _keyed_list(tools: Sequence[Tool], most: int) -> dict[str, Any]:
    return {"type": "array", "items": _keyed(tools), "minItems": 1, "maxItems": most}


def _body(g: Lark, spec: Constraint, reasoning: bool = False) -> str:
    if isinstance(spec, JsonSchema):
        return g.rule("answer", json_item(spec.schema, spec.strict))
    if isinstance(spec, JsonObject):
        return g.rule("answer", json_item({"type": "object"}, strict=True))
    calls = _tool_calls(g, spec, reasoning)
    if spec.answer is None:
        return calls
    return g.rule("body", f"{calls} | {_body(g, spec.answer)}")


def _reasoning_to_close(g: Lark, r: Reasoning) -> str:
    """Free text up to and including the closing marker."""
    close_id = g.special(r.close)
    if close_id is not None:
        # Any token but the closer and EOS: the output cannot end inside reasoning.
        banned = ",".join(str(t) for t in (close_id, *g.eos))
        return g.rule("reasoning", f"<[^{banned}]>* <[{close_id}]>")
    # A text closer: the shortest text that ends with it (llguidance's lazy suffix).
    g.rule(f"reasoning[suffix={literal(r.close)}]", r"/(.|\n)*/")
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
    g = Lark(special, special_texts, eos)
    if isinstance(spec, ToolCalls) and isinstance(spec.syntax, (HarmonyCalls, RecipientCalls)):
        # Harmony's reasoning is a message of its own (the analysis channel), in the calls' grammar.
        body, reasoning = _body(g, spec, reasoning is not None), None
    else:
        body = _body(g, spec)
    if reasoning is None:
        start = body
    elif reasoning.started and reasoning.closed:
        start = f"{g.text(reasoning.close)} {_AFTER_REASONING_WS} {body}"
    elif reasoning.started:
        start = f"{_reasoning_to_close(g, reasoning)} {_AFTER_REASONING_WS} {body}"
    else:
        think = g.rule("think", f"{g.text(reasoning.open)} {_reasoning_to_close(g, reasoning)} {_AFTER_REASONING_WS}")
        start = f"{think}? {body}"
    return "\n".join([f"start: {start}", *g.rules]) + "\n"
