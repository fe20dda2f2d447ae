"""Finding markers in streamed text, which may split a marker anywhere.

``split_marker`` is the one primitive for it: it finds the earliest marker in a
buffer, or else says how much of the buffer is safe to release and which suffix
to hold back because it could be the start of a marker. The stream parsers use
it for reasoning and tool-call markers, the engine for stop strings.
"""

from __future__ import annotations

from collections.abc import Sequence


def split_marker(buf: str, markers: Sequence[str]) -> tuple[str, str | None, str]:
    """Split ``buf`` at its earliest marker: ``(before, marker, after)``.

    With no marker in ``buf``, ``marker`` is ``None``, ``before`` is safe to
    release and ``after`` is the held-back suffix that may begin a marker.
    At one position the longer marker wins.
    """
    best_at, best = -1, ""
    for marker in markers:
        at = buf.find(marker)
        if at >= 0 and (best_at < 0 or at < best_at or (at == best_at and len(marker) > len(best))):
            best_at, best = at, marker
    if best_at >= 0:
        return buf[:best_at], best, buf[best_at + len(best) :]
    keep = held_back(buf, markers)
    return buf[: len(buf) - keep], None, buf[len(buf) - keep :]


def held_back(buf: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of a marker."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(buf)), longest, -1):
            if buf.endswith(marker[:size]):
                longest = size
                break
    return longest
