"""app.vision works on plain dicts: no web framework, no schemas, no API layer."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import app.vision

FORBIDDEN = ("litestar", "pydantic", "app.api")
VISION_DIR = Path(app.vision.__file__).parent


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_vision_imports_no_api_layer():
    for path in VISION_DIR.glob("*.py"):
        for name in _imports(path):
            assert not any(name == f or name.startswith(f + ".") for f in FORBIDDEN), (
                f"{path.name} imports {name}"
            )


def test_importing_vision_does_not_load_mlx_vlm():
    code = (
        "import sys, app.vision; print('mlx_vlm' in sys.modules or 'transformers' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=VISION_DIR.parents[1],
    )
    assert out.stdout.strip() == "False"
