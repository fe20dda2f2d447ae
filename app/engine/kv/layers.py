"""Each layer's cache is one kind: what a feature needs of a cache is asked of its layer.

A model's cache is the list its own ``make_cache()`` builds (``make_prompt_cache``), one
mlx-lm cache per layer that keeps one. Their kinds, one sequence and batched:

    kind       one sequence          in a batch              trim            per row
    kv         KVCache               BatchKVCache            exact           tokens x bytes/token
    quantized  SeqQuantizedKVCache   BatchQuantizedKVCache   exact           tokens x bytes/token (codes)
    rotating   RotatingKVCache       BatchRotatingKVCache    never (window)  min(tokens, window) x bytes/token
    state      ArraysCache           ArraysCache             never           constant (conv and SSM state)
    list       CacheList             CacheList               if all parts    its parts'

What the features ask, and of whom:

- trim (``trims``): the verify step drops a row's rejected tokens; the prefix cache uses a
  shorter prefix of a stored sequence. Only ``kv`` and ``quantized`` layers trim exactly: a
  sliding window has let older tokens go, a recurrent state cannot be run backwards.
- snapshot / restore (``LayerState``): where a layer cannot trim, its state at a position
  is kept instead, and restored. The verify step snapshots a batch's untrimmable layers
  before its forward pass and restores them before replaying what was kept; the prefix
  cache keeps ``checkpoints`` (each untrimmable layer's state for one sequence) where a
  prompt ends, so the next turn starts there (llama.cpp's server calls these context
  checkpoints).
- bytes (``app.engine.kv.geometry``): admission counts each kind as it grows.

The kind comes from the layer's class, never from the model's name or config. A class
this module does not know is served as ``state`` would be (snapshots, no trim), which is
exact for any cache whose update replaces its arrays.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx

KINDS = ("kv", "quantized", "rotating", "state", "list")

# By class name: mlx-lm and mlx-vlm each ship these classes (mlx-vlm's language models keep
# mlx-vlm's own), and kv_quant adds the batched quantized one.
_KIND_OF: dict[str, str] = {
    "KVCache": "kv",
    "BatchKVCache": "kv",
    "QuantizedKVCache": "quantized",
    "BatchQuantizedKVCache": "quantized",
    "RotatingKVCache": "rotating",
    "BatchRotatingKVCache": "rotating",
    "ArraysCache": "state",
    "CacheList": "list",
}


def kind(cache: Any) -> str:
    """The layer's kind (``KINDS``), from its class (or the first base class of a known
    name); a class not known here is ``state``."""
    for cls in type(cache).__mro__:
        found = _KIND_OF.get(cls.__name__)
        if found is not None:
            return found
    return "state"


def trims(cache: Any) -> bool:
    """Whether this layer drops its last tokens exactly (``trim``), whatever its position."""
    k = kind(cache)
    if k == "list":
        return all(trims(c) for c in cache.caches)
    return k in ("kv", "quantized")


def all_trim(caches: list[Any]) -> bool:
    """Whether every layer of a model's cache trims exactly."""
    return all(trims(c) for c in caches)


def kinds(caches: list[Any]) -> list[str]:
    """Each layer's kind, in order."""
    return [kind(c) for c in caches]


# ---- snapshots of a batch's layers (the verify step) ------------------------------------

# The fields that make a batch layer's state, per kind; each snapshot holds new array objects,
# so an update that writes into an array in place never reaches a snapshot.
_BATCH_FIELDS: dict[str, tuple[str, ...]] = {
    "rotating": ("keys", "values", "offset", "left_padding", "max_size", "_offset", "_idx", "rotated", "_lengths"),
    "state": ("cache", "left_padding", "lengths"),
    "kv": ("keys", "values", "offset", "left_padding", "_idx", "_right_padding"),
    "quantized": ("keys", "values", "offset", "left_padding", "_idx", "_right_padding"),
}


def _detach(value: Any) -> Any:
    if isinstance(value, mx.array):
        return mx.array(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_detach(v) for v in value)
    return value


def snapshot(cache: Any) -> Any:
    """A batch layer's whole state now, to ``restore`` it later (cheap: arrays are not copied
    until an in-place write would change them)."""
    k = kind(cache)
    if k == "list":
        return [snapshot(c) for c in cache.caches]
    fields = _BATCH_FIELDS.get(k)
    if fields is None:
        return copy.copy(cache.__dict__)
    return {f: _detach(getattr(cache, f)) for f in fields if hasattr(cache, f)}


def restore(cache: Any, snap: Any) -> None:
    """Put back a layer's state taken by ``snapshot``."""
    if kind(cache) == "list":
        for c, s in zip(cache.caches, snap):
            restore(c, s)
        return
    for f, v in snap.items():
        setattr(cache, f, _detach(v))


# ---- one sequence's cache, and its checkpoints (the prefix cache) -------------------------


class SeqCache(list[Any]):
    """One sequence's cache: a cache per layer for its tokens (the list), and its
    ``checkpoints``: (position, each untrimmable layer's state there, None for the layers
    that trim) for positions before its end where it can be restored exactly."""

    def __init__(self, layers: Any = (), checkpoints: list[tuple[int, list[Any]]] | None = None) -> None:
        super().__init__(layers)
        inherited: list[tuple[int, list[Any]]] = getattr(layers, "checkpoints", [])
        self.checkpoints: list[tuple[int, list[Any]]] = list(checkpoints if checkpoints is not None else inherited)

    @property
    def nbytes(self) -> int:
        """Bytes its layers and its checkpoints hold."""
        return nbytes(self) + sum(nbytes(states) for _, states in self.checkpoints)


def checkpoint(batch_caches: list[Any], i: int) -> list[Any]:
    """Row ``i``'s state in each untrimmable layer of a batch (None for the layers that trim):
    what restoring the row at its current position needs beyond its trimmed KV."""
    return [None if trims(c) else c.extract(i) for c in batch_caches]


def trim_to(cache: Any, n: int) -> None:
    """Cut a trimmable one-sequence layer back to its first ``n`` tokens."""
    if kind(cache) == "list":
        for c in cache.caches:
            trim_to(c, n)
    else:
        cache.trim(max(0, cache.offset - n))


def at_checkpoint(caches: list[Any], n: int, states: list[Any]) -> list[Any]:
    """One sequence's cache at position ``n``: its trimmable layers copied and trimmed to
    ``n`` tokens, every other layer the checkpoint's state there (copied: the caller owns
    the result and may write into it)."""
    out = []
    for c, s in zip(caches, states, strict=True):
        if s is None:
            c = copy.deepcopy(c)
            trim_to(c, n)
            out.append(c)
        else:
            out.append(copy.deepcopy(s))
    return out


def batched(caches: list[Any]) -> list[Any]:
    """One sequence's caches as one-row batch caches (each layer's class ``merge``), as the
    decode step gives them to the model; a class that does not batch as it is."""
    return [type(c).merge([c]) if hasattr(type(c), "merge") else c for c in caches]


def nbytes(caches: list[Any] | None) -> int:
    """Bytes a list of layer states holds (None entries: nothing)."""
    return sum(c.nbytes for c in caches or () if c is not None)
