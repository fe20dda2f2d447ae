"""A phase of the decode step: some rows and the batch caches that hold them.

The step keeps two phases, prefill and decode (``app.engine.step.batch``). Each holds
its rows in order and, per layer, one batch cache whose row ``i`` is ``rows[i]``'s:
mlx-lm's batch caches (``BatchKVCache``, ``BatchRotatingKVCache``, ``ArraysCache``,
``CacheList``, and ``kv_quant``'s quantized one) merge rows' own caches (``merge``), take
more rows (``extend``), drop rows (``filter``) and give one row's cache back
(``extract``). A phase never looks inside them: each layer's kind does its own part
(``app.engine.kv.layers``).
"""

from __future__ import annotations

from typing import Any

from app.engine.kv.layers import checkpoint, trims
from app.engine.step.rows import Row


def merge(caches: list[list[Any]]) -> list[Any]:
    """Rows' own caches (one list per row, a cache per layer) as one batch cache per layer."""
    if not caches:
        return []
    return [type(layer[0]).merge(list(layer)) for layer in zip(*caches, strict=True)]


class Phase:
    """Rows and their batch caches (see the module docstring)."""

    def __init__(self) -> None:
        self.rows: list[Row] = []
        self.cache: list[Any] = []
        # Whether every layer trims exactly (plain and quantized KV): rollback without replay.
        self._trims: bool | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def index(self, uid: int) -> int | None:
        for i, row in enumerate(self.rows):
            if row.uid == uid:
                return i
        return None

    @property
    def trims(self) -> bool:
        if self._trims is None:
            self._trims = all(trims(c) for c in self.cache)
        return self._trims

    def add(self, rows: list[Row], cache: list[Any] | None = None) -> None:
        """Take ``rows``: with their own caches merged (``cache`` None), or with the batch
        cache that already holds them (rows moving between phases)."""
        if not rows:
            return
        if cache is None:
            own = [r.cache for r in rows]
            assert all(c is not None for c in own)
            cache = merge(own)  # type: ignore[arg-type]
            for r in rows:
                r.cache = None
        if not self.rows:
            self.cache = cache
        else:
            for mine, theirs in zip(self.cache, cache, strict=True):
                mine.extend(theirs)
        self.rows.extend(rows)

    def filter(self, keep: list[int]) -> None:
        """Keep only the rows at ``keep`` (in that order)."""
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self.cache = []
            self._trims = None
            return
        for c in self.cache:
            c.filter(keep)

    def take(self, uids: list[int]) -> tuple[list[Row], list[Any]]:
        """Take the rows ``uids`` out, with a batch cache of their own."""
        wanted = set(uids)
        indices = [i for i, r in enumerate(self.rows) if r.uid in wanted]
        out = [self.rows[i] for i in indices]
        cache = [_copy_rows(c, indices) for c in self.cache] if len(indices) < len(self.rows) else self.cache
        self.filter([i for i in range(len(self.rows)) if i not in set(indices)])
        return out, cache

    def extract(self, i: int) -> list[Any]:
        """Row ``i``'s own caches (copies: the batch goes on)."""
        return [c.extract(i) for c in self.cache]

    def checkpoint(self, i: int) -> list[Any]:
        """Row ``i``'s state in each untrimmable layer (``layers.checkpoint``)."""
        return checkpoint(self.cache, i)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache)


def _copy_rows(cache: Any, indices: list[int]) -> Any:
    """A batch cache of only the rows at ``indices`` (``filter`` works in place)."""
    import copy

    out = copy.copy(cache)
    if hasattr(cache, "caches"):  # CacheList: its parts are copied the same way
        out.caches = tuple(_copy_rows(c, indices) for c in cache.caches)
        return out
    if hasattr(cache, "cache") and isinstance(cache.cache, list):  # ArraysCache: filter rebinds its list
        out.cache = list(cache.cache)
    out.filter(indices)
    return out
