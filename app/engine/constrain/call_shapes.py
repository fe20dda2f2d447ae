"""Forced calls in the shapes that are not JSON in markers: the grammar side of
``app.families.syntax``'s ``XmlCalls``, ``NestedXmlCalls``, ``PythonicCalls``,
``GemmaCalls`` and ``HarmonyCalls``.

A call is written as its family's parser reads it back (tests/families checks
that the two agree):

    XmlCalls        each parameter of the tool's schema in order, required ones always,
                    optional ones maybe; a string value as free text up to its closing tag,
                    an enum as one of its values, any other value as JSON
    NestedXmlCalls  the same, each value inside an element named by its key
    PythonicCalls   [name(key=value, ...)], values as JSON (which the parser reads as Python)
    GemmaCalls      call:name{key:value,...}, strings between <|"|> tokens
    HarmonyCalls    an optional analysis message, then one message to functions.name
    RecipientCalls  an optional message to self, then one message to the tool holding its call
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from app.engine.constrain.lark import Lark, json_item, literal
from app.families.syntax import (
    GemmaCalls,
    HarmonyCalls,
    NestedXmlCalls,
    PythonicCalls,
    RecipientCalls,
    Syntax,
    XmlCalls,
    format_parts,
)

# name, parameters schema (an object schema), strict
ToolSpec = tuple[str, dict[str, Any], bool]


def shape_calls(g: Lark, syntax: Syntax, tools: Sequence[ToolSpec], most: int, reasoning: bool = False) -> str:
    """The rule for one to ``most`` calls of ``tools`` in ``syntax`` (after an analysis message
    in Harmony when ``reasoning`` may come first)."""
    match syntax:
        case XmlCalls():
            calls = _repeat(g, [_xml_call(g, syntax, t) for t in tools], syntax.separator, most)
            return _section(g, syntax.section, calls)
        case NestedXmlCalls():
            calls = _repeat(g, [_nested_call(g, syntax, t) for t in tools], syntax.separator, most)
            return _section(g, syntax.section, calls)
        case PythonicCalls():
            one = g.rule("call", " | ".join(_python_call(g, t) for t in tools))
            listed = f'"[" {g.bounded(one, literal(", "), most)} "]"'
            return g.rule("calls", " ".join(p for p in (g.text(syntax.begin), listed, g.text(syntax.end)) if p))
        case GemmaCalls():
            return _repeat(g, [_gemma_call(g, syntax, t) for t in tools], "", most)
        case HarmonyCalls():
            return _harmony_call(g, syntax, tools, reasoning)
        case RecipientCalls():
            return _recipient_call(g, syntax, tools, reasoning)
    raise TypeError(f"no grammar for {syntax!r}")


def _repeat(g: Lark, calls: list[str], separator: str, most: int) -> str:
    one = g.rule("call", " | ".join(calls))
    return g.rule("calls", g.bounded(one, g.text(separator) if separator else "", most))


def _section(g: Lark, section: tuple[str, str], calls: str) -> str:
    opener, closer = section
    if not opener.strip():
        return calls
    return g.rule(g.fresh("section"), f"{g.text(opener)} {calls} {g.text(closer)}")


def _properties(params: dict[str, Any]) -> list[tuple[str, Any, bool]]:
    """A tool's properties in order: name, schema, required."""
    props = params.get("properties")
    if not isinstance(props, dict):
        return []
    required = set(params.get("required") or ())
    return [(k, v, k in required) for k, v in props.items()]


def _is_text(schema: Any) -> bool:
    """A value written as text: a string (an enum of strings too), or one that may be a string."""
    if not isinstance(schema, dict):
        return True
    kind = schema.get("type")
    kinds = {kind} if isinstance(kind, str) else set(kind or ())
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            sub_kind = sub.get("type") if isinstance(sub, dict) else None
            kinds |= {sub_kind} if isinstance(sub_kind, str) else set(sub_kind or ())
    if isinstance(schema.get("enum"), list):
        return all(isinstance(v, str) for v in schema["enum"])
    return not kinds or "string" in kinds


def _json_type(schema: Any) -> str:
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    return kind if isinstance(kind, str) else "string"


def _text_value(g: Lark, schema: Any, closer: str) -> str:
    """A text value and its closer: one of an enum's values, else free text (as long as the
    schema's minLength and maxLength say)."""
    if isinstance(schema, dict) and isinstance(schema.get("enum"), list) and schema["enum"]:
        options = " | ".join(literal(str(v)) for v in schema["enum"])
        return f"({options}) {g.text(closer)}"
    low = schema.get("minLength", 0) if isinstance(schema, dict) else 0
    high = schema.get("maxLength") if isinstance(schema, dict) else None
    if not isinstance(low, int) or low < 0:
        low = 0
    if not isinstance(high, int) or high < low:
        high = None
    return g.text_until(closer, low, high)


def _sequence(items: list[tuple[str, bool]], sep: str = "") -> str:
    """Required items always, optional ones maybe: required first when ``sep`` joins them
    (so no separator stands alone), else in order."""
    if sep:
        items = [i for i in items if i[1]] + [i for i in items if not i[1]]
        if items and not items[0][1]:  # nothing required: the first may open the rest
            first, rest = items[0][0], [f"({sep} {item})?" for item, _ in items[1:]]
            return f"({' '.join((first, *rest))})?"
    parts: list[str] = []
    for item, required in items:
        piece = f"{sep} {item}" if sep and parts else item
        parts.append(piece if required else f"({piece})?")
    return " ".join(parts)


def _format(g: Lark, fmt: str, values: dict[str, str]) -> str:
    """A format string's literal pieces and its placeholders' items."""
    items = []
    for text, placeholder in format_parts(fmt):
        if text:
            items.append(g.text(text))
        if placeholder:
            items.append(values.get(placeholder, "/[0-9]{1,2}/"))
    return " ".join(i for i in items if i)


def _xml_call(g: Lark, syntax: XmlCalls, tool: ToolSpec) -> str:
    name, params, strict = tool
    before_value, after_value = syntax.param.split("{value}", 1)
    items = []
    for key, schema, required in _properties(params):
        text = _is_text(schema)
        head = _format(g, before_value, {"key": literal(key), "string": literal("true" if text else "false"),
                                         "type": literal("string" if text else _json_type(schema))})
        closer, rest = after_value.rstrip("\n"), after_value[len(after_value.rstrip("\n")):]
        value = _text_value(g, schema, closer) if text else f"{json_item(schema, strict)} {g.text(closer)}"
        items.append((g.rule(g.fresh("param"), " ".join(p for p in (head, value, g.text(rest) if rest else "")
                                                         if p)), required))
    body = " ".join(p for p in (_format(g, syntax.call, {"name": literal(name)}), _sequence(items),
                                g.text(syntax.end)) if p)
    return g.rule(g.fresh("fn"), body)


def _nested_call(g: Lark, syntax: NestedXmlCalls, tool: ToolSpec) -> str:
    name, params, strict = tool
    items = []
    for key, schema, required in _properties(params):
        close = f"{syntax.tag}</{key}>"
        value = _text_value(g, schema, close) if _is_text(schema) else f"{json_item(schema, strict)} {g.text(close)}"
        items.append((g.rule(g.fresh("param"), f"{g.text(f'{syntax.tag}<{key}>')} {value}"), required))
    body = " ".join(p for p in (_format(g, syntax.call, {"name": literal(name)}), _sequence(items),
                                g.text(syntax.end)) if p)
    return g.rule(g.fresh("fn"), body)


def _python_call(g: Lark, tool: ToolSpec) -> str:
    name, params, strict = tool
    items = [(f"{literal(key + '=')} {json_item(schema if isinstance(schema, dict) else {}, strict)}", required)
             for key, schema, required in _properties(params)]
    return g.rule(g.fresh("fn"), f'{literal(name + "(")} {_sequence(items, literal(", "))} ")"')


def _gemma_call(g: Lark, syntax: GemmaCalls, tool: ToolSpec) -> str:
    name, params, strict = tool
    quote = g.text(syntax.quote)
    items = []
    for key, schema, required in _properties(params):
        if _is_text(schema):
            value = f"{quote} {_text_value(g, schema, syntax.quote)}"
        else:
            value = json_item(schema, strict)
        items.append((f"{literal(key + ':')} {value}", required))
    body = f'{g.text(syntax.begin)} {literal("call:" + name + "{")} {_sequence(items, literal(","))} "}}" ' \
           f'{g.text(syntax.end)}'
    return g.rule(g.fresh("fn"), body)


def _harmony_call(g: Lark, syntax: HarmonyCalls, tools: Sequence[ToolSpec], reasoning: bool) -> str:
    g.rule("analysis", f'{g.text("<|channel|>analysis" + syntax.message)} {g.text_until("<|end|>")} '
                                  f'{g.text(syntax.start)}')
    header = syntax.channel + syntax.recipient + syntax.constrain + syntax.message
    calls = [
        g.rule(g.fresh("fn"), f"{_format(g, header, {'name': literal(name)})} {json_item(params, strict)}")
        for name, params, strict in tools
    ]
    # The call's <|call|> is gpt-oss's end of generation: EOS follows the arguments.
    return g.rule("calls", f"{'analysis? ' if reasoning else ''}({' | '.join(calls)})")


def _recipient_call(g: Lark, syntax: RecipientCalls, tools: Sequence[ToolSpec], reasoning: bool) -> str:
    thought = f" to={syntax.thought}"
    g.rule("to_self", f"{g.text(thought + syntax.message)} {g.text_until(syntax.ends[0])} {g.text(syntax.start)}")
    calls = []
    for name, params, strict in tools:
        body = _section(g, syntax.body.section, _xml_call(g, syntax.body, (name, params, strict)))
        calls.append(g.rule(g.fresh("message"), f"{g.text(f' to={name}' + syntax.message)} {body}"))
    return g.rule("calls", f"{'to_self? ' if reasoning else ''}({' | '.join(calls)})")
