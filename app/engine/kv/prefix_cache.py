"""The prefix cache's two tiers: KV in memory (inside ``mem``), and on disk under it.

The memory tier is mlx-lm's ``LRUPromptCache``: the nearest cached prefix of a
prompt (shorter, or longer and trimmed), copied out on a hit. Its entry and byte
limits are enforced here, after each insert, so every eviction is counted. The
disk tier (``disk_cache``) keeps what memory had, beyond restarts and evictions:
every prefix inserted in memory is also offered to it, and on a fetch it is asked
for an exact stored prefix longer than what memory gave; a prefix loaded from
disk is inserted in memory again (it is hot now), and the caller gets its copy.
MLX thread only, except ``stats`` and ``close``.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from app.engine.kv.disk_cache import DiskEntry, DiskTier
from app.engine.types import CacheTierStats

log = logging.getLogger("tandem.engine")
# The memory tier's own limits are set out of reach: this class applies them and counts evictions.
UNBOUNDED = 1 << 62
# An unload waits this long for the prefix cache's queued disk writes.
DISK_WRITES_WAIT_S = 30.0


class PrefixCache:
    """Memory tier over an optional disk tier, with per-tier counters."""

    def __init__(self, memory: Any, max_entries: int, max_bytes: int, disk: DiskTier | None = None) -> None:
        # An LRUPromptCache made with UNBOUNDED limits (BatchOps.prompt_cache: local, or mirrored on every rank).
        self.memory = memory
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.disk = disk
        self._mem = CacheTierStats(budget_bytes=max_bytes)

    def __len__(self) -> int:
        """Prefixes the memory tier holds."""
        return len(self.memory)

    @property
    def nbytes(self) -> int:
        """Bytes the memory tier holds (they count against ``mem``)."""
        return int(self.memory.nbytes)

    def fetch(self, key: str, prompt: list[int]) -> tuple[Any, list[int], str | None]:
        """The KV of the longest cached prefix of ``prompt`` (a copy the caller owns), the
        tokens it leaves to prefill, and the tier it came from (None on a miss)."""
        cache, rest = self.memory.fetch_nearest_cache(key, prompt)
        cached = len(prompt) - len(rest)
        tier = "memory" if cache is not None and cached else None
        entry, loaded = self._from_disk(key, prompt, cached)
        if entry is not None and loaded is not None:
            n = entry.n_tokens
            self._insert_memory(key, prompt[:n], loaded, "system")
            cache, rest = self.memory.fetch_nearest_cache(key, prompt)
            if len(prompt) - len(rest) < n:  # too big to stay in memory: use it as it is
                cache, rest = loaded, prompt[n:]
            return cache, rest, "disk"
        if tier == "memory":
            self._mem.hits += 1
            self._mem.tokens += cached
        return cache, rest, tier

    def _from_disk(self, key: str, prompt: list[int], cached: int) -> tuple[DiskEntry | None, Any]:
        """The disk tier's longest stored prefix beyond ``cached`` tokens, loaded; a failure
        of the tier itself is logged and is a miss, never the request's failure."""
        if self.disk is None:
            return None, None
        try:
            entry = self.disk.lookup(key, prompt, longer_than=cached)
            return entry, self.disk.load(entry, prompt) if entry is not None else None
        except Exception:  # noqa: BLE001 - the memory tier and a prefill still serve the request
            log.exception("prompt cache: disk tier lookup failed")
            return None, None

    def insert_cache(self, key: str, tokens: list[int], cache: Any, *, cache_type: str = "assistant") -> None:
        """Keep ``cache`` (the KV of exactly ``tokens``) in memory, and offer it to the disk tier."""
        self._insert_memory(key, tokens, cache, cache_type)
        if self.disk is not None:
            try:
                self.disk.offer(key, tokens, cache)
            except Exception:  # noqa: BLE001 - a prefix not written is a later miss, nothing worse
                log.exception("prompt cache: could not queue a disk write")

    def _insert_memory(self, key: str, tokens: list[int], cache: Any, cache_type: str) -> None:
        self.memory.insert_cache(key, list(tokens), cache, cache_type=cache_type)
        self.trim_to(n_bytes=self.max_bytes, n_sequences=self.max_entries)

    def trim_to(self, *, n_bytes: int, n_sequences: int | None = None) -> None:
        """Evict least recently used memory entries down to these limits (disk keeps them)."""
        before = len(self.memory)
        self.memory.trim_to(n_sequences=n_sequences, n_bytes=n_bytes)
        self._mem.evictions += before - len(self.memory)

    def collect(self) -> None:
        """Free what the disk writer has finished with (MLX thread)."""
        if self.disk is not None:
            self.disk.collect()

    def close(self, timeout: float = 30.0) -> bool:
        """Finish queued disk writes; whether they finished in time."""
        return self.disk.close(timeout) if self.disk is not None else True

    def stats(self) -> dict[str, CacheTierStats]:
        """Per-tier figures: ``memory``, and ``disk`` when there is a disk tier."""
        tiers = {"memory": replace(self._mem, bytes=self.nbytes, entries=len(self.memory))}
        if self.disk is not None:
            tiers["disk"] = self.disk.stats()
        return tiers
