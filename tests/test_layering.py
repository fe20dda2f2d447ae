"""The direction of imports tells the design.

    api  ->  pipeline  ->  engine, parsers, config
    api  ->  vision    ->  engine
         pipeline, vision  ->  messages (the conversation's types: a leaf)
         engine, parsers  ->  families (the model families' data: a leaf)
    main, specs  ->  config, engine   (side by side; both  ->  kinds, a leaf)

engine and parsers never import the API layer, the pipeline, Litestar or
pydantic; families (the model families' data, which the engine's grammar and
the parsers both read) import nothing of the app; the pipeline never imports
the API layer, Litestar or vision (main wires the vision proxy and the native
image reader into it); vision never imports the API layer, Litestar or the
pipeline (the messages it rewrites are ``app.messages``, below both); config
and the engine never import each other (app/specs.py maps one onto the other, and
the value kinds both name are the leaf app/kinds.py); service (the
CLI's service, pull, ps and models commands) talks to the server over HTTP, never
through its modules. Every import counts, ``if TYPE_CHECKING:`` ones included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

APP = Path(__file__).resolve().parent.parent / "app"
# package -> (forbidden prefixes, allowed exceptions under them)
RULES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "engine": (("litestar", "pydantic", "app.api", "app.config", "app.parsers", "app.vision", "app.pipeline"), ()),
    "parsers": (("litestar", "pydantic", "app.api", "app.config", "app.engine", "app.vision", "app.pipeline", "mlx"),
                ()),
    "families": (("litestar", "pydantic", "app.api", "app.config", "app.engine", "app.parsers", "app.vision",
                  "app.pipeline", "app.errors", "mlx", "llguidance"), ()),
    "vision": (("litestar", "pydantic", "app.api", "app.pipeline"), ()),
    "pipeline": (("litestar", "pydantic", "app.api", "app.vision"), ()),
    "config": (("litestar", "app.api", "app.engine", "app.parsers", "app.vision", "app.pipeline", "mlx"), ()),
    # The service commands are clients of the server (HTTP) and of the service manager.
    "service": (("litestar", "uvicorn", "app.api", "app.pipeline", "app.parsers", "app.vision", "app.main",
                 "app.httpserver"), ()),
}


def imports(path: Path) -> set[str]:
    """Every module a file imports, wherever the import statement is."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


@pytest.mark.parametrize("package", sorted(RULES))
def test_layer_imports(package):
    forbidden, allowed = RULES[package]
    files = sorted((APP / package).rglob("*.py"))
    assert files
    for path in files:
        for name in imports(path):
            if any(_under(name, ok) for ok in allowed):
                continue
            bad = [f for f in forbidden if _under(name, f)]
            assert not bad, f"{path.relative_to(APP.parent)} imports {name}"


def test_messages_are_a_leaf():
    """The conversation's types sit below the pipeline and vision both: they import nothing of Tandem's."""
    assert not [name for name in imports(APP / "messages.py") if _under(name, "app")]


def test_type_checking_and_local_imports_count(tmp_path):
    """A layering break hidden behind ``if TYPE_CHECKING:`` or inside a function is still a break."""
    module = tmp_path / "m.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from app.api.state import AppState\n"
                      "def f():\n    import litestar\n")
    assert {"app.api.state", "litestar"} <= imports(module)


# Each wire format is one adapter over the pipeline: none reaches into another's module.
FORMATS = ("app.api.openai", "app.api.anthropic", "app.api.agui")


@pytest.mark.parametrize("fmt", FORMATS)
def test_wire_formats_do_not_import_each_other(fmt):
    module = APP.parent / fmt.replace(".", "/")
    files = sorted(module.rglob("*.py")) if module.is_dir() else [module.with_suffix(".py")]
    assert files and all(f.exists() for f in files)
    for path in files:
        others = [name for name in imports(path) for other in FORMATS if other != fmt and _under(name, other)]
        assert not others, f"{path.relative_to(APP.parent)} imports {others}"


# A package holds one concern; past about a dozen modules it holds several (app/engine was 30 flat).
MAX_MODULES_PER_PACKAGE = 12


def test_no_package_outgrows_one_concern():
    for package in sorted(p for p in APP.rglob("*") if p.is_dir() and p.name != "__pycache__"):
        modules = [m for m in package.glob("*.py") if m.name != "__init__.py"]
        assert len(modules) <= MAX_MODULES_PER_PACKAGE, (
            f"{package.relative_to(APP.parent)} holds {len(modules)} modules: split it by concern")


def test_engine_subpackages_say_what_they_hold():
    for package in sorted(p for p in (APP / "engine").iterdir() if p.is_dir() and p.name != "__pycache__"):
        init = package / "__init__.py"
        assert init.exists() and ast.get_docstring(ast.parse(init.read_text())), f"{package} needs a docstring"


def test_the_command_line_starts_without_mlx():
    """`tandem pull`, `ps` and `service` import the CLI and the HTTP side's error shapes, never MLX or
    transformers: a hub error is one line (transformers warns on import) and the commands stay fast."""
    import subprocess
    import sys

    code = "import sys, app.cli; print(sorted(m for m in ('mlx', 'transformers', 'mlx_lm') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=APP.parent).stdout.strip()
    assert out == "[]"


def test_the_leaf_modules_import_nothing_of_the_app():
    """app/kinds.py (the value kinds config and the engine share) and app/messages.py (the
    conversation's types) sit below everything that names them."""
    for leaf in ("kinds.py", "messages.py"):
        inside = [n for n in imports(APP / leaf) if _under(n, "app")]
        assert not inside, f"app/{leaf} imports {inside}"
