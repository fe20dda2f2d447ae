"""The direction of imports tells the design.

``LAYERS`` says, for each part of ``app/``, which other parts it may import; anything
else of the app it imports is a break. ``OUTSIDE`` says which libraries a part never
imports (the engine and the parsers know nothing of Litestar or pydantic; the parsers
and the families nothing of MLX). The architecture page of the docs draws its picture
from these two tables (``docs/hooks/reference.py``), so the picture is the rule.

In words: the API layer reaches the rest only through the pipeline (plus the error tree
and the request's context variables); the pipeline drives the engine, the parsers and
the config; vision rewrites ``app.messages`` with the engine and knows nothing of the
pipeline (main wires the vision proxy and the native image reader into it); config and
the engine never import each other (``app/specs.py`` maps one onto the other, and the
value kinds both name are the leaf ``app/kinds.py``); the families (the model families'
data, which the engine's grammar and the parsers both read) import nothing of the app;
service (the CLI's service, pull, ps and models commands) talks to the server over HTTP,
never through its modules. Every import counts, ``if TYPE_CHECKING:`` ones included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

APP = Path(__file__).resolve().parent.parent / "app"

# Each part of app/ (a package or a top-level module) -> the other parts it may import.
LAYERS: dict[str, tuple[str, ...]] = {
    "cli": ("httpserver", "main", "serve_distributed", "launch", "service", "config", "engine", "errors",
            "request_context"),
    "httpserver": ("main", "api", "config", "errors"),
    "main": ("api", "pipeline", "vision", "specs", "config", "engine", "errors"),
    "serve_distributed": ("specs", "config", "engine", "errors"),
    "launch": (),  # mlx.launch with an exit status: MLX's launcher, nothing of the app
    "service": ("config", "engine", "errors"),
    "api": ("pipeline", "errors", "request_context"),
    "pipeline": ("engine", "parsers", "config", "families", "messages", "errors", "request_context"),
    "vision": ("engine", "config", "messages", "errors"),
    "specs": ("config", "engine"),
    "parsers": ("families", "streamtext", "errors"),
    "engine": ("families", "kinds", "streamtext", "errors"),
    "config": ("kinds", "errors"),
    # The leaves: the model families' data, the value kinds, the conversation's types, the
    # error tree, the request's context variables, streaming text helpers.
    "families": (),
    "kinds": (),
    "messages": (),
    "errors": (),
    "request_context": (),
    "streamtext": (),
    "__main__": ("cli",),
}
# Outside libraries a part never imports.
OUTSIDE: dict[str, tuple[str, ...]] = {
    "api": ("mlx", "mlx_lm", "mlx_vlm", "mlx_embeddings"),
    "pipeline": ("litestar", "pydantic"),
    "vision": ("litestar", "pydantic"),
    "engine": ("litestar", "pydantic"),
    "parsers": ("litestar", "pydantic", "mlx"),
    "families": ("litestar", "pydantic", "mlx", "llguidance"),
    "config": ("litestar", "mlx"),
    "service": ("litestar", "uvicorn"),
}

# Inside the engine, the same rule one level down: each part of app/engine (a subpackage or a
# module) -> the other parts it may import. The engine's face (``app/engine/__init__.py``) is
# above them all: it lends their names to the rest of the app, which imports nothing else of
# the engine. (A literal, like LAYERS: the docs draw it.)
ENGINE_LAYERS: dict[str, tuple[str, ...]] = {
    "registry": (
        "roles", "batch", "models", "types", "prompt", "params", "paths", "worker", "chat_templates",
        "mlx_internals"
    ),
    "distributed": (
        "batch", "models", "step", "kv", "types", "prompt", "params", "paths", "worker", "chat_templates",
        "mlx_internals"
    ),
    "roles": (
        "batch", "speculative", "models", "types", "prompt", "params", "paths", "worker", "chat_templates",
        "mlx_internals"
    ),
    "batch": (
        "speculative", "constrain", "models", "step", "kv", "types", "prompt", "params", "paths", "worker",
        "chat_templates", "mlx_internals"
    ),
    "speculative": (
        "models", "step", "kv", "types", "prompt", "params", "paths", "worker", "chat_templates",
        "mlx_internals"
    ),
    "constrain": (),
    "models": ("step", "kv", "types", "prompt", "params", "paths", "worker", "chat_templates", "mlx_internals"),
    "step": ("kv", "types", "prompt", "params", "paths", "worker", "chat_templates", "mlx_internals"),
    "kv": ("types", "prompt", "params", "paths", "worker", "chat_templates", "mlx_internals"),
    # The leaves: what passes between the pipeline and the engine, the prompt, the parameters,
    # where files go, the one MLX thread, templates, and mlx-lm's private names.
    "types": ("prompt",),
    "prompt": ("chat_templates",),
    "params": (),
    "paths": (),
    "worker": (),
    "chat_templates": (),
    "mlx_internals": (),
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


def _part(path: Path) -> str:
    rel = path.relative_to(APP)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_every_part_of_the_app_has_a_layer():
    parts = {_part(p) for p in APP.rglob("*.py")} - {"__init__"}
    assert parts == set(LAYERS), f"add {sorted(parts - set(LAYERS))} to LAYERS, drop {sorted(set(LAYERS) - parts)}"


@pytest.mark.parametrize("part", sorted(LAYERS))
def test_layer_imports(part):
    files = sorted((APP / part).rglob("*.py")) if (APP / part).is_dir() else [APP / f"{part}.py"]
    assert files
    allowed = {part, *LAYERS[part]}
    for path in files:
        for name in imports(path):
            if _under(name, "app") and name != "app":
                assert name.split(".")[1] in allowed, f"{path.relative_to(APP.parent)} imports {name}"
            bad = [lib for lib in OUTSIDE.get(part, ()) if _under(name, lib)]
            assert not bad, f"{path.relative_to(APP.parent)} imports {name}"


def test_the_layers_have_no_cycle():
    """The picture the docs draw from LAYERS is a ladder: no part is above itself."""
    seen: dict[str, int] = {}

    def depth(part: str, path: tuple[str, ...] = ()) -> int:
        assert part not in path, f"a cycle: {' -> '.join((*path, part))}"
        if part not in seen:
            seen[part] = 1 + max((depth(p, (*path, part)) for p in LAYERS[part]), default=-1)
        return seen[part]

    for part in LAYERS:
        depth(part)


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


ENGINE = APP / "engine"


def _engine_part(path: Path) -> str:
    rel = path.relative_to(ENGINE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def test_every_part_of_the_engine_has_a_layer():
    parts = {_engine_part(p) for p in ENGINE.rglob("*.py")} - {"__init__"}
    assert parts == set(ENGINE_LAYERS), (
        f"add {sorted(parts - set(ENGINE_LAYERS))} to ENGINE_LAYERS, drop {sorted(set(ENGINE_LAYERS) - parts)}")


@pytest.mark.parametrize("part", sorted(ENGINE_LAYERS))
def test_engine_layer_imports(part):
    files = sorted((ENGINE / part).rglob("*.py")) if (ENGINE / part).is_dir() else [ENGINE / f"{part}.py"]
    assert files
    allowed = {part, *ENGINE_LAYERS[part]}
    for path in files:
        for name in imports(path):
            if _under(name, "app.engine"):
                assert name != "app.engine", f"{path.relative_to(APP.parent)} imports the engine's face from inside"
                assert name.split(".")[2] in allowed, f"{path.relative_to(APP.parent)} imports {name}"


def test_the_engine_layers_have_no_cycle():
    seen: dict[str, int] = {}

    def depth(part: str, path: tuple[str, ...] = ()) -> int:
        assert part not in path, f"a cycle: {' -> '.join((*path, part))}"
        if part not in seen:
            seen[part] = 1 + max((depth(p, (*path, part)) for p in ENGINE_LAYERS[part]), default=-1)
        return seen[part]

    for part in ENGINE_LAYERS:
        depth(part)


def test_the_app_imports_the_engine_through_its_face():
    """Outside app/engine, ``from app.engine import Registry``; never ``app.engine.registry``."""
    for path in sorted(APP.rglob("*.py")):
        if _part(path) == "engine":
            continue
        inner = sorted(name for name in imports(path) if name.startswith("app.engine."))
        assert not inner, f"{path.relative_to(APP.parent)} imports {inner}: lend the names from app/engine/__init__.py"


def test_the_face_lends_what_it_says():
    """``_FACE`` (what loads on first use) and the ``TYPE_CHECKING`` imports (what type checkers
    see) name the same things from the same modules, and every name resolves."""
    import app.engine as face

    tree = ast.parse((ENGINE / "__init__.py").read_text())
    checked: dict[str, set[str]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module
                checked.setdefault(imp.module, set()).update(a.name for a in imp.names)
    assert checked == {module: set(names) for module, names in face._FACE.items()}
    for name in face.__all__:
        assert getattr(face, name) is not None
    with pytest.raises(AttributeError):
        face.no_such_name  # noqa: B018
