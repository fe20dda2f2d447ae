"""llama.cpp's real chat templates and parser tests, fetched at test set-up, never copied here.

The llama-cpp-python 0.3.36 source distribution on PyPI vendors llama.cpp: its
``models/templates/*.jinja`` and ``tests/test-chat.cpp`` are the corpus. The
archive is fetched once with pip (checked against its sha256) into a cache,
``$TANDEM_TEST_CACHE`` or ``~/.cache/tandem-tests``, and the members used are
unpacked beside it.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
from pathlib import Path

VERSION = "0.3.36"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
ARCHIVE = f"llama_cpp_python-{VERSION}.tar.gz"
PREFIX = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"


def cache_dir() -> Path:
    return Path(os.environ.get("TANDEM_TEST_CACHE", Path.home() / ".cache" / "tandem-tests"))


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch() -> Path:
    """The unpacked corpus (``templates/`` and ``test-chat.cpp``), fetching it the first time.
    ``RuntimeError`` when it cannot be had or its checksum is wrong."""
    root = cache_dir() / f"llama-cpp-{VERSION}"
    if (root / "test-chat.cpp").exists() and (root / "templates").is_dir():
        return root
    archive = cache_dir() / ARCHIVE
    if not archive.exists() or _digest(archive) != SHA256:
        archive.parent.mkdir(parents=True, exist_ok=True)
        result = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={VERSION}", "-d", str(archive.parent)],
            capture_output=True, text=True, timeout=600)
        if result.returncode or not archive.exists():
            raise RuntimeError(f"cannot fetch {ARCHIVE}: {result.stderr.strip()[-400:]}")
    if _digest(archive) != SHA256:
        raise RuntimeError(f"{archive} does not have the expected sha256 {SHA256}")
    tmp = root.with_suffix(".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            name = member.name
            if name == PREFIX + "tests/test-chat.cpp":
                target = tmp / "test-chat.cpp"
            elif name.startswith(PREFIX + "models/templates/") and name.endswith(".jinja"):
                target = tmp / "templates" / Path(name).name
            else:
                continue
            source = tar.extractfile(member)
            assert source is not None
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read())
    tmp.replace(root) if not root.exists() else None
    return root
