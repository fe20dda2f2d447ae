"""Calls written out in each call shape, as a model following its template writes them.

Independent of the parsers and the grammar: a writer knows only the syntax's
data (its markers and format strings), so a test can check that what a model
writes passes the grammar and that the parser reads it back.
"""

from __future__ import annotations

import json
from typing import Any

from app.families.syntax import (
    CallSyntax,
    GemmaCalls,
    HarmonyCalls,
    NestedXmlCalls,
    PythonicCalls,
    RecipientCalls,
    Syntax,
    XmlCalls,
    format_parts,
)

Call = tuple[str, dict[str, Any]]


def fill(fmt: str, values: dict[str, str]) -> str:
    return "".join(text + values.get(ph, "") for text, ph in format_parts(fmt))


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def write(syntax: Syntax, calls: list[Call]) -> str:
    """``calls`` in ``syntax``."""
    match syntax:
        case CallSyntax():
            return _json_calls(syntax, calls)
        case XmlCalls():
            body = syntax.separator.join(_xml_call(syntax, name, args) for name, args in calls)
            return syntax.section[0] + body + syntax.section[1]
        case NestedXmlCalls():
            body = "".join(
                fill(syntax.call, {"name": name})
                + "".join(f"{syntax.tag}<{k}>{_text(v)}{syntax.tag}</{k}>" for k, v in args.items())
                + syntax.end for name, args in calls)
            return syntax.section[0] + body + syntax.section[1]
        case PythonicCalls():
            inner = ", ".join(f"{name}({', '.join(f'{k}={json.dumps(v)}' for k, v in args.items())})"
                              for name, args in calls)
            return f"{syntax.begin}[{inner}]{syntax.end}"
        case GemmaCalls():
            return "".join(
                f"{syntax.begin}call:{name}{{"
                + ",".join(f"{k}:{syntax.quote}{v}{syntax.quote}" if isinstance(v, str) else f"{k}:{json.dumps(v)}"
                           for k, v in args.items()) + f"}}{syntax.end}" for name, args in calls)
        case RecipientCalls():
            name, args = calls[0]
            return f" to={name}{syntax.message}" + write(syntax.body, [(name, args)])
        case HarmonyCalls():
            name, args = calls[0]
            header = syntax.channel + syntax.recipient + syntax.constrain + syntax.message
            return fill(header, {"name": name}) + json.dumps(args)
    raise TypeError(syntax)


def _json_calls(syntax: CallSyntax, calls: list[Call]) -> str:
    if syntax.keyed:
        return f"{syntax.begin}{json.dumps([{n: a} for n, a in calls])}{syntax.end}"
    objects = [{"name": name, syntax.arguments_key: args} for name, args in calls]
    if syntax.bare:
        return json.dumps(objects if len(objects) > 1 else objects[0])
    if syntax.listed:
        return f"{syntax.begin}{json.dumps(objects)}{syntax.end}"
    if syntax.lines:
        return syntax.begin + "\n".join(json.dumps(obj) for obj in objects) + syntax.end
    if syntax.args is not None:
        values = [{"name": name, "index": str(i), "id": f"call{i}"} for i, (name, _) in enumerate(calls)]
        pieces = [f"{syntax.begin}{fill(syntax.header, v)}{syntax.args}{json.dumps(args)}{syntax.end}"
                  for v, (_, args) in zip(values, calls, strict=True)]
    else:
        pieces = [f"{syntax.begin}{json.dumps(obj)}{syntax.end}" for obj in objects]
    return syntax.section[0] + syntax.separator.join(pieces) + syntax.section[1]


def _xml_call(syntax: XmlCalls, name: str, args: dict[str, Any]) -> str:
    params = "".join(fill(syntax.param, {
        "key": k, "value": _text(v), "string": "true" if isinstance(v, str) else "false",
        "type": "string" if isinstance(v, str) else "object"}) for k, v in args.items())
    return fill(syntax.call, {"name": name, "index": "1"}) + params + syntax.end
