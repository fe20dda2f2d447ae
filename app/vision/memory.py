"""Giving freed memory back to the operating system after a big image.

glibc keeps freed memory in its arenas for reuse, one arena per thread that
allocated: a burst of image decodes on worker threads leaves hundreds of MB
that the process no longer uses but still holds (RSS stays up). ``malloc_trim``
returns the free pages of every arena. macOS and musl have no such call; their
allocators unmap big blocks on free, so there is nothing to do.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable

logger = logging.getLogger("tandem.vision")


def _find_malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL(None).malloc_trim  # this process's own C library
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_malloc_trim = _find_malloc_trim()


def release_memory() -> bool:
    """Return free heap pages to the OS where the C library allows it; whether it could."""
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True
