"""The reference tables, generated from the code at every build, so none can go stale.

A page asks for a table with a marker on a line of its own:

    <!-- generated: config app.config.schema:ModelsFile -->   models.yaml: every key, recursing into nested models
    <!-- generated: cli app.cli:build_parser -->               every command, subcommand and flag of the parser
    <!-- generated: endpoints app.main:create_app -->          every route of the Litestar app
    <!-- generated: metrics app/api/metrics.py -->            every metric the module defines
    <!-- generated: docstring app.engine.mlx_internals -->     a module's docstring, as Markdown

The marker is replaced by Markdown before the page is converted. An unknown kind, a target
that does not exist, or a table that comes out empty raises, and so fails the build
(``mkdocs build --strict`` runs in scripts/test.sh). A models.yaml key with neither a
``Field(description=...)`` nor a comment above it is a warning, which --strict fails too.

Where the facts come from:

- config: the pydantic classes' ``model_fields`` (type, default, constraints, description);
  a field without a description falls back on the ``#`` comment above it in the class's
  source (or the comment of the field group it sits in), and a nested model gets a section
  of its own, whatever the nesting (optional, lists, maps, unions of models keyed on a
  literal field such as ``role``).
- cli: the argparse parser's actions (flags, choices, defaults, help), recursively.
- endpoints: the app ``create_app`` builds around a stand-in state that holds only real
  settings and real metrics: no engine starts and no model loads. Whether a route needs the
  API key is read from its guards in an app built with a key set.
- metrics: the module's source, read with ``ast``: each ``Counter`` / ``Histogram`` /
  ``*MetricFamily`` call, with the loops over literal tuples that name several of them.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import logging
import os
import re
import sys
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!--\s*generated:\s*(?P<kind>[\w-]+)\s+(?P<target>\S+)\s*-->\s*$", re.MULTILINE)
log = logging.getLogger("mkdocs.hooks.reference")


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if "<!-- generated:" not in markdown:
        return markdown
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))

    def replace(m: re.Match[str]) -> str:
        kind, target = m.group("kind"), m.group("target")
        render = RENDERERS.get(kind)
        if render is None:
            raise PluginError(f"{page.file.src_uri}: unknown generated table {kind!r} (known: {', '.join(RENDERERS)})")
        try:
            text = render(target)
        except PluginError:
            raise
        except Exception as exc:  # a missing module, class or function: the page is wrong, or the code moved
            raise PluginError(f"{page.file.src_uri}: generated {kind} {target}: {type(exc).__name__}: {exc}") from exc
        if not text.strip():
            raise PluginError(f"{page.file.src_uri}: generated {kind} {target} came out empty")
        return text

    out = MARKER.sub(replace, markdown)
    bad = re.search(r"^<!--\s*generated:.*$", out, re.MULTILINE)
    if bad:
        raise PluginError(f"{page.file.src_uri}: a malformed marker {bad.group(0)!r} (KIND TARGET on one line)")
    return out


def _resolve(target: str) -> Any:
    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return obj


def _cell(text: str) -> str:
    """One table cell: one line, RST ``code`` as Markdown `code`, pipes escaped outside code spans
    (inside one, the table extension leaves them alone and an escape would show)."""
    text = " ".join(re.sub(r"``([^`]+)``", r"`\1`", text).split())
    return "".join(part if part.startswith("`") else part.replace("|", "\\|")
                   for part in re.split(r"(`[^`]*`)", text))


def _code(value: Any) -> str:
    return f"`{value}`"


# ---- config: models.yaml from the pydantic classes ----------------------------------------------


def render_config(target: str) -> str:
    from pydantic import BaseModel

    root = _resolve(target)
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
                    sub_path = key + ("[]" if _is_list_of(field.annotation, sub) else "")
                    seen[sub] = sub_path
                    sections.append((sub_path, sub))
            rows.append((name, _type_text(field, seen), _default_text(cls, name, field, seen),
                         _description(cls, name, field, nested, seen, key)))
        title = _section_title(path, cls)
        out.append(f"### {title} {{#{_anchor(path)}}}\n")
        doc = inspect.getdoc(cls) if cls.__doc__ else None
        if doc and not doc.startswith(cls.__name__ + "("):
            out.append(_cell(doc) + "\n")
        out.append("| key | type | default | description |\n| --- | --- | --- | --- |")
        out += [f"| `{n}` | {t} | {d} | {e} |" for n, t, d, e in rows]
        out.append("")
    return "\n".join(out)


def _anchor(path: str) -> str:
    return "top-level" if not path else re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-")


def _section_title(path: str, cls: type) -> str:
    if not path:
        return "Top level"
    tag = _literal_tag(cls)
    return f"`{path}`" + (f" ({tag})" if tag else "")


def _literal_tag(cls: Any) -> str | None:
    """For a member of a union keyed on a literal field (``role: chat``), that key and value."""
    for name, field in cls.model_fields.items():
        if typing.get_origin(field.annotation) is typing.Literal and len(typing.get_args(field.annotation)) == 1:
            return f"`{name}: {typing.get_args(field.annotation)[0]}`"
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
        return "one of " + ", ".join(_code(a) for a in args) if len(args) > 1 else _code(args[0])
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
    return _cell(text + (" (" + ", ".join(bounds) + ")" if bounds else ""))


def _default_text(cls: Any, name: str, field: Any, seen: dict[Any, str]) -> str:
    from pydantic import BaseModel

    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "see its section"
    text = _code(_yaml(value))
    source = _default_source(cls, name)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and source and not _is_number(source):
        text += f" ({_code(source)})"  # 32 * 1024 * 1024: the source says what the number is
    return _cell(text)


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
    if not text:
        log.warning("models.yaml key %s (%s.%s) has no description: give it Field(description=...) in %s",
                    key, cls.__name__, name, cls.__module__)
    return _cell(text)


# ---- cli: the argparse parser ------------------------------------------------------------------


def render_cli(target: str) -> str:
    parser = _resolve(target)()
    if not isinstance(parser, argparse.ArgumentParser):
        raise PluginError(f"{target}() did not return an ArgumentParser")
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # the usage lines wrap the same on every machine
    try:
        return "\n".join(_parser_section(parser, parser.prog, None))
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old


def _parser_section(parser: argparse.ArgumentParser, prog: str, help_: str | None) -> Iterator[str]:
    yield f"### `{prog}` {{#{re.sub(r'[^a-z0-9]+', '-', prog.lower()).strip('-')}}}\n"
    about = help_ or parser.description
    if about:
        yield _cell(about) + "\n"
    yield "```text\n" + parser.format_usage().strip() + "\n```\n"
    options = [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
    if options:
        yield "| argument | value | default | what |\n| --- | --- | --- | --- |"
        for a in options:
            yield f"| {_cell(', '.join(f'`{s}`' for s in a.option_strings) or _code(a.metavar or a.dest))} " \
                  f"| {_cell(_cli_value(a))} | {_cell(_cli_default(a))} | {_cell(a.help or '')} |"
        yield ""
    for sub in (a for a in parser._actions if isinstance(a, argparse._SubParsersAction)):
        helps = {c.dest: c.help for c in sub._choices_actions}
        yield "| subcommand | what |\n| --- | --- |"
        for name in sub.choices:
            anchor = re.sub(r"[^a-z0-9]+", "-", f"{prog} {name}".lower()).strip("-")
            yield f"| [`{name}`](#{anchor}) | {_cell(helps.get(name) or '')} |"
        yield ""
        for name, child in sub.choices.items():
            yield from _parser_section(child, f"{prog} {name}", helps.get(name))


def _cli_value(a: argparse.Action) -> str:
    if a.nargs == 0:
        return "flag"
    if a.choices:
        return "one of " + ", ".join(f"`{c}`" for c in a.choices)
    kind = "integer" if a.type is int else "number" if a.type is float else "string"
    return f"`{a.metavar}` ({kind})" if a.metavar and a.option_strings else kind


def _cli_default(a: argparse.Action) -> str:
    if a.default in (None, argparse.SUPPRESS) or a.nargs == 0:
        return ""
    return _code(a.default)


# ---- endpoints: the Litestar app's routes -----------------------------------------------------


def render_endpoints(target: str) -> str:
    from pydantic import SecretStr

    from app.api.metrics import Metrics
    from app.config.schema import ServerSettings

    create_app = _resolve(target)

    def app_with(server: ServerSettings) -> Any:
        # create_app reads the settings and the metrics' hook; nothing here starts an engine.
        state = types.SimpleNamespace(config=types.SimpleNamespace(server=server), metrics=Metrics())
        return create_app(state)

    with_key = app_with(ServerSettings(api_key=SecretStr("docs")))
    keyed = {(r.path, m): bool(h.resolve_guards()) for r in with_key.routes for h in r.route_handlers
             for m in h.http_methods}
    rows: dict[tuple[str, str], tuple[list[str], list[bool]]] = {}
    schema_paths: list[str] = []
    for route in app_with(ServerSettings()).routes:
        # A route's handlers come in no fixed order (a set of methods each): sorted, the page is stable.
        for h in sorted(route.route_handlers, key=lambda h: sorted(h.http_methods)):
            module = getattr(h.fn, "__module__", "") or ""
            methods = sorted(m for m in h.http_methods if m != "OPTIONS")
            path = re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)
            if not methods:
                continue
            if not module.startswith("app."):  # the OpenAPI schema and its viewers
                schema_paths.append(path)
                continue
            endpoints, guarded = rows.setdefault((h.summary or (inspect.getdoc(h.fn) or "").split("\n")[0], module),
                                                 ([], []))
            endpoints += [f"{m} {path}" for m in methods]
            guarded += [keyed.get((route.path, m), False) for m in methods]
    if not rows:
        raise PluginError(f"{target}: the app has no routes of its own")
    out = ["| endpoint | what | API key | handler |", "| --- | --- | --- | --- |"]
    for (summary, module), (endpoints, guarded) in rows.items():
        out.append(f"| {', '.join(_code(e) for e in endpoints)} | {_cell(summary)} | "
                   f"{'when keys are set' if any(guarded) else 'never'} | `{module}` |")
    if schema_paths:
        base = min(schema_paths, key=len)
        others = ", ".join(_code(p) for p in sorted(set(schema_paths)) if p != base)
        out.append(f"| `GET {base}` | the OpenAPI schema and its viewers ({others}) | never | Litestar |")
    return "\n".join(out) + "\n"


# ---- metrics: the metric definitions in a module's source --------------------------------------

METRIC_KINDS = {"Counter": "counter", "Histogram": "histogram", "Gauge": "gauge", "Summary": "summary",
                "CounterMetricFamily": "counter", "GaugeMetricFamily": "gauge",
                "HistogramMetricFamily": "histogram", "SummaryMetricFamily": "summary"}


def render_metrics(target: str) -> str:
    path = ROOT / target
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: dict[str, tuple[str, str, list[str]]] = {}

    def value(node: ast.AST | None, env: dict[str, Any]) -> Any:
        if node is None:
            return None
        if isinstance(node, ast.Constant):
            return node.value
        if isinstance(node, ast.Name):
            return env.get(node.id, _Symbol(node.id))
        if isinstance(node, ast.JoinedStr):
            parts = [value(v.value if isinstance(v, ast.FormattedValue) else v, env) for v in node.values]
            if all(isinstance(p, str) for p in parts):
                return "".join(parts)
        if isinstance(node, (ast.List, ast.Tuple)):
            return [value(e, env) for e in node.elts]
        return None

    def visit(node: ast.AST, env: dict[str, Any]) -> None:
        if isinstance(node, ast.For) and isinstance(node.iter, (ast.Tuple, ast.List)):
            targets = node.target.elts if isinstance(node.target, ast.Tuple) else [node.target]
            names = [t.id if isinstance(t, ast.Name) else None for t in targets]
            for item in node.iter.elts:
                elts = item.elts if isinstance(item, ast.Tuple) and len(names) > 1 else [item]
                bound = {n: value(e, env) for n, e in zip(names, elts) if n}
                for statement in node.body:
                    visit(statement, {**env, **bound})
            return
        if isinstance(node, ast.Call):
            called = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            func = env.get(called, _Symbol(called)) if called else None
            if isinstance(func, _Symbol) and func.name in METRIC_KINDS:
                kw = {k.arg: k.value for k in node.keywords}
                name = value(node.args[0] if node.args else kw.get("name"), env)
                help_ = value(node.args[1] if len(node.args) > 1 else kw.get("documentation"), env)
                labels = value(node.args[2] if len(node.args) > 2 else kw.get("labels", kw.get("labelnames")), env)
                if not isinstance(name, str) or not isinstance(help_, str):
                    raise PluginError(f"{target}:{node.lineno}: a {func.name} whose name or help is not a literal "
                                      "(or a loop over literals): docs/hooks/reference.py cannot read it")
                kind = METRIC_KINDS[func.name]
                exposed = name + "_total" if kind == "counter" and not name.endswith("_total") else name
                found.setdefault(exposed, (kind, help_, [str(x) for x in labels or []]))
        for child in ast.iter_child_nodes(node):
            visit(child, env)

    visit(tree, {})
    if not found:
        raise PluginError(f"{target}: no metric definitions found")
    out = ["| metric | type | labels | what |", "| --- | --- | --- | --- |"]
    out += [f"| `{name}` | {kind} | {', '.join(_code(x) for x in labels)} | {_cell(help_)} |"
            for name, (kind, help_, labels) in found.items()]
    return "\n".join(out) + "\n"


class _Symbol:
    """A name the metric reader could not evaluate: a class (``CounterMetricFamily``) or a variable."""

    def __init__(self, name: str) -> None:
        self.name = name


# ---- docstring: a module's own description ----------------------------------------------------


def render_docstring(target: str) -> str:
    doc = inspect.getdoc(_resolve(target))
    if not doc:
        raise PluginError(f"{target} has no docstring")
    doc = re.sub(r"``([^`]+)``", r"`\1`", doc)
    # Markdown starts a list only after a blank line; docstrings often go straight into one.
    return re.sub(r"^([^\s-][^\n]*)\n- ", r"\1\n\n- ", doc, flags=re.MULTILINE) + "\n"


RENDERERS = {"config": render_config, "cli": render_cli, "endpoints": render_endpoints,
             "metrics": render_metrics, "docstring": render_docstring}
