"""A quantized KV cache that the decode step can batch.

mlx-lm ships ``QuantizedKVCache`` for one sequence only: the step (``app.engine.step``)
merges per-sequence caches into a batch cache (``cache.merge``), pads, filters,
extends and extracts it, and QuantizedKVCache has no batched counterpart. This
module adds the two halves:

- ``SeqQuantizedKVCache``: a ``QuantizedKVCache`` that can be merged into a
  batch; it is what the engine inserts, extracts and keeps in its prefix cache;
- ``BatchQuantizedKVCache``: ``BatchKVCache``'s layout (left padding, a shared
  write index ``_idx``, per-sequence ``offset``) over quantized K/V.

K and V are stored as ``mx.quantize`` triples (packed uint32, scales, biases),
quantized per token along head_dim, so a token's codes never depend on its
batch neighbours. Both caches carry ``bits`` and ``group_size``, which is how
``mlx_lm.models.base.scaled_dot_product_attention`` picks the quantized path.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from app.engine.mlx_internals import (
    CacheList,
    QuantizedKVCache,
    _BaseCache,
    create_causal_mask,
    dynamic_roll,
    make_prompt_cache,
)
from app.errors import ConfigError

# (packed codes, scales, biases), each shaped (B, kv_heads, tokens, ...).
Quantized = tuple[Any, ...]


def make_quantized_prompt_cache(model: nn.Module, bits: int, group_size: int = 64, *,
                                plain: bool = False) -> list[Any]:
    """The model's own cache (``make_prompt_cache``) with every plain KV layer quantized; its
    other layers (sliding windows, recurrent state) as they are. ``plain``: the model's
    attention reads plain K/V only (``quantized_attention``), so its quantized layers hand K/V
    back dequantized. Raises ConfigError for a model that keeps no plain KV layer."""
    return quantize_caches(make_prompt_cache(model), bits, group_size, plain=plain)


def quantize_caches(caches: list[Any], bits: int, group_size: int = 64, *, plain: bool = False) -> list[Any]:
    """A model's fresh caches with every plain KV layer quantized (see ``make_quantized_prompt_cache``)."""
    cache = [_quantized(c, bits, group_size, plain) for c in caches]
    if not any(_has_quantized(c) for c in cache):
        kinds = sorted({type(c).__name__ for c in caches})
        raise ConfigError(f"kv_cache_bits quantizes plain KV layers; this model has none (its layers keep "
                          f"{', '.join(kinds)})")
    return cache


def _quantized(cache: Any, bits: int, group_size: int, plain: bool) -> Any:
    if type(cache).__name__ == "KVCache":
        kind = SeqDequantizedKVCache if plain else SeqQuantizedKVCache
        return kind(group_size=group_size, bits=bits)
    if type(cache).__name__ == "CacheList":
        return type(cache)(*(_quantized(c, bits, group_size, plain) for c in cache.caches))
    return cache


def _has_quantized(cache: Any) -> bool:
    if isinstance(cache, CacheList) or type(cache).__name__ == "CacheList":
        return any(_has_quantized(c) for c in cache.caches)
    return isinstance(cache, SeqQuantizedKVCache)


def quantized_attention(run: Callable[[list[Any]], Any], make: Callable[[bool], list[Any]], bits: int,
                        group_size: int) -> bool:
    """How a model's attention takes quantized KV, found by one token through it (``run(cache)``
    with ``make(plain)``'s caches): False when it reads the quantized K/V (mlx-lm's quantized
    attention: the memory and the bandwidth both saved); True when it reads plain K/V only
    (attention sinks, gpt-oss; an attention calling MLX's fused kernel itself, Gemma 4): its
    KV is then kept quantized and handed back dequantized each step (the memory saved, not the
    bandwidth). Raises ConfigError when neither runs (a head_dim the group does not divide)."""
    errors = []
    for plain in (False, True):
        try:
            mx.eval(run([type(c).merge([c]) if hasattr(type(c), "merge") else c for c in make(plain)]))
            return plain
        except Exception as exc:  # noqa: BLE001 - what the model's attention refuses, said as config
            errors.append(exc)
    raise ConfigError(f"kv_cache_bits={bits} needs every attention layer's head_dim divisible by {group_size} "
                      f"(the quantization group): {errors[-1]}") from errors[-1]


class SeqQuantizedKVCache(QuantizedKVCache):
    """mlx-lm's QuantizedKVCache for one sequence, plus what batching asks of it."""

    def size(self) -> int:
        return self.offset

    @classmethod
    def merge(cls, caches: list[SeqQuantizedKVCache]) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else super().nbytes


class SeqDequantizedKVCache(SeqQuantizedKVCache):
    """One sequence's quantized KV for a model whose attention reads plain K/V only
    (``quantized_attention``): batched, it hands K/V back dequantized (``BatchDequantizedKVCache``).
    Never given to a model itself: the decode step batches every row."""

    @classmethod
    def merge(cls, caches: list[SeqQuantizedKVCache]) -> BatchQuantizedKVCache:
        return BatchDequantizedKVCache.merge(caches)


def _as_int(scalar: mx.array) -> int:
    value: Any = scalar.item()
    return int(value)


def _zeros_like(ref: Quantized, batch: int, tokens: int) -> Quantized:
    return tuple(mx.zeros((batch, x.shape[1], tokens, x.shape[3]), dtype=x.dtype) for x in ref)


def _empty_quantized(batch: int, heads: int, tokens: int, dim: int, dtype: mx.Dtype, group_size: int,
                     bits: int) -> Quantized:
    shape = (batch, heads, tokens)
    return (
        mx.zeros((*shape, dim * bits // 32), dtype=mx.uint32),
        mx.zeros((*shape, dim // group_size), dtype=dtype),
        mx.zeros((*shape, dim // group_size), dtype=dtype),
    )


class BatchQuantizedKVCache(_BaseCache):
    """BatchKVCache with K/V quantized: left-padded rows sharing one write index."""

    step = 256
    # What a row extracted from it is.
    seq_class: type[SeqQuantizedKVCache] = SeqQuantizedKVCache

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8) -> None:
        self.keys: Any = None
        self.values: Any = None
        self.group_size = group_size
        self.kv_bits = bits
        self.left_padding = mx.array(left_padding)
        self.offset = mx.array([-p for p in left_padding])
        self._idx = 0
        self._right_padding: mx.array | None = None

    # mlx-lm's attention takes its quantized path for a cache with ``bits``.
    @property
    def bits(self) -> int:
        return self.kv_bits

    def _quantize(self, x: mx.array) -> Quantized:
        return tuple(mx.quantize(x, group_size=self.group_size, bits=self.kv_bits))

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Quantized, Quantized]:
        B, H, N, Dk = keys.shape
        prev = self._idx
        if self.keys is None or prev + N > self.keys[0].shape[2]:
            grow = (self.step + N - 1) // self.step * self.step
            new_k = _empty_quantized(B, H, grow, Dk, keys.dtype, self.group_size, self.kv_bits)
            new_v = _empty_quantized(B, H, grow, values.shape[3], values.dtype, self.group_size, self.kv_bits)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys, self.values = (
                    tuple(mx.concatenate([x[..., :prev, :], n], axis=2) for x, n in zip(old, new))
                    for old, new in ((self.keys, new_k), (self.values, new_v))
                )
        self.offset = self.offset + N
        self._idx += N
        for buf, q in ((self.keys, self._quantize(keys)), (self.values, self._quantize(values))):
            for x, qx in zip(buf, q):
                x[..., prev : self._idx, :] = qx
        return self.keys_and_values()

    def keys_and_values(self) -> tuple[Quantized, Quantized]:
        cut = lambda q: tuple(x[..., : self._idx, :] for x in q)  # noqa: E731
        return cut(self.keys), cut(self.values)

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError("left padding can only be added to an empty BatchQuantizedKVCache")
            left_padding = mx.array(left_padding)
            self.left_padding = self.left_padding + left_padding
            self.offset = self.offset - left_padding
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = mx.array(right_padding)

    def finalize(self) -> None:
        """Roll right-padded rows so the padding sits on the left, as decoding expects."""
        if self._right_padding is None:
            return
        shift = self._right_padding[:, None]
        self.keys = tuple(dynamic_roll(x, shift, axis=2) for x in self.keys)
        self.values = tuple(dynamic_roll(x, shift, axis=2) for x in self.values)
        self.offset = self.offset - self._right_padding
        self.left_padding = self.left_padding + self._right_padding
        self._right_padding = None

    @property
    def state(self) -> Any:
        return self.keys, self.values, self.offset, self.left_padding, self._idx

    @state.setter
    def state(self, v: Any) -> None:
        self.keys, self.values, self.offset, self.left_padding, self._idx = v

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def make_mask(self, N: int, return_array: bool = False, **kwargs) -> mx.array:
        return create_causal_mask(N, offset=self._idx, left_padding=self.left_padding, **kwargs)

    def filter(self, batch_indices: list[int]) -> None:
        """Keep only these rows, then drop the left padding they all share."""
        if self.keys is not None:
            self.keys = tuple(x[batch_indices] for x in self.keys)
            self.values = tuple(x[batch_indices] for x in self.values)
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        shared = _as_int(self.left_padding.min())
        if shared > 0:
            if self.keys is not None:
                self.keys = tuple(x[..., shared:, :] for x in self.keys)
                self.values = tuple(x[..., shared:, :] for x in self.values)
            self._idx -= shared
            self.left_padding = self.left_padding - shared

    def extend(self, other: BatchQuantizedKVCache) -> None:
        """Append ``other``'s rows, right-aligning both at the larger write index."""
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            return
        ref = self if self.keys is not None else other
        max_idx = max(self._idx, other._idx)
        max_size = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        def pad(c: BatchQuantizedKVCache):
            if c.keys is None:
                rows = c.offset.shape[0]
                k, v = _zeros_like(ref.keys, rows, 0), _zeros_like(ref.values, rows, 0)
            else:
                k, v = c.keys, c.values
            left = max_idx - c._idx
            right = max_size - k[0].shape[2] - left
            if right < 0:
                k, v = (tuple(x[..., :right, :] for x in q) for q in (k, v))
                right = 0
            if left or right:
                widths = [(0, 0), (0, 0), (left, right), (0, 0)]
                k, v = (tuple(mx.pad(x, widths) for x in q) for q in (k, v))
            return k, v, c.offset, c.left_padding + left

        (k1, v1, o1, p1), (k2, v2, o2, p2) = pad(self), pad(other)
        self.keys = tuple(mx.concatenate([a, b]) for a, b in zip(k1, k2))
        self.values = tuple(mx.concatenate([a, b]) for a, b in zip(v1, v2))
        self.offset = mx.concatenate([o1, o2])
        self.left_padding = mx.concatenate([p1, p2])
        self._idx = max_idx

    def extract(self, idx: int) -> SeqQuantizedKVCache:
        """Row ``idx`` as a standalone cache, without its padding."""
        cache = self.seq_class(group_size=self.group_size, bits=self.kv_bits)
        start = _as_int(self.left_padding[idx])
        row = lambda q: tuple(mx.contiguous(x[idx : idx + 1, :, start : self._idx]) for x in q)  # noqa: E731
        cache.keys, cache.values = row(self.keys), row(self.values)  # type: ignore[assignment]
        cache.offset = self._idx - start
        return cache

    @classmethod
    def merge(cls, caches: list[SeqQuantizedKVCache]) -> BatchQuantizedKVCache:
        """One batch cache from per-sequence ones, left-padded to the longest."""
        group_size, bits = caches[0].group_size, caches[0].bits
        if any((c.group_size, c.bits) != (group_size, bits) for c in caches):  # per sequence: bits shown
            raise ValueError("cannot batch quantized KV caches with different bits or group sizes")
        lengths = [c.size() for c in caches]
        longest = max(lengths)
        batch = cls([longest - n for n in lengths], group_size, bits)
        if longest == 0:
            return batch
        ref: Any = next(c for c in caches if c.size())
        keys = _zeros_like(ref.keys, len(caches), longest)
        values = _zeros_like(ref.values, len(caches), longest)
        for i, (c, n) in enumerate(zip(caches, lengths)):
            if n:
                for dst, src in zip(keys + values, c.keys + c.values):  # type: ignore[operator]
                    dst[i : i + 1, :, longest - n :] = src[..., :n, :]
        batch.keys, batch.values = keys, values
        batch.offset = batch.offset + longest
        batch._idx = longest
        return batch

    def size(self) -> int:
        return self._idx

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in self.keys + self.values)


class BatchDequantizedKVCache(BatchQuantizedKVCache):
    """A batch of quantized KV that hands K/V back dequantized, for an attention that reads
    plain K/V only (``quantized_attention``): it shows no ``bits``, so mlx-lm's attention
    takes its plain path, and every step dequantizes what the rows hold."""

    seq_class = SeqDequantizedKVCache

    @property
    def bits(self) -> int:
        raise AttributeError("bits")  # hidden: the attention reads the plain K/V this returns

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Any:
        qk, qv = super().update_and_fetch(keys, values)
        g, b = self.group_size, self.kv_bits
        return (mx.dequantize(qk[0], qk[1], qk[2], group_size=g, bits=b),
                mx.dequantize(qv[0], qv[1], qv[2], group_size=g, bits=b))
