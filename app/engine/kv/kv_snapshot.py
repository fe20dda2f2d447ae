"""Caches as the disk tier's tensors, and back; and the identity of what they fit.

``export_cache`` turns one sequence's cache (``layers.SeqCache``: a cache per layer at
``n`` tokens, and its checkpoints) into the tensors ``kv_layout`` names: each layer's K/V
(a plain or quantized layer its ``n`` tokens, a sliding window its last ``min(n, window)``
tokens in temporal order), a recurrent state's arrays as they are, and each checkpoint's
states of the layers that do not trim. It evaluates the arrays and hands out their
buffers without copying: the arrays must stay alive, and unchanged, while the buffers
are read (``disk_cache`` keeps them). ``restore_cache`` copies a file's bytes into a
fresh cache of the model's own classes (``KVLayout.make_cache``) at the file's end or at
one of its checkpoints. Both run on the MLX thread.

A window comes back as a ``RotatingKVCache`` of those tokens with the sequence's offset:
what mlx-lm's batch cache takes of a window when rows are merged (their last
``min(offset, window)`` tokens, in order), so decoding continues exactly. Windows kept
by a sequence's cache are in temporal order (``BatchRotatingKVCache.extract`` puts them
so); a restored one-token window is read from its start.

``disk_cache`` reads only files whose tensors are exactly the layout's, with finite
values (``check_finite``, off the MLX thread), and writes only caches that fit it; so a
forged or foreign file is refused before MLX sees it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from app.engine.kv.kv_files import FORMAT, DamagedFileError, Tensor
from app.engine.kv.kv_layout import DTYPE_NAMES, DTYPES, KVLayout, LayerSpec, LayoutError
from app.engine.kv.layers import SeqCache, kind

# The exponent bits of each float format: all set is an infinity or a NaN.
_EXPONENT = {"F16": (np.uint16, 0x7C00), "BF16": (np.uint16, 0x7F80), "F32": (np.uint32, 0x7F800000)}


def check_finite(tensors: dict[str, Tensor]) -> None:
    """Raise DamagedFileError when a float tensor holds a NaN or an infinity (KV never does:
    it would turn every later token into one). numpy on the raw bits, in slices; any thread."""
    for t in tensors.values():
        if t.dtype not in _EXPONENT:
            continue
        uint, mask = _EXPONENT[t.dtype]
        bits = np.frombuffer(t.data, dtype=uint)
        for start in range(0, bits.size, 1 << 22):
            part = bits[start:start + (1 << 22)]
            if np.any((part & uint(mask)) == mask):
                raise DamagedFileError(f"tensor {t.name} holds a NaN or an infinity")


def kv_identity(model: Any, source: str, settings: dict[str, Any]) -> str:
    """A digest of what a model's KV depends on (MLX thread: it samples the weights).

    ``settings``: dtypes, kv_cache_bits, quantization; ``source``: where the weights are.
    """
    parts: dict[str, Any] = {"format": FORMAT, "mlx": version("mlx"), "mlx_lm": version("mlx-lm"),
                             "settings": settings, "source": source}
    path = Path(source).expanduser()
    if path.is_dir():
        parts["source"] = str(path.resolve())
        parts["files"] = sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in path.iterdir()
                                if f.is_file() and f.suffix in (".safetensors", ".json", ".gguf"))
    digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode())
    # Sixteen values spread over every tensor: weights replaced in place, or a hub model, still differ.
    flat: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    samples = [p.reshape(-1)[:: max(1, p.size // 16)][:16].view(mx.uint8) for _, p in flat]
    mx.eval(samples)
    for (name, _), sample in zip(flat, samples):
        digest.update(name.encode())
        digest.update(_buffer(sample))
    return digest.hexdigest()[:20]


@dataclass
class Exported:
    """One sequence's cache as a file's tensors."""

    meta: dict[str, str]
    tensors: list[Tensor]
    # The evaluated arrays behind the tensors' buffers: alive until the file is written.
    arrays: list[Any]
    # Its checkpoints' positions, in order (the file's restore points before its end).
    points: list[int]


def export_cache(layout: KVLayout, cache: list[Any], n: int) -> Exported:
    """``cache`` (one sequence's, at ``n`` tokens; a ``SeqCache`` brings its checkpoints) as
    the tensors of ``layout`` (see the module docstring), without a copy where an array is
    already exactly a tensor. Raises LayoutError when a layer is not the layout's."""
    if len(cache) != len(layout.layers):
        raise LayoutError(f"{len(cache)} layers, the model has {len(layout.layers)}")
    points: list[tuple[int, list[Any]]] = []
    for p, states in sorted(getattr(cache, "checkpoints", ()), key=lambda c: c[0]):
        if 0 < p < n and (not points or points[-1][0] != p):
            points.append((p, states))
    named: list[tuple[str, mx.array]] = []
    for i, (spec, layer) in enumerate(zip(layout.layers, cache)):
        named += _arrays(spec, layer, str(i), n)
    for k, (p, states) in enumerate(points):
        for i in layout.untrimmable():
            if states[i] is None:
                raise LayoutError(f"checkpoint at {p} has no state for layer {i}")
            named += _arrays(layout.layers[i], states[i], f"c{k}.{i}", p)
    arrays = [mx.contiguous(x) for _, x in named]
    raw = [x.view(mx.uint8) for x in arrays]
    mx.eval(raw)
    tensors = [Tensor(name, DTYPE_NAMES[x.dtype], tuple(x.shape), _buffer(r))
               for (name, _), x, r in zip(named, arrays, raw)]
    return Exported(dict(layout.meta), tensors, raw, [p for p, _ in points])


def _arrays(spec: LayerSpec, layer: Any, path: str, t: int) -> list[tuple[str, mx.array]]:
    """A layer's arrays at ``t`` tokens, named as ``spec.tensors(path, t)`` names them."""
    if kind(layer) != spec.kind:
        raise LayoutError(f"layer {path} is {type(layer).__name__}, the model's is {spec.cls}")
    if spec.kind == "list":
        if len(layer.caches) != len(spec.parts):
            raise LayoutError(f"layer {path} has {len(layer.caches)} parts, the model's {len(spec.parts)}")
        return [a for j, (part, c) in enumerate(zip(spec.parts, layer.caches))
                for a in _arrays(part, c, f"{path}.{j}", t)]
    if spec.kind == "state":
        held = {f"state.{j}": a for j, a in enumerate(layer.cache) if a is not None}
        if held.keys() != {suffix for suffix, _, _ in spec.fixed}:
            raise LayoutError(f"layer {path} holds state arrays {sorted(held)}, the model's {len(spec.fixed)}")
        return [(f"{path}.{suffix}", held[suffix]) for suffix, _, _ in spec.fixed]
    if not spec.seq:
        if layer.keys is not None:
            raise LayoutError(f"layer {path} holds KV where the model keeps none")
        return []
    if layer.keys is None or layer.offset != t:
        raise LayoutError(f"layer {path} holds {layer.offset} tokens, not {t}")
    m = spec.tokens(t)
    if spec.window is not None and t >= spec.window:
        cut = lambda x: x[..., x.shape[2] - m:, :]  # noqa: E731 - a full window: its last tokens
    else:
        cut = lambda x: x[..., :m, :]  # noqa: E731
    parts = [("keys", layer.keys), ("values", layer.values)]
    if spec.kind == "quantized":
        parts = [(f"{kv}.{j}", x) for kv, q in parts for j, x in enumerate(q)]
    if any(x.shape[2] < m for _, x in parts):
        raise LayoutError(f"layer {path} holds fewer than {m} tokens")
    return [(f"{path}.{suffix}", x if x.shape[2] == m else cut(x)) for suffix, x in parts]


def restore_cache(layout: KVLayout, tensors: dict[str, Tensor], n: int, points: list[int], at: int) -> SeqCache:
    """The cache a file's tensors (checked against ``layout.tensors(n, points)``) hold at ``at``
    tokens: its end (``n``) or one of its checkpoints, a fresh cache of the model's classes,
    with the checkpoints before ``at``. Raises DamagedFileError (or KeyError / ValueError) when
    they do not make one. MLX thread."""
    if at != n and at not in points:
        raise DamagedFileError(f"no restore point at {at}")
    made: list[mx.array] = []

    def fresh(prefixes: dict[int, str], t: int) -> list[Any]:
        cache = layout.make_cache()
        if len(cache) != len(layout.layers):
            raise DamagedFileError(f"the model makes {len(cache)} layers, the layout has {len(layout.layers)}")
        for i, path in prefixes.items():
            _fill(layout.layers[i], cache[i], tensors, path, t, made)
        return cache

    k_at = points.index(at) if at != n else None
    layers = fresh({i: (str(i) if k_at is None or s.trims else f"c{k_at}.{i}") for i, s in enumerate(layout.layers)},
                   at)
    checkpoints = []
    for k, p in enumerate(points):
        if p < at:
            states = fresh({i: f"c{k}.{i}" for i in layout.untrimmable()}, p)
            checkpoints.append((p, [states[i] if i in layout.untrimmable() else None for i in range(len(states))]))
    mx.eval(made)
    return SeqCache(layers, checkpoints)


def _fill(spec: LayerSpec, layer: Any, tensors: dict[str, Tensor], path: str, t: int, made: list[mx.array]) -> None:
    """Put the file's arrays for ``spec`` at ``t`` tokens (under ``path``) into a fresh ``layer``."""
    if kind(layer) != spec.kind:
        raise DamagedFileError(f"layer {path}: the model makes {type(layer).__name__}, the file holds {spec.cls}")
    if spec.kind == "list":
        for j, (part, c) in enumerate(zip(spec.parts, layer.caches, strict=True)):
            _fill(part, c, tensors, f"{path}.{j}", t, made)
        return
    if spec.kind == "state":
        for suffix, _, _ in spec.fixed:
            layer.cache[int(suffix.split(".")[1])] = _to_array(tensors[f"{path}.{suffix}"])
            made.append(layer.cache[int(suffix.split(".")[1])])
        return
    if not spec.seq:
        return
    m = spec.tokens(t)
    arrays = {suffix: _to_array(tensors[f"{path}.{suffix}"], m) for suffix, _, _, _ in spec.seq}
    made.extend(arrays.values())
    if spec.kind == "quantized":
        layer.keys = tuple(arrays[f"keys.{j}"] for j in range(3))
        layer.values = tuple(arrays[f"values.{j}"] for j in range(3))
    elif spec.kind == "rotating":
        # Through its public update: the window holds these tokens in order, as a merge takes them.
        layer.update_and_fetch(arrays["keys"], arrays["values"])
    else:
        layer.keys, layer.values = arrays["keys"], arrays["values"]
    layer.offset = t


def _buffer(x: Any) -> memoryview:
    """An evaluated array's bytes: its own memory (the array must outlive the view), or a
    host copy where the backend does not export its buffers."""
    try:
        return memoryview(x).cast("B")
    except (TypeError, ValueError, BufferError):
        host: Any = np.ascontiguousarray(np.array(x, copy=True))
        return memoryview(host).cast("B")


def _to_array(t: Tensor, tokens: int | None = None) -> mx.array:
    """An MLX array from a file's bytes (the copy MLX makes is the only one); with ``tokens``,
    a [1, heads, tokens, width] tensor's first ``tokens`` (a shorter restore point)."""
    raw = np.frombuffer(t.data, dtype=np.uint8).reshape(*t.shape[:-1], -1) if t.shape else \
        np.frombuffer(t.data, dtype=np.uint8)
    if tokens is not None:
        if len(t.shape) != 4 or t.shape[0] != 1 or t.shape[2] < tokens:
            raise DamagedFileError(f"tensor {t.name} has shape {t.shape} for {tokens} tokens")
        raw = np.ascontiguousarray(raw[:, :, :tokens])
    return mx.array(raw).view(DTYPES[t.dtype])
