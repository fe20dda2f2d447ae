"""Where the engine keeps what it writes: converted models, the prefix cache's disk tier."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def cache_root() -> Path:
    """Where Tandem keeps converted models and the prefix cache's disk tier.

    ``$TANDEM_CACHE_DIR`` if set; else ``~/Library/Caches/tandem`` on macOS;
    else ``$XDG_CACHE_HOME/tandem`` or ``~/.cache/tandem``.
    """
    if configured := os.environ.get("TANDEM_CACHE_DIR"):
        return Path(configured).expanduser()
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "tandem"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "tandem"
