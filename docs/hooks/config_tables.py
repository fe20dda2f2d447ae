"""The models.yaml reference: a table per pydantic model, generated from ``model_fields``.

Used by ``reference.py`` (the ``config`` marker). Each field's type, bounds and default come from
pydantic; its description from ``Field(description=...)``, else from the ``#`` comment above it in
the class's source (or its group's comment), else the nested model's docstring. A nested model,
however it is nested (optional, a list, a map, a union of models keyed on a literal field such as
``role``), gets a section of its own, and the row links to it.
"""

from __future__ import annotations

import ast
import inspect
import logging
import re
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

log = logging.getLogger("mkdocs.hooks.reference")


def resolve(target: str) -> Any:
    """``module:attr.attr`` -> the object."""
    import importlib

    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return obj


def cell(text: str) -> str:
    """One table cell: one line, RST ``code`` as Markdown `code`, pipes escaped outside code spans
    (inside one, the table extension leaves them alone and an escape would show)."""
    text = " ".join(re.sub(r"``([^`]+)``", r"`\1`", text).split())
    return "".join(part if part.startswith("`") else part.replace("|", "\\|")
                   for part in re.split(r"(`[^`]*`)", text))


def code(value: Any) -> str:
    return f"`{value}`"



def render_config(target: str) -> str:
    from pydantic import BaseModel

    root = resolve(target)
    if not (inspect.isclass(root) and issubclass(root, BaseModel)):
        raise PluginError(f"{target} is not a pydantic model")
    sections: list[tuple[str, type[BaseModel]]] = [("", root)]
    seen: dict[type[BaseModel], str] = {root: ""}
    out: list[str] = []
    i = 0
    while i < len(sections):
        path, cls = sections[i]
        i += 1
        rows = []
        for name, field in cls.model_fields.items():
            key = f"{path}.{name}" if path else name
            nested = _models_in(field.annotation)
            for sub in nested:
                if sub not in seen:
                    # Members of a union keyed on a literal field get a section each: models[role: chat].
                    tag = _literal_tag(sub) if len(nested) > 1 else None
                    if _is_list_of(field.annotation, sub):
                        sub_path = key + (f"[{tag}]" if tag else "[]")
                    else:
                        sub_path = key + (f"({tag})" if tag else "")
                    seen[sub] = sub_path
                    sections.append((sub_path, sub))
            rows.append((name, _type_text(field, seen), _default_text(cls, name, field, seen),
                         _description(cls, name, field, nested, seen, key)))
        title = _section_title(path, cls)
        out.append(f"### {title} {{#{_anchor(path)}}}\n")
        doc = inspect.getdoc(cls) if cls.__doc__ else None
        if doc and not doc.startswith(cls.__name__ + "("):
            out.append(cell(doc) + "\n")
        out.append("| key | type | default | description |\n| --- | --- | --- | --- |")
        out += [f"| `{n}` | {t} | {d} | {e} |" for n, t, d, e in rows]
        out.append("")
    return "\n".join(out)


def _anchor(path: str) -> str:
    return "top-level" if not path else re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-")


def _section_title(path: str, cls: type) -> str:
    return f"`{path}`" if path else "Top level"


def _literal_tag(cls: Any) -> str | None:
    """For a member of a union keyed on a literal field (``role: chat``), that key and value."""
    for name, field in cls.model_fields.items():
        if typing.get_origin(field.annotation) is typing.Literal and len(typing.get_args(field.annotation)) == 1:
            return f"{name}: {typing.get_args(field.annotation)[0]}"
    return None


def _walk_type(ann: Any) -> Iterator[Any]:
    yield ann
    for arg in typing.get_args(ann):
        if not isinstance(arg, (str, int, float, bool)) and arg is not None:
            yield from _walk_type(arg)


def _models_in(ann: Any) -> list[Any]:
    from pydantic import BaseModel

    found: list[Any] = []
    for t in _walk_type(ann):
        if inspect.isclass(t) and issubclass(t, BaseModel) and t not in found:
            found.append(t)
    return found


def _is_list_of(ann: Any, sub: Any) -> bool:
    return any(typing.get_origin(t) in (list, tuple, set, frozenset) and any(sub in list(_walk_type(a))
               for a in typing.get_args(t)) for t in _walk_type(ann))


def _type_name(ann: Any, seen: dict[Any, str]) -> str:
    from pydantic import BaseModel, SecretStr

    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if ann is type(None):
        return "null"
    if origin is typing.Annotated:
        return _type_name(args[0], seen)
    if origin is typing.Literal:
        return "one of " + ", ".join(code(a) for a in args) if len(args) > 1 else code(args[0])
    if origin in (typing.Union, types.UnionType):
        members = [a for a in args if a is not type(None)]
        text = " or ".join(_type_name(a, seen) for a in members)
        return text + (" or `null`" if len(members) < len(args) else "")
    if origin in (list, tuple, set, frozenset):
        return "list of " + _type_name(args[0], seen) if args else "list"
    if origin is dict:
        return f"map of {_type_name(args[0], seen)} to {_type_name(args[1], seen)}" if args else "map"
    if inspect.isclass(ann) and issubclass(ann, BaseModel):
        return f"[{_section_title(seen.get(ann, ''), ann)}](#{_anchor(seen.get(ann, ''))})"
    if ann is SecretStr:
        return "string (secret)"
    names = {str: "string", int: "integer", float: "number", bool: "boolean"}
    return names.get(ann, getattr(ann, "__name__", str(ann)))


CONSTRAINTS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<", "min_length": "length ≥", "max_length": "length ≤"}


def _type_text(field: Any, seen: dict[Any, str]) -> str:
    text = _type_name(field.annotation, seen)
    bounds = [f"{sign} {getattr(m, attr)}" for m in field.metadata
              for attr, sign in CONSTRAINTS.items() if getattr(m, attr, None) is not None]
    return cell(text + (" (" + ", ".join(bounds) + ")" if bounds else ""))


def _default_text(cls: Any, name: str, field: Any, seen: dict[Any, str]) -> str:
    from pydantic import BaseModel

    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "see its section"
    text = code(_yaml(value))
    source = _default_source(cls, name)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and source and not _is_number(source):
        text += f" ({code(source)})"  # 32 * 1024 * 1024: the source says what the number is
    return cell(text)


def _is_number(source: str) -> bool:
    try:
        float(source.replace("_", ""))
    except ValueError:
        return False
    return True


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


def _class_node(cls: Any) -> tuple[ast.ClassDef, list[str]] | None:
    file = getattr(sys.modules.get(cls.__module__), "__file__", None)
    if not file:
        return None
    source = Path(file).read_text(encoding="utf-8")
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            return node, source.splitlines()
    return None


def _defining_class(cls: Any, name: str) -> Any:
    for base in cls.__mro__:
        if name in getattr(base, "__annotations__", {}):
            return base
    return cls


def _field_stmt(cls: Any, name: str) -> tuple[ast.AnnAssign, ast.ClassDef, list[str]] | None:
    found = _class_node(_defining_class(cls, name))
    if found is None:
        return None
    node, lines = found
    for stmt in node.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.target.id == name:
            return stmt, node, lines
    return None


def _default_source(cls: Any, name: str) -> str | None:
    found = _field_stmt(cls, name)
    if found is None or found[0].value is None:
        return None
    value: ast.expr | None = found[0].value
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "Field":
        value = next((k.value for k in value.keywords if k.arg == "default"), value.args[0] if value.args else None)
    return ast.unparse(value) if value is not None else None


def _comments(cls: Any, name: str) -> str:
    """The ``#`` comment that describes a field: the one right above it; else, for a field in a
    group (no blank line between them), the group's comment: the previous field's, unless that
    one names the previous field itself, then the comment that opens the group."""
    found = _field_stmt(cls, name)
    if found is None:
        return ""
    stmt, node, lines = found
    fields = [s for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
    index = fields.index(stmt)

    def own(s: ast.AnnAssign) -> str:
        return _comment_above(s, lines)

    def joined(a: ast.AnnAssign, b: ast.AnnAssign) -> bool:  # b follows a with no blank line between
        return all(lines[i].strip() for i in range((a.end_lineno or a.lineno), b.lineno - 1))

    def names_itself(s: ast.AnnAssign) -> bool:  # "0 disables min-p." is min_p's alone
        pattern = re.escape(s.target.id).replace("_", "[-_ ]")  # type: ignore[union-attr]
        return re.search(pattern, own(s), re.IGNORECASE) is not None

    def describe(i: int) -> str:
        if own(fields[i]):
            return own(fields[i])
        if i == 0 or not joined(fields[i - 1], fields[i]):
            return ""
        prev = fields[i - 1]
        if not own(prev):
            return describe(i - 1)
        if not names_itself(prev):
            return own(prev)
        head = i - 1
        while head > 0 and joined(fields[head - 1], fields[head]):
            head -= 1
        return own(fields[head]) if not names_itself(fields[head]) else ""

    return describe(index)


def _comment_above(stmt: ast.stmt, lines: list[str]) -> str:
    out: list[str] = []
    line = stmt.lineno - 2
    while line >= 0 and lines[line].strip().startswith("#"):
        out.insert(0, lines[line].strip().lstrip("#").strip())
        line -= 1
    return " ".join(out)


def _own_comment(cls: Any, name: str) -> str:
    found = _field_stmt(cls, name)
    return _comment_above(found[0], found[2]) if found else ""


def _description(cls: Any, name: str, field: Any, nested: list[Any], seen: dict[Any, str], key: str) -> str:
    # A nested model's own comment, or its class's docstring: a group's comment is not about it.
    text = field.description or (_own_comment(cls, name) if nested else _comments(cls, name))
    if nested:
        links = ", ".join(f"[{_section_title(seen[s], s)}](#{_anchor(seen[s])})" for s in nested)
        if not text:
            docs = [(inspect.getdoc(s) or "").split("\n\n")[0] for s in nested if s.__doc__]
            text = " ".join(d for d in docs if not d.startswith(nested[0].__name__ + "("))
        text = (text + " " if text else "") + f"See {links}."
    literal = typing.get_args(field.annotation)
    if not text and typing.get_origin(field.annotation) is typing.Literal and len(literal) == 1:
        text = f"`{literal[0]}` selects this table."
    if not text:
        log.warning("models.yaml key %s (%s.%s) has no description: give it Field(description=...) in %s",
                    key, cls.__name__, name, cls.__module__)
    return cell(text)
