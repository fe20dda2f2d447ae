"""The reference tables, generated from the code at every build, so none can go stale.

A page asks for a table with a marker on a line of its own:

    <!-- generated: config app.config.schema:ModelsFile -->   models.yaml: every key, recursing into nested models
    <!-- generated: cli app.cli:build_parser -->               every command, subcommand and flag of the parser
    <!-- generated: endpoints app.main:create_app -->          every route of the Litestar app
    <!-- generated: metrics app/api/metrics.py -->            every metric the module defines
    <!-- generated: docstring app.engine.mlx_internals -->     a module's docstring, as Markdown
    <!-- generated: layers tests/test_layering.py -->          the import rules, as a picture and a table
    <!-- generated: layers tests/test_layering.py:ENGINE_LAYERS -->  the same, inside app/engine
    <!-- generated: families app.families:FAMILIES -->        every model family: models, calls, reasoning, hints

The marker is replaced by Markdown before the page is converted. An unknown kind, a target
that does not exist, or a table that comes out empty raises, and so fails the build
(``mkdocs build --strict`` runs in scripts/test.sh). A models.yaml key with neither a
``Field(description=...)`` nor a comment above it is a warning, which --strict fails too.

Where the facts come from:

- config: the pydantic classes' ``model_fields`` (``config_tables.py``: type, default,
  bounds, description, with the source's comments where a field has no description yet).
- cli: the argparse parser's actions (flags, choices, defaults, help), recursively.
- endpoints: the app ``create_app`` builds around a stand-in state that holds only real
  settings and real metrics: no engine starts and no model loads. Whether a route needs the
  API key (or an admin key) is read from its guards in an app built with a key set.
- metrics: the module's source, read with ``ast``: each ``Counter`` / ``Histogram`` /
  ``*MetricFamily`` call, with the loops over literal tuples that name several of them.
- layers: the test's ``LAYERS`` and ``OUTSIDE`` tables (literals, read with ``ast``): each
  part of ``app/`` on a row above everything it imports, then the rules as a table; with
  ``:ENGINE_LAYERS``, the same for the parts of ``app/engine/``.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import os
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError

sys.path.insert(0, str(Path(__file__).parent))  # mkdocs loads a hook by path: its sibling is not importable
from config_tables import cell, code, render_config, resolve  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!--\s*generated:\s*(?P<kind>[\w-]+)\s+(?P<target>\S+)\s*-->\s*$", re.MULTILINE)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if "<!-- generated:" not in markdown:
        return markdown
    if sys.path[0] != str(ROOT):  # this checkout's app/, ahead of any installed copy
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


# ---- cli: the argparse parser ------------------------------------------------------------------


def render_cli(target: str) -> str:
    parser = resolve(target)()
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
        yield cell(about) + "\n"
    yield "```text\n" + parser.format_usage().strip() + "\n```\n"
    options = [a for a in parser._actions if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction))]
    if options:
        yield "| argument | value | default | what |\n| --- | --- | --- | --- |"
        for a in options:
            yield f"| {cell(', '.join(f'`{s}`' for s in a.option_strings) or code(a.metavar or a.dest))} " \
                  f"| {cell(_cli_value(a))} | {cell(_cli_default(a))} | {cell(a.help or '')} |"
        yield ""
    for sub in (a for a in parser._actions if isinstance(a, argparse._SubParsersAction)):
        helps = {c.dest: c.help for c in sub._choices_actions}
        yield "| subcommand | what |\n| --- | --- |"
        for name in sub.choices:
            anchor = re.sub(r"[^a-z0-9]+", "-", f"{prog} {name}".lower()).strip("-")
            yield f"| [`{name}`](#{anchor}) | {cell(helps.get(name) or '')} |"
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
    return code(a.default)


# ---- endpoints: the Litestar app's routes -----------------------------------------------------


# What a route needs, least first.
NEEDS = ["never", "when keys are set", "an admin key"]


def render_endpoints(target: str) -> str:
    from pydantic import SecretStr

    from app.api.metrics import Metrics
    from app.config.schema import ServerSettings

    create_app = resolve(target)

    def app_with(server: ServerSettings) -> Any:
        # create_app reads the settings and the metrics' hook; nothing here starts an engine.
        state = types.SimpleNamespace(config=types.SimpleNamespace(server=server), metrics=Metrics())
        return create_app(state)

    from app.api.guards import admin_only

    # Every route there can be: the OpenAPI schema too (server.openapi_schema).
    with_key = app_with(ServerSettings(api_key=SecretStr("docs"), openapi_schema=True))
    # Per route and method: no key, any key, or an admin key (Security: key roles).
    keyed = {(r.path, m): "an admin key" if admin_only in h.resolve_guards() else
             "when keys are set" if h.resolve_guards() else "never"
             for r in with_key.routes for h in r.route_handlers for m in h.http_methods}
    rows: dict[tuple[str, str], tuple[list[str], list[str]]] = {}
    schema_paths: list[str] = []
    schema_guarded: list[str] = []
    for route in app_with(ServerSettings(openapi_schema=True)).routes:
        # A route's handlers come in no fixed order (a set of methods each): sorted, the page is stable.
        for h in sorted(route.route_handlers, key=lambda h: sorted(h.http_methods)):
            module = getattr(h.fn, "__module__", "") or ""
            methods = sorted(m for m in h.http_methods if m != "OPTIONS")
            path = re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)
            if not methods:
                continue
            if not module.startswith("app."):  # Litestar's: the OpenAPI schema
                if "{" not in path:  # not its catch-all 404
                    schema_paths.append(path)
                    schema_guarded.append(keyed.get((route.path, "GET"), "never"))
                continue
            endpoints, guarded = rows.setdefault((h.summary or (inspect.getdoc(h.fn) or "").split("\n")[0], module),
                                                 ([], []))
            endpoints += [f"{m} {path}" for m in methods]
            guarded += [keyed.get((route.path, m), "never") for m in methods]
    if not rows:
        raise PluginError(f"{target}: the app has no routes of its own")
    out = ["| endpoint | what | API key | handler |", "| --- | --- | --- | --- |"]
    for (summary, module), (endpoints, guarded) in rows.items():
        out.append(f"| {', '.join(code(e) for e in endpoints)} | {cell(summary)} | "
                   f"{max(guarded, key=NEEDS.index)} | `{module}` |")
    if schema_paths:
        paths = ", ".join(code(f"GET {p}") for p in sorted(set(schema_paths), key=len, reverse=True))
        out.append(f"| {paths} | the OpenAPI schema as JSON, with `server.openapi_schema: true` (off by default) | "
                   f"{max(schema_guarded, key=NEEDS.index)} | Litestar |")
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
    out += [f"| `{name}` | {kind} | {', '.join(code(x) for x in labels)} | {cell(help_)} |"
            for name, (kind, help_, labels) in found.items()]
    return "\n".join(out) + "\n"


class _Symbol:
    """A name the metric reader could not evaluate: a class (``CounterMetricFamily``) or a variable."""

    def __init__(self, name: str) -> None:
        self.name = name


# ---- docstring: a module's own description ----------------------------------------------------


def render_docstring(target: str) -> str:
    doc = inspect.getdoc(resolve(target))
    if not doc:
        raise PluginError(f"{target} has no docstring")
    doc = re.sub(r"``([^`]+)``", r"`\1`", doc)
    # Markdown starts a list only after a blank line; docstrings often go straight into one.
    return re.sub(r"^([^\s-][^\n]*)\n- ", r"\1\n\n- ", doc, flags=re.MULTILINE) + "\n"


# ---- layers: the import rules tests/test_layering.py enforces -------------------------------------


def _literal(path: Path, name: str) -> Any:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.AnnAssign | ast.Assign):
            targets = [node.target] if isinstance(node, ast.AnnAssign) else node.targets
            if any(isinstance(t, ast.Name) and t.id == name for t in targets) and node.value is not None:
                return ast.literal_eval(node.value)
    raise PluginError(f"{path}: no {name} = <literal>")


def render_layers(target: str) -> str:
    file, _, table = target.partition(":")
    path = ROOT / file
    layers: dict[str, tuple[str, ...]] = _literal(path, table or "LAYERS")
    outside: dict[str, tuple[str, ...]] = _literal(path, "OUTSIDE") if not table else {}
    where = "`app/`" if not table else "`app/engine/`"
    depth: dict[str, int] = {}

    def level(part: str) -> int:  # the test checks there is no cycle
        if part not in depth:
            depth[part] = 1 + max((level(p) for p in layers[part]), default=-1)
        return depth[part]

    rows: dict[int, list[str]] = {}
    for part in layers:
        if not part.startswith("_"):
            rows.setdefault(level(part), []).append(part)
    picture = ["```", "(each part imports only parts on rows below it, and only those its rule names)", ""]
    picture += ["   ".join(sorted(rows[d])) for d in sorted(rows, reverse=True)]
    picture.append("```")
    rules = [f"| part of {where} | may import | never imports |", "| --- | --- | --- |"]
    for part in sorted((p for p in layers if not p.startswith("_")), key=lambda p: (-level(p), p)):
        rules.append(f"| `{part}` | {', '.join(code(p) for p in layers[part]) or 'nothing of the app'} | "
                     f"{', '.join(code(lib) for lib in outside.get(part, ())) or '-'} |")
    return "\n".join(picture) + "\n\n" + "\n".join(rules) + "\n"


# ---- families: the model families Tandem reads ------------------------------------------------------


def _shape(syntax: Any) -> str:
    """A call syntax in a table cell: its shape and the markers a model writes."""
    from app.families.syntax import (
        CallSyntax,
        GemmaCalls,
        HarmonyCalls,
        NestedXmlCalls,
        PythonicCalls,
        RecipientCalls,
        XmlCalls,
    )

    def show(text: str) -> str:
        return _html_code(" ".join(text.split())) if text.strip() else ""

    if isinstance(syntax, CallSyntax):
        if syntax.bare:
            return "bare JSON"
        kind = "name, then JSON" if syntax.args is not None else (
            "JSON lines" if syntax.lines else "JSON list" if syntax.listed else "JSON")
        parts = [syntax.section[0], syntax.begin, syntax.header if syntax.args is not None else "",
                 syntax.args or "", syntax.end, syntax.section[1]]
        return f"{kind}: " + " ".join(p for p in map(show, parts) if p)
    if isinstance(syntax, XmlCalls):
        return "text values: " + " ".join(p for p in map(show, (syntax.section[0], syntax.call, syntax.param,
                                                                   syntax.end, syntax.section[1])) if p)
    if isinstance(syntax, NestedXmlCalls):
        return f"nested elements: {show(syntax.call)} {show(syntax.tag + '<key>...')}"
    if isinstance(syntax, PythonicCalls):
        return f"Python calls: {show(syntax.begin + '[f(key=value)]' + syntax.end)}"
    if isinstance(syntax, GemmaCalls):
        return f"Gemma 4: {show(syntax.begin + 'call:f{key:' + syntax.quote + '...' + syntax.quote + '}' + syntax.end)}"
    if isinstance(syntax, HarmonyCalls):
        return "Harmony: " + show(syntax.channel + syntax.recipient + syntax.constrain + syntax.message)
    if isinstance(syntax, RecipientCalls):
        return f"a message to the tool: {show(' to={name}' + syntax.message)}, then " + _shape(syntax.body)
    raise PluginError(f"no description of {syntax!r}")


def render_families(target: str) -> str:
    """Every family of ``app.families.FAMILIES``: its models (its module docstring's first
    line), what it reads, its reasoning markers, where calls in reasoning go, its fallback hints."""
    families = resolve(target)
    rows = ["| `tool_parser` | Models | Calls | Reasoning | A call in reasoning | Hints when no call is rendered |",
            "|---|---|---|---|---|---|"]
    for name, family in families.items():
        doc = inspect.getdoc(sys.modules[_module_of(name)]) or ""
        models = doc.split("\n", 1)[0].split(":", 1)[0].rstrip(".")
        calls = "<br>".join(_shape(s) for s in family.writes if not (getattr(s, "bare", False)
                                                                       and len(family.writes) > 1))
        reasoning = "<br>".join(f"{_html_code(o.strip())} … {_html_code(c.strip())}" for o, c in family.reasoning)
        in_reasoning = "ends the block, is a call" if family.calls_in_reasoning else "stays reasoning"
        hints = ", ".join(" + ".join(map(_html_code, h)) if isinstance(h, tuple) else _html_code(h.strip())
                          for h in family.template_hints)
        rows.append(f"| {code(name)} | {cell(models)} | {calls} | {reasoning} | {in_reasoning} | {hints or '-'} |")
    return "\n".join(rows) + "\n"


def _html_code(text: str) -> str:
    """Code in a table cell, as HTML: markers hold pipes and backticks a code span cannot."""
    import html

    return "<code>" + html.escape(text).replace("|", "&#124;").replace("`", "&#96;") + "</code>"


def _module_of(name: str) -> str:
    import importlib

    for group in ("json_calls", "named_calls", "xml_calls", "other_calls"):
        try:
            return importlib.import_module(f"app.families.{group}.{name}").__name__
        except ModuleNotFoundError:
            continue
    raise PluginError(f"no module for family {name!r}")


RENDERERS = {"config": render_config, "cli": render_cli, "endpoints": render_endpoints,
             "metrics": render_metrics, "docstring": render_docstring, "layers": render_layers,
             "families": render_families}
