"""The direction of imports tells the design: api -> engine, parsers, vision, config.

engine and parsers never import the API layer, Litestar or pydantic (config
types only for type checking); vision never imports the API layer or Litestar.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

APP = Path(__file__).resolve().parent.parent / "app"
RULES = {
    "engine": ("litestar", "pydantic", "app.api", "app.config", "app.parsers", "app.vision"),
    "parsers": ("litestar", "pydantic", "app.api", "app.config", "app.engine", "mlx"),
    "vision": ("litestar", "pydantic", "app.api"),
    "config": ("litestar", "app.api", "app.engine", "app.parsers", "app.vision", "mlx"),
}


def runtime_imports(path: Path) -> set[str]:
    """Modules imported at run time: everything but `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
    names = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("package", sorted(RULES))
def test_layer_imports(package):
    forbidden = RULES[package]
    for path in (APP / package).glob("*.py"):
        for name in runtime_imports(path):
            bad = [f for f in forbidden if name == f or name.startswith(f + ".")]
            assert not bad, f"app/{package}/{path.name} imports {name}"
