"""The prefix cache's two tiers: KV in memory (inside ``mem``), and on disk under it.

The memory tier (``memory_tier.MemoryTier``) keeps sequences' KV by their tokens and
restores the longest prefix of a prompt it can restore exactly: any length of a plain
or quantized KV entry, the end or a checkpoint of one with sliding windows or recurrent
state. The disk tier (``disk_cache``) keeps what memory had, beyond restarts and
evictions: every sequence inserted in memory is also offered to it, and on a fetch it is
asked for a stored prefix longer than what memory gave; a prefix loaded from disk is
inserted in memory again (it is hot now), and the caller gets its copy.

What goes first when memory is short (``trim_to``), one entry at a time:

1. entries of a namespace (an API key, a cache_salt) that holds more than its share of
   the tier (``key_share``): one client cannot push everyone else's prefixes out;
2. then least recently used first;
3. entries a client asked to keep (a cache breakpoint: ``pin``, with a TTL) go last,
   while they are within ``pin_share`` of the tier; past it, or expired, they are
   ordinary entries. The disk tier keeps the pins too (beyond a restart), and an entry
   loaded from disk comes back into memory pinned for what its pin has left;
4. an entry a request waiting for admission matches (``hold``) never goes while held: its
   own admission must not evict the prefix it is about to read.

MLX thread only, except ``stats`` and ``close``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from app.engine.kv.disk_cache import DiskTier
from app.engine.kv.layers import SeqCache, all_trim, trim_to
from app.engine.kv.memory_tier import Entry
from app.engine.types import CacheTierStats

log = logging.getLogger("tandem.engine")
# An unload waits this long for the prefix cache's queued disk writes.
DISK_WRITES_WAIT_S = 30.0


def _short_of_the_end(cache: Any, prompt: list[int], n: int) -> tuple[Any, list[int]]:
    """``cache`` (``n`` tokens of ``prompt``) leaving at least the last prompt token to feed: cut
    back one token where every layer trims, else not usable."""
    if n < len(prompt):
        return cache, prompt[n:]
    if not all_trim(cache):
        return None, prompt
    for c in cache:
        trim_to(c, n - 1)
    return cache, prompt[n - 1:]


def owner_of(key: str) -> str:
    """The namespace part of a partition key (``TextEngine.cache_key``: model NUL namespace)."""
    return key.partition("\x00")[2]


class PrefixCache:
    """Memory tier over an optional disk tier, with per-tier counters (see the module docstring)."""

    def __init__(self, memory: Any, max_entries: int, max_bytes: int, disk: DiskTier | None = None, *,
                 key_share: float = 1.0, pin_share: float = 0.5,
                 clock: Callable[[], float] = time.monotonic) -> None:
        # A MemoryTier (BatchOps.prompt_cache: local, or mirrored on every rank).
        self.memory = memory
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.disk = disk
        self.key_share = key_share
        self.pin_share = pin_share
        self._clock = clock
        # Entries that requests waiting for admission match: never evicted while held.
        self._held: set[int] = set()
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
        n, loaded, pin_s = self._from_disk(key, prompt, cached)
        if loaded is not None:
            self._insert_memory(key, prompt[:n], loaded, "system", pin_s)
            cache, rest = self.memory.fetch_nearest_cache(key, prompt)
            if len(prompt) - len(rest) < min(n, len(prompt) - 1):  # too big to stay in memory: use it as it is
                cache, rest = _short_of_the_end(loaded, prompt, n)
            return cache, rest, "disk" if cache is not None else None
        if tier == "memory":
            self._mem.hits += 1
            self._mem.tokens += cached
        return cache, rest, tier

    def matched(self, key: str, prompt: list[int]) -> int:
        """How many of ``prompt``'s tokens the memory tier would give (no copy made)."""
        found = self.memory.nearest(key, prompt)
        return found[1] if found is not None else 0

    def hold(self, key: str, prompt: list[int]) -> None:
        """Keep the entry ``prompt`` matches from eviction until ``release``."""
        found = self.memory.nearest(key, prompt)
        if found is not None:
            self._held.add(id(found[0]))

    def release(self) -> None:
        self._held.clear()

    def _from_disk(self, key: str, prompt: list[int], cached: int) -> tuple[int, SeqCache | None, float]:
        """The disk tier's longest restorable prefix beyond ``cached`` tokens: its length, its
        cache, and the seconds its pin has left (a file restored at its end); a failure of the
        tier itself is logged and is a miss, never the request's failure."""
        if self.disk is None:
            return 0, None, 0.0
        try:
            found = self.disk.lookup(key, prompt, longer_than=cached)
            if found is None:
                return 0, None, 0.0
            entry, n = found
            pin_s = max(0.0, entry.pinned_until - time.time()) if n == entry.n_tokens else 0.0
            return n, self.disk.load(entry, n, prompt), pin_s
        except Exception:  # noqa: BLE001 - the memory tier and a prefill still serve the request
            log.exception("prompt cache: disk tier lookup failed")
            return 0, None, 0.0

    def insert_cache(self, key: str, tokens: list[int], cache: Any, *, cache_type: str = "assistant",
                     pin_s: float = 0.0) -> None:
        """Keep ``cache`` (the KV of exactly ``tokens``) in memory, and offer it to the disk tier;
        ``pin_s``: keep it ahead of unmarked entries that long (a cache breakpoint)."""
        self._insert_memory(key, tokens, cache, cache_type, pin_s)
        if self.disk is not None:
            try:
                self.disk.offer(key, tokens, cache, time.time() + pin_s if pin_s > 0 else 0.0)
            except Exception:  # noqa: BLE001 - a prefix not written is a later miss, nothing worse
                log.exception("prompt cache: could not queue a disk write")

    def _insert_memory(self, key: str, tokens: list[int], cache: Any, cache_type: str, pin_s: float = 0.0) -> None:
        until = self._clock() + pin_s if pin_s > 0 else 0.0
        seq = cache if isinstance(cache, SeqCache) else SeqCache(cache)  # a mirrored one keeps its handle
        self.memory.insert_cache(key, list(tokens), seq, cache_type=cache_type, owner=owner_of(key),
                                 pinned_until=until)
        self.trim_to(n_bytes=self.max_bytes, n_sequences=self.max_entries)

    def trim_to(self, *, n_bytes: int, n_sequences: int | None = None) -> None:
        """Evict memory entries down to these limits, in the order the module docstring gives
        (the disk tier keeps them)."""
        n_sequences = self.max_entries if n_sequences is None else n_sequences
        before = len(self.memory)
        self.memory.trim_to(n_sequences=n_sequences, n_bytes=n_bytes, order=self.evict_order)
        self._mem.evictions += before - len(self.memory)

    def evict_order(self) -> list[Entry]:
        """The memory tier's entries in the order they go (the module docstring's rules)."""
        now = self._clock()
        entries = [e for e in self.memory.entries() if id(e) not in self._held]
        # Pins within their share: the ones that live longest are kept first.
        pinned: set[int] = set()
        room = self.pin_share * self.max_bytes
        for e in sorted((e for e in entries if e.pinned_until > now), key=lambda e: -e.pinned_until):
            if e.nbytes <= room:
                pinned.add(id(e))
                room -= e.nbytes
        per_owner: dict[str, int] = {}
        for e in self.memory.entries():
            per_owner[e.owner] = per_owner.get(e.owner, 0) + e.nbytes
        share = self.key_share * self.max_bytes
        over = {owner for owner, n in per_owner.items() if n > share}
        return sorted(entries, key=lambda e: (id(e) in pinned, e.owner not in over, e.last_used))

    def pin(self, key: str, tokens: list[int], seconds: float) -> bool:
        """Keep the entry of exactly ``tokens`` ahead of unmarked ones for ``seconds`` more, in
        memory and on disk; whether memory holds it."""
        if self.disk is not None:
            self.disk.pin(key, tokens, time.time() + seconds)
        return bool(self.memory.pin(key, tokens, self._clock() + seconds))

    def pin_nearest(self, key: str, prompt: list[int], seconds: float) -> None:
        """``pin`` the memory entry a fetch of ``prompt`` reads (a breakpoint within a longer
        cached prefix whose own entry is gone: the longer one keeps its KV)."""
        found = self.memory.nearest(key, prompt)
        if found is not None:
            self.pin(key, list(found[0].tokens), seconds)

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
