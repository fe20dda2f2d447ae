"""KV caches as the disk tier's tensors, and back; and the identity of what they fit.

Only plain ``KVCache`` layers and ``kv_quant``'s ``SeqQuantizedKVCache`` are
saved (other cache kinds, sliding windows or recurrent state, are not). Export
evaluates the arrays and hands out their buffers without copying: the arrays
must stay alive, and unchanged, while the buffers are read (``disk_cache`` keeps
them). Restore copies the file's bytes into MLX arrays. Both run on the MLX thread.

What a file may hold is the model's ``KVLayout`` (layers, KV heads, head_dim, dtype,
KV bits; ``probe_layout`` reads it off the model): ``disk_cache`` reads only files whose tensors are exactly those, with
finite values (``check_finite``, off the MLX thread), and writes only caches that
fit it; so a forged or foreign file is refused before MLX sees it.

    tensors: "tokens" (I32 [n]); per layer i, "{i}.keys" / "{i}.values" ([1, kv_heads, n, head_dim]),
             or for quantized KV "{i}.keys.{0,1,2}" / "{i}.values.{0,1,2}" (packed codes, scales, biases)
    metadata: "cache" (the class), "layers", and for quantized KV "bits", "group_size"
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
from app.engine.kv.kv_quant import SeqQuantizedKVCache
from app.engine.mlx_internals import KVCache, make_prompt_cache

DTYPE_NAMES = {mx.bfloat16: "BF16", mx.float16: "F16", mx.float32: "F32", mx.uint32: "U32", mx.int32: "I32",
               mx.uint8: "U8"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


@dataclass(frozen=True)
class KVLayout:
    """The tensors a model's saved KV is made of: what every file is checked against."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str  # the KV's (activations') dtype, in safetensors' names: "BF16", "F16", "F32"
    bits: int | None = None  # quantized KV (kv_cache_bits): packed codes, scales, biases
    group_size: int = 64
    # The values' heads and width where they differ from the keys' (MLA: DeepSeek-V2).
    value_heads: int | None = None
    value_dim: int | None = None

    @property
    def meta(self) -> dict[str, str]:
        """The metadata ``export_cache`` writes for such a cache."""
        if self.bits is None:
            return {"cache": "KVCache", "layers": str(self.layers)}
        return {"cache": "SeqQuantizedKVCache", "bits": str(self.bits), "group_size": str(self.group_size),
                "layers": str(self.layers)}

    def tensors(self, n: int) -> dict[str, tuple[str, tuple[int, ...]]]:
        """name -> (dtype, shape) of every tensor in a file of ``n`` tokens, the tokens included."""
        out: dict[str, tuple[str, tuple[int, ...]]] = {"tokens": ("I32", (n,))}
        widths = {"keys": (self.kv_heads, self.head_dim),
                  "values": (self.value_heads or self.kv_heads, self.value_dim or self.head_dim)}
        for i in range(self.layers):
            for kv, (heads, dim) in widths.items():
                if self.bits is None:
                    out[f"{i}.{kv}"] = (self.dtype, (1, heads, n, dim))
                else:
                    out[f"{i}.{kv}.0"] = ("U32", (1, heads, n, dim * self.bits // 32))
                    for j in (1, 2):
                        out[f"{i}.{kv}.{j}"] = (self.dtype, (1, heads, n, dim // self.group_size))
        return out


def probe_layout(model: Any, bits: int | None, group_size: int) -> KVLayout | None:
    """The layout of ``model``'s KV, from the cache of a one-token forward pass that is built
    but never evaluated (MLX infers shapes and dtypes as it builds the graph): exact where the
    config's figures are not (the activations' dtype, MLA's widths). None when its caches are
    not plain ``KVCache`` layers of one shape (those are never written to disk). MLX thread."""
    cache = make_prompt_cache(model)
    if not cache or {type(c) for c in cache} != {KVCache}:
        return None
    model(mx.array([[0]]), cache=cache)
    shapes = {(c.keys.shape[1], c.keys.shape[3], c.values.shape[1], c.values.shape[3], c.keys.dtype, c.values.dtype)
              for c in cache}
    if len(shapes) != 1:
        return None
    ((kh, kd, vh, vd, dtype, vdtype),) = shapes
    if dtype != vdtype or dtype not in DTYPE_NAMES:
        return None
    if bits is not None and any(d * bits % 32 or d % group_size for d in (kd, vd)):
        return None
    return KVLayout(len(cache), kh, kd, DTYPE_NAMES[dtype], bits, group_size,
                    vh if vh != kh else None, vd if vd != kd else None)


# The exponent bits of each float format: all set is an infinity or a NaN.
_EXPONENT = {"F16": (np.uint16, 0x7C00), "BF16": (np.uint16, 0x7F80), "F32": (np.uint32, 0x7F800000)}


def check_finite(tensors: dict[str, Tensor]) -> None:
    """Raise DamagedFileError when a float tensor holds a NaN or an infinity (KV never does:
    it would turn every later token into one). numpy on the raw bits, in slices; any thread."""
    for t in tensors.values():
        if t.dtype not in _EXPONENT:
            continue
        kind, mask = _EXPONENT[t.dtype]
        bits = np.frombuffer(t.data, dtype=kind)
        for start in range(0, bits.size, 1 << 22):
            part = bits[start:start + (1 << 22)]
            if np.any((part & kind(mask)) == mask):
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


def export_cache(cache: list[Any], n: int) -> tuple[dict[str, str], list[Tensor], list[Any]] | None:
    """Each layer's K/V for the first ``n`` tokens as tensors (the metadata, the tensors, the
    arrays behind them), without a copy when the arrays are already exactly that (an
    extracted cache); None for caches of other kinds."""
    kinds = {type(c) for c in cache}
    pairs = [(i, kv, getattr(c, kv)) for i, c in enumerate(cache) for kv in ("keys", "values")]
    if kinds == {KVCache}:
        meta = {"cache": "KVCache"}
        named = [(f"{i}.{kv}", x) for i, kv, x in pairs]
    elif kinds == {SeqQuantizedKVCache}:
        meta = {"cache": "SeqQuantizedKVCache", "bits": str(cache[0].bits), "group_size": str(cache[0].group_size)}
        named = [(f"{i}.{kv}.{j}", x) for i, kv, q in pairs for j, x in enumerate(q)]
    else:
        return None
    if any(x.ndim != 4 or x.shape[2] < n for _, x in named):
        return None
    meta["layers"] = str(len(cache))
    arrays = [mx.contiguous(x[..., :n, :] if x.shape[2] != n else x) for _, x in named]
    raw = [x.view(mx.uint8) for x in arrays]
    mx.eval(raw)
    tensors = [Tensor(name, DTYPE_NAMES[x.dtype], tuple(x.shape), _buffer(r))
               for (name, _), x, r in zip(named, arrays, raw)]
    return meta, tensors, raw


def restore_cache(layout: KVLayout, tensors: dict[str, Tensor], n: int) -> list[Any]:
    """The KV cache of ``layout`` that a file's tensors (checked against ``layout.tensors(n)``)
    hold for ``n`` tokens; raises DamagedFileError (or KeyError / ValueError) when they do not make one."""
    cache: list[Any] = []
    for i in range(layout.layers):
        if layout.bits is not None:
            c: Any = SeqQuantizedKVCache(group_size=layout.group_size, bits=layout.bits)
            c.keys = tuple(_to_array(tensors[f"{i}.keys.{j}"], n) for j in range(3))
            c.values = tuple(_to_array(tensors[f"{i}.values.{j}"], n) for j in range(3))
        else:
            c = KVCache()
            c.keys, c.values = _to_array(tensors[f"{i}.keys"], n), _to_array(tensors[f"{i}.values"], n)
        c.offset = n
        cache.append(c)
    mx.eval([c.state for c in cache])
    return cache


def _buffer(x: Any) -> memoryview:
    """An evaluated array's bytes: its own memory (the array must outlive the view), or a
    host copy where the backend does not export its buffers."""
    try:
        return memoryview(x).cast("B")
    except (TypeError, ValueError, BufferError):
        host: Any = np.ascontiguousarray(np.array(x, copy=True))
        return memoryview(host).cast("B")


def _to_array(t: Tensor, n: int) -> mx.array:
    """An MLX array from a file's bytes (the copy MLX makes is the only one)."""
    if len(t.shape) != 4 or t.shape[0] != 1 or t.shape[2] != n:
        raise DamagedFileError(f"tensor {t.name} has shape {t.shape} for {n} tokens")
    raw = np.frombuffer(t.data, dtype=np.uint8).reshape(*t.shape[:-1], -1)
    return mx.array(raw).view(DTYPES[t.dtype])
