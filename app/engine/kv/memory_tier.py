"""The prefix cache's memory tier: sequences' KV by their tokens, reusable wherever exact.

Each entry is one sequence's cache (``SeqCache``: a cache per layer for its tokens, and
its checkpoints), filed under a partition key (model and namespace) in a token trie. A
prompt's lookup (``fetch``) walks the trie along the prompt and takes the longest prefix
some entry can be restored at exactly:

- an entry whose every layer trims (plain and quantized KV) can be restored at any
  length up to where it and the prompt part: copied and trimmed;
- an entry with a sliding window or a recurrent state can be restored only where it
  holds that state: at its end, or at one of its checkpoints (the state where a prompt
  or a segment ended, taken as it was prefilled). Restore points are filed in the trie
  at their depth, so the walk finds them as it passes.

At most ``len(prompt) - 1`` tokens come from the cache: a row always feeds at least its
last prompt token. What ``fetch`` returns is a copy the caller owns.

Entries are evicted least recently used first (a hit uses them), in the order of
``evict_order``: entries kept past their time (a breakpoint's ``pinned_until``) go last.
An entry whose trimmable prefix a new entry of the same sequence covers is absorbed by
it (its layers would be a copy); for an untrimmable model, its untrimmable state lives
on as one of the new entry's checkpoints. MLX thread only.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from app.engine.kv.layers import SeqCache, at_checkpoint, trims

_END = "\x00entry"  # a node's own entry
_POINTS = "\x00points"  # restore points filed at this depth: entries restorable here


@dataclass(eq=False)
class Entry:
    """One cached sequence."""

    key: str
    tokens: tuple[int, ...]
    cache: SeqCache
    nbytes: int
    # "system" (a segment's prefix, kept for other conversations) or "assistant" (a conversation's end).
    kind: str = "assistant"
    last_used: float = field(default_factory=time.monotonic)
    # Kept ahead of unmarked entries until then (a client's cache breakpoint), monotonic seconds.
    pinned_until: float = 0.0
    # Whose it is (the namespace part of the key): shares are counted per owner.
    owner: str = ""
    # Its number, in insert order: the same on every rank of a distributed launch, which
    # evicts by these numbers what rank 0 evicted (``app.engine.step.mirror``).
    serial: int = 0

    @property
    def trims(self) -> bool:
        return all(trims(c) for c in self.cache)

    def points(self) -> list[int]:
        """Where this entry can be restored, besides any length when it trims."""
        return sorted({len(self.tokens), *(p for p, _ in self.cache.checkpoints)})


class MemoryTier:
    """Entries by partition and tokens (see the module docstring)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._tries: dict[str, dict[Any, Any]] = {}
        self._entries: dict[tuple[str, tuple[int, ...]], Entry] = {}
        self._bytes = 0
        self._clock = clock
        self._serials = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def entries(self) -> Iterator[Entry]:
        return iter(self._entries.values())

    # ---- lookup ---------------------------------------------------------------------------

    def fetch_nearest_cache(self, key: str, prompt: list[int]) -> tuple[SeqCache | None, list[int]]:
        """The cache of the longest prefix of ``prompt`` an entry restores exactly (a copy), and
        the tokens left to prefill; ``(None, prompt)`` on a miss."""
        found = self.nearest(key, prompt)
        if found is None:
            return None, prompt
        entry, n = found
        entry.last_used = self._clock()
        return restore_at(entry, n), prompt[n:]

    def nearest(self, key: str, prompt: list[int]) -> tuple[Entry, int] | None:
        """The entry and length ``fetch_nearest_cache`` would use, without copying anything."""
        node = self._tries.get(key)
        if node is None or len(prompt) < 2:
            return None
        limit = len(prompt) - 1
        best: tuple[Entry, int] | None = None
        depth = 0
        while True:
            for entry in node.get(_POINTS, ()):
                best = (entry, depth)
            if depth == limit or prompt[depth] not in node:
                break
            node = node[prompt[depth]]
            depth += 1
        # Below where the walk stopped, an entry that trims can be cut back to ``depth``.
        if depth and (best is None or best[1] < depth):
            below = _first_trimmable(node)
            if below is not None:
                best = (below, depth)
        return best

    # ---- insert and evict --------------------------------------------------------------------

    def insert_cache(self, key: str, tokens: list[int], cache: list[Any], *, cache_type: str = "assistant",
                     owner: str = "", pinned_until: float = 0.0) -> Entry:
        """Keep ``cache`` (the KV of exactly ``tokens``, with its checkpoints when it is a
        ``SeqCache``) under ``key``; an entry of the same tokens is replaced."""
        seq = cache if isinstance(cache, SeqCache) else SeqCache(cache)
        tokens_t = tuple(tokens)
        old = self._entries.get((key, tokens_t))
        if old is not None:
            pinned_until = max(pinned_until, old.pinned_until)
            self._remove(old)
        self._serials += 1
        entry = Entry(key, tokens_t, seq, seq.nbytes, cache_type, self._clock(), pinned_until, owner, self._serials)
        self._absorb_prefixes(entry)
        self._add(entry)
        return entry

    def pin(self, key: str, tokens: list[int], until: float) -> bool:
        """Keep the entry of exactly ``tokens`` ahead of unmarked ones until ``until``."""
        entry = self._entries.get((key, tuple(tokens)))
        if entry is None:
            return False
        entry.pinned_until = max(entry.pinned_until, until)
        return True

    def evict_order(self) -> list[Entry]:
        """Entries in the order they go: unpinned (and expired) least recently used first,
        then pinned ones, the soonest to expire first."""
        now = self._clock()
        return sorted(self._entries.values(),
                      key=lambda e: (e.pinned_until > now, e.pinned_until if e.pinned_until > now else e.last_used))

    def serials(self) -> set[int]:
        """The numbers of the entries held."""
        return {e.serial for e in self._entries.values()}

    def evict_serials(self, serials: set[int]) -> None:
        """Evict the entries of these numbers (a follower rank, as rank 0 did)."""
        for entry in [e for e in self._entries.values() if e.serial in serials]:
            self._remove(entry)

    def trim_to(self, *, n_sequences: int | None = None, n_bytes: int | None = None,
                order: Callable[[], list[Entry]] | None = None) -> int:
        """Evict down to these limits, one entry at a time, each the first of ``order()`` (asked
        again after each eviction: an order may depend on what is left; ``evict_order`` unless
        given). Returns how many went."""
        n_sequences = max(0, n_sequences) if n_sequences is not None else 1 << 62
        n_bytes = max(0, n_bytes) if n_bytes is not None else 1 << 62
        gone = 0
        while len(self._entries) > n_sequences or self._bytes > n_bytes:
            victims = (order or self.evict_order)()
            if not victims:
                break
            self._remove(victims[0])
            gone += 1
        return gone

    # ---- the trie ----------------------------------------------------------------------------

    def _add(self, entry: Entry) -> None:
        trie = self._tries.setdefault(entry.key, {})
        points = set(entry.points())
        node = trie
        for depth, token in enumerate(entry.tokens):
            if depth in points:
                node.setdefault(_POINTS, []).append(entry)
            node = node.setdefault(token, {})
        node.setdefault(_POINTS, []).append(entry)
        node[_END] = entry
        self._entries[(entry.key, entry.tokens)] = entry
        self._bytes += entry.nbytes

    def _remove(self, entry: Entry) -> None:
        if self._entries.pop((entry.key, entry.tokens), None) is None:
            return
        self._bytes -= entry.nbytes
        trie = self._tries[entry.key]
        path = [trie]
        node = trie
        for token in entry.tokens:
            node = node[token]
            path.append(node)
        for n in path:
            points = n.get(_POINTS)
            if points and entry in points:
                points.remove(entry)
                if not points:
                    del n[_POINTS]
        if path[-1].get(_END) is entry:
            del path[-1][_END]
        for depth in range(len(entry.tokens), 0, -1):  # prune empty branches
            if path[depth]:
                break
            del path[depth - 1][entry.tokens[depth - 1]]
        if not trie:
            del self._tries[entry.key]

    def _absorb_prefixes(self, entry: Entry) -> None:
        """Entries of shorter prefixes of ``entry``'s tokens: their layers are a copy of a part of
        the new entry's. One that trims goes; for one that does not, its untrimmable state
        becomes a checkpoint of the new entry, then it goes."""
        node = self._tries.get(entry.key)
        if node is None:
            return
        absorbed: list[Entry] = []
        for token in entry.tokens:
            own = node.get(_END)
            if own is not None:
                absorbed.append(own)
            node = node.get(token)
            if node is None:
                break
        have = {p for p, _ in entry.cache.checkpoints}
        for old in absorbed:
            n = len(old.tokens)
            if not old.trims:
                for p, states in [*old.cache.checkpoints, (n, [None if trims(c) else c for c in old.cache])]:
                    if p not in have:
                        entry.cache.checkpoints.append((p, states))
                        have.add(p)
            entry.pinned_until = max(entry.pinned_until, old.pinned_until)
            self._remove(old)
        entry.cache.checkpoints.sort(key=lambda c: c[0])
        entry.nbytes = entry.cache.nbytes


def restore_at(entry: Entry, n: int) -> SeqCache:
    """A copy of ``entry``'s cache at ``n`` of its tokens (its end, a checkpoint, or any
    length when it trims)."""
    if n == len(entry.tokens):
        return SeqCache(copy.deepcopy(list(entry.cache)))
    states = dict(entry.cache.checkpoints).get(n)
    if states is None:
        states = [None] * len(entry.cache)
    return SeqCache(at_checkpoint(list(entry.cache), n, states))


def _first_trimmable(node: dict[Any, Any]) -> Entry | None:
    """Some entry below ``node`` whose every layer trims (the nearest found first)."""
    stack = [node]
    while stack:
        current = stack.pop(0)
        own = current.get(_END)
        if own is not None and own.trims:
            return own
        stack.extend(v for k, v in current.items() if k not in (_END, _POINTS))
    return None
