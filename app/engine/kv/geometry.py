"""What a model's caches cost, layer by layer, read off the model itself.

A model's KV is not one figure per token. Each layer keeps what its kind keeps
(``app.engine.kv.layers``): a full-attention layer K and V for every token, quantized
or not; a sliding-window layer only its window; a recurrent layer (Mamba, gated
delta-net, short convolutions) a fixed state per sequence, however long. So one row
of a batch, ``width`` tokens wide, costs

    sum over layers of  bytes/token x width               (kv, quantized)
                        bytes/token x min(width, window)   (rotating)
                        bytes/row                          (state)

(A window holds the tokens of the chunk passing through it on top of its window while a
prompt is prefilled, and a verify step's proposals while they are scored: at most a
chunk, for a moment, on the rows in that step.)

The figures come from the model's own cache (``make_cache()``) after a two-token
forward pass that is built but never evaluated: MLX infers every shape and dtype as it
builds the graph. Nothing is read from the config, so any config form the library
loads (Nemotron-H's ``layers_block_type`` list, nested text configs) is sized alike.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from app.engine.kv.layers import kind
from app.errors import ConfigError


@dataclass(frozen=True)
class LayerGeometry:
    """One layer's cost."""

    kind: str
    # Bytes one token adds (K and V; codes, scales and biases when quantized). 0 for a state.
    bytes_per_token: float = 0.0
    # A sliding window's size in tokens (rotating layers).
    window: int | None = None
    # Bytes a sequence holds whatever its length (a recurrent state).
    bytes_per_row: int = 0


@dataclass(frozen=True)
class KVGeometry:
    """A model's cache cost per layer (see the module docstring)."""

    layers: tuple[LayerGeometry, ...]

    @property
    def bytes_per_token(self) -> int:
        """What one more token costs a long sequence: its full-attention layers' K and V (a
        window's tokens and a state cost nothing more once full)."""
        return int(sum(g.bytes_per_token for g in self.layers if g.window is None))

    @property
    def bytes_per_row(self) -> int:
        """What a sequence costs whatever its length: its recurrent states."""
        return sum(g.bytes_per_row for g in self.layers)

    def row_bytes(self, width: int) -> int:
        """Bytes one row of a batch ``width`` tokens wide may hold."""
        total = 0.0
        for g in self.layers:
            if g.window is not None:
                total += g.bytes_per_token * min(width, g.window)
            else:
                total += g.bytes_per_token * width
            total += g.bytes_per_row
        return int(total)

    def tokens_for(self, nbytes: int) -> int:
        """The widest row that fits in ``nbytes`` (as many as any row may take when only states
        and windows grow no further: capped at 2**31)."""
        if self.row_bytes(1) > nbytes:
            return 0
        if self.bytes_per_token == 0 and self.row_bytes(1 << 31) <= nbytes:
            return 1 << 31
        return widest(self.row_bytes, nbytes)

    def budget_tokens(self, mem_mb: int) -> int:
        """Tokens one sequence alone could hold in ``mem_mb`` (what /v1/models reports)."""
        return self.tokens_for(mem_mb * 2**20)

    def summary(self) -> dict[str, Any]:
        """Per kind: how many layers, and what they cost (for /health and the load log)."""
        out: dict[str, Any] = {}
        for g in self.layers:
            entry = out.setdefault(g.kind, {"layers": 0, "bytes_per_token": 0.0, "bytes_per_row": 0})
            entry["layers"] += 1
            entry["bytes_per_token"] += g.bytes_per_token
            entry["bytes_per_row"] += g.bytes_per_row
            if g.window is not None:
                entry["window"] = max(entry.get("window", 0), g.window)
        for entry in out.values():
            entry["bytes_per_token"] = int(entry["bytes_per_token"])
        return out

    def scaled(self, factor: float) -> KVGeometry:
        """This geometry with every cost times ``factor`` (a shard's part of the KV)."""
        return KVGeometry(tuple(LayerGeometry(g.kind, g.bytes_per_token * factor, g.window,
                                              int(g.bytes_per_row * factor)) for g in self.layers))


def probe_geometry(make_cache: Callable[[], list[Any]], forward: Callable[[mx.array, list[Any]], Any]) -> KVGeometry:
    """The geometry of the caches ``make_cache`` builds, as ``forward`` (the model's call on
    token ids with a cache) fills them: from shapes, nothing evaluated. MLX thread."""
    cache = make_cache()
    if not cache:
        raise ConfigError("cannot size the KV cache: the model keeps no cache")
    forward(mx.array([[0, 0]], dtype=mx.uint32), cache)
    layers: list[LayerGeometry] = []
    for c in cache:
        layers.extend(_layer(c))
    return KVGeometry(tuple(layers))


def _layer(cache: Any) -> list[LayerGeometry]:
    k = kind(cache)
    if k == "list":
        return [g for c in cache.caches for g in _layer(c)]
    if k == "state":
        arrays = [a for a in getattr(cache, "cache", ()) if isinstance(a, mx.array)]
        return [LayerGeometry("state", bytes_per_row=sum(a.nbytes for a in arrays))]
    per_token = _per_token(cache.keys) + _per_token(cache.values)
    if k == "rotating":
        return [LayerGeometry("rotating", per_token, window=int(cache.max_size))]
    return [LayerGeometry(k, per_token)]


def _per_token(x: Any) -> float:
    """Bytes per token of a K or V buffer (B=1, heads, tokens, dim), or of a quantized triple."""
    if isinstance(x, (tuple, list)):
        return sum(_per_token(part) for part in x)
    return x.nbytes / max(1, x.shape[2])


def widest(cost: Callable[[int], int], nbytes: int) -> int:
    """The largest width (at most 2**31) whose ``cost`` (bytes, growing with the width) fits
    ``nbytes``; 0 when not even one token's does."""
    if cost(1) > nbytes:
        return 0
    lo, hi = 1, 1 << 31
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if cost(mid) <= nbytes:
            lo = mid
        else:
            hi = mid - 1
    return lo

