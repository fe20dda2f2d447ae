"""Importing app.vision is cheap: mlx-vlm (and transformers) load only with a captioner.

Which layers vision may import is checked with the others in tests/test_layering.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import app.vision

VISION_DIR = Path(app.vision.__file__).parent


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
