"""``tandem pull --isq``: a downloaded model converted to fewer bits with mlx-lm, once.

The download itself (``tandem pull NAME|HF_ID``: one progress bar, resume, every name and hash
from the hub checked) is ``app.engine.models.hub``'s, the fetcher the server uses too.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any


def converted_dir(repo_id: str, bits: int) -> Path:
    """Where ``--isq`` writes a converted model: ``<tandem cache>/models/<owner>--<name>-q<bits>``."""
    from app.engine import cache_root

    return cache_root() / "models" / f"{repo_id.replace('/', '--').lower()}-q{bits}"


def quantize(source: Path, repo_id: str, bits: int, *, group_size: int = 64, stream: Any = None) -> Path:
    """Convert the snapshot at ``source`` with mlx-lm's convert to ``bits``-bit weights, into
    ``converted_dir``; a bar follows its stages (load, quantize, write). Done once: an existing
    conversion is reused, and a partial one (interrupted) is discarded."""
    import shutil
    import tempfile
    import time

    from tqdm import tqdm

    stream = stream or sys.stderr
    out = converted_dir(repo_id, bits)
    if (out / "config.json").is_file():
        print(f"already converted: {out}", file=stream)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    for partial in out.parent.glob(f".{out.name}.partial-*"):
        shutil.rmtree(partial, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    started = time.monotonic()
    try:
        with tqdm(total=3, desc=f"q{bits}: loading", file=stream, bar_format="{desc} {bar} {elapsed}") as bar, \
                contextlib.redirect_stdout(_StageLines(bar, bits)):
            from mlx_lm.convert import convert

            convert(str(source), str(work / "model"), quantize=True, q_bits=bits, q_group_size=group_size)
            bar.set_description_str(f"q{bits}: written")
            bar.update(bar.total - bar.n)
        (work / "model").replace(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"converted to {out} ({size / 2**20:.1f} MiB) in {time.monotonic() - started:.1f}s", file=stream)
    return out


class _StageLines:
    """Reads mlx-lm convert's ``[INFO] Loading`` / ``[INFO] Quantizing`` lines (its only sign of
    progress: the work itself is one lazy MLX graph, computed as the weights are written) to move
    the stage bar; anything else it prints is dropped."""

    STAGES = {"[INFO] Loading": "loading", "[INFO] Quantizing": "quantizing", "[INFO] Quantized": "writing"}

    def __init__(self, bar: Any, bits: int) -> None:
        self.bar, self.bits = bar, bits

    def write(self, text: str) -> int:
        for prefix, stage in self.STAGES.items():
            if text.startswith(prefix):
                self.bar.set_description_str(f"q{self.bits}: {stage}")
                if stage != "loading":
                    self.bar.update(1)
        return len(text)

    def flush(self) -> None:
        pass
