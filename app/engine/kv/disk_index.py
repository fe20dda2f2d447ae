"""The disk tier's index: its files by partition and restore point, their bytes, and who goes first.

Each file holds one sequence (``n`` tokens); it can be restored at its end, and at each of
its checkpoints (``points``: position -> digest of the tokens before it; only files of a
model with sliding windows or recurrent state have them). The index files every restore
point under (partition digest, length, digest of the tokens up to there), so a lookup
hashes a prompt once and finds the longest prefix of it some file restores.

Eviction keeps the bytes within the budget, one file at a time: first the files of a
partition (an API key, a ``cache_salt``) that holds more than its share of the budget
(``key_share``), least recently used first; then least recently used first. One key's
abandoned prompts push out its own files, not everyone else's. Files a client asked to keep
(a cache breakpoint's ``pinned_until``, wall-clock time) go last while they are within
``pin_share`` of the budget (those that live longest kept first), as in memory.

Not thread-safe: ``disk_cache.DiskTier`` holds its lock around every call.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from app.engine.kv.kv_files import DamagedFileError

# A file's checkpoints, in its metadata: "p:digest" in ascending order, comma-separated.
_POINT = re.compile(r"([1-9][0-9]{0,9}):([0-9a-f]{32})")
# More checkpoints than this in one file is not something Tandem wrote.
MAX_CHECKPOINTS = 256


@dataclass
class DiskEntry:
    """One file of the index."""

    key: str  # digest of the prefix cache's partition
    n_tokens: int
    digest: str  # of the tokens
    path: Path
    size: int
    last_used: float
    # Its checkpoints: position -> digest of the tokens before it.
    points: dict[int, str] = field(default_factory=dict)
    # Kept ahead of unpinned files until then (``time.time()``; a cache breakpoint's TTL).
    pinned_until: float = 0.0

    @property
    def name(self) -> tuple[str, int, str]:
        return self.key, self.n_tokens, self.digest

    def restore_points(self) -> Iterator[tuple[int, str]]:
        """(length, digest of the tokens up to it) of each place it restores at, its end included."""
        yield from self.points.items()
        yield self.n_tokens, self.digest


def format_points(points: dict[int, str]) -> str:
    """A file's checkpoints as its metadata says them."""
    return ",".join(f"{p}:{d}" for p, d in sorted(points.items()))


def parse_points(text: str, n: int) -> dict[int, str]:
    """A file's checkpoints from its metadata: ascending positions inside its ``n`` tokens;
    DamagedFileError for anything else."""
    if not text:
        return {}
    items = text.split(",")
    if len(items) > MAX_CHECKPOINTS:
        raise DamagedFileError(f"{len(items)} checkpoints")
    points: dict[int, str] = {}
    last = 0
    for item in items:
        match = _POINT.fullmatch(item)
        if match is None or not last < int(match[1]) < n:
            raise DamagedFileError(f"checkpoint {item[:40]!r} of a {n}-token file")
        last = int(match[1])
        points[last] = match[2]
    return points


class DiskIndex:
    """Files by name and by restore point, with bytes per partition (see the module docstring)."""

    def __init__(self, budget_bytes: int, key_share: float = 1.0, pin_share: float = 0.5) -> None:
        self.budget_bytes = budget_bytes
        self.key_share = key_share
        self.pin_share = pin_share
        self.bytes = 0
        self._entries: dict[tuple[str, int, str], DiskEntry] = {}
        self._at: dict[tuple[str, int, str], list[DiskEntry]] = {}
        self._lengths: dict[str, Counter[int]] = {}
        self._key_bytes: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: tuple[str, int, str]) -> bool:
        return name in self._entries

    def add(self, entry: DiskEntry) -> None:
        """File ``entry`` (in place of one of the same name)."""
        old = self._entries.get(entry.name)
        if old is not None:
            self.forget(old)
        self._entries[entry.name] = entry
        self.bytes += entry.size
        self._key_bytes[entry.key] += entry.size
        for n, digest in entry.restore_points():
            self._at.setdefault((entry.key, n, digest), []).append(entry)
            self._lengths.setdefault(entry.key, Counter())[n] += 1

    def forget(self, entry: DiskEntry) -> bool:
        """Drop ``entry``; whether it was there."""
        if self._entries.get(entry.name) is not entry:
            return False
        del self._entries[entry.name]
        self.bytes -= entry.size
        self._key_bytes[entry.key] -= entry.size
        if self._key_bytes[entry.key] <= 0:
            del self._key_bytes[entry.key]
        for n, digest in entry.restore_points():
            at = self._at[(entry.key, n, digest)]
            at.remove(entry)
            if not at:
                del self._at[(entry.key, n, digest)]
            lengths = self._lengths[entry.key]
            lengths[n] -= 1
            if lengths[n] <= 0:
                del lengths[n]
                if not lengths:
                    del self._lengths[entry.key]
        return True

    def lengths(self, key: str, above: int, most: int) -> list[int]:
        """The restore points' lengths in ``key``'s partition in (``above``, ``most``], ascending."""
        return sorted(n for n in self._lengths.get(key, ()) if above < n <= most)

    def get(self, name: tuple[str, int, str]) -> DiskEntry | None:
        return self._entries.get(name)

    def at(self, key: str, n: int, digest: str) -> DiskEntry | None:
        """The smallest file that restores ``n`` tokens of this digest (the cheapest read)."""
        found = self._at.get((key, n, digest))
        return min(found, key=lambda e: e.size) if found else None

    def victim(self) -> DiskEntry | None:
        """The file that goes next (the module docstring's order), when over the budget."""
        if self.bytes <= self.budget_bytes or not self._entries:
            return None
        share = self.key_share * self.budget_bytes
        over = {key for key, size in self._key_bytes.items() if size > share}
        now, room, pinned = time.time(), self.pin_share * self.budget_bytes, set()
        for e in sorted((e for e in self._entries.values() if e.pinned_until > now), key=lambda e: -e.pinned_until):
            if e.size <= room:
                pinned.add(e.name)
                room -= e.size
        return min(self._entries.values(), key=lambda e: (e.name in pinned, e.key not in over, e.last_used))
