"""What a model's saved caches are made of: the layout every disk-tier file is checked against.

A model's cache is one cache per layer, each of a kind (``app.engine.kv.layers``). The
layout says, per layer, which tensors a sequence of ``t`` tokens keeps there, read off the
model's own cache after a one-token forward pass that is built but never evaluated (MLX
infers shapes and dtypes as it builds the graph), never from its config:

    kind       tensors of a layer at path P (P: "3", or "3.1" for part 1 of a list)    tokens
    kv         P.keys, P.values                   [1, heads, tokens, width]             t
    quantized  P.keys.0..2, P.values.0..2         codes (U32), scales, biases           t
    rotating   P.keys, P.values                   the window's last tokens, in order    min(t, window)
    state      P.state.J                          each array of the state, fixed shape  none
    list       its parts' tensors, at P.0, P.1, ...

A file of ``n`` tokens holds ``tokens`` (I32 [n]), every layer at ``n`` tokens, and for each
of its checkpoints ``k`` (a position ``p < n`` where the sequence can be restored exactly),
``c{k}.`` followed by the tensors of every layer that does not trim, at ``p`` tokens (a
trimmable layer's first ``p`` tokens are in its full tensors already: where every layer
trims, a checkpoint is a position and no tensors). So the tensors a
file holds follow from the layout, its token count and its checkpoints' positions
(``KVLayout.tensors``), and a file that holds anything else is refused before MLX sees it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import mlx.core as mx

from app.engine.kv.kv_quant import quantize_caches
from app.engine.kv.layers import kind
from app.engine.mlx_internals import make_prompt_cache

DTYPE_NAMES = {mx.bfloat16: "BF16", mx.float16: "F16", mx.float32: "F32", mx.uint32: "U32", mx.int32: "I32",
               mx.uint8: "U8"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
# One tensor's shape and dtype, by name.
Shapes = dict[str, tuple[str, tuple[int, ...]]]


class LayoutError(ValueError):
    """A model whose caches the disk tier cannot store; the message says which and why."""


@dataclass(frozen=True)
class LayerSpec:
    """One layer's saved tensors (see the module docstring)."""

    kind: str
    cls: str  # the cache's class name
    # Tensors with a token axis: (suffix, heads, width, dtype), each [1, heads, tokens, width].
    seq: tuple[tuple[str, int, int, str], ...] = ()
    # A state's arrays: (suffix, shape, dtype); a slot the model leaves empty has none.
    fixed: tuple[tuple[str, tuple[int, ...], str], ...] = ()
    window: int | None = None  # rotating: the window's size (max_size)
    parts: tuple[LayerSpec, ...] = ()  # list

    @property
    def trims(self) -> bool:
        """Whether the layer drops its last tokens exactly (``layers.trims``)."""
        if self.kind == "list":
            return all(p.trims for p in self.parts)
        return self.kind in ("kv", "quantized")

    def tokens(self, t: int) -> int:
        """Tokens this layer keeps of a sequence of ``t``."""
        return min(t, self.window) if self.window is not None else t

    def tensors(self, path: str, t: int) -> Shapes:
        """name -> (dtype, shape) of this layer's tensors at ``t`` tokens, under ``path``."""
        out: Shapes = {}
        for suffix, heads, width, dtype in self.seq:
            out[f"{path}.{suffix}"] = (dtype, (1, heads, self.tokens(t), width))
        for suffix, shape, dtype in self.fixed:
            out[f"{path}.{suffix}"] = (dtype, shape)
        for i, part in enumerate(self.parts):
            out.update(part.tensors(f"{path}.{i}", t))
        return out


@dataclass(frozen=True)
class KVLayout:
    """A model's saved caches, layer by layer, and how to make them afresh."""

    layers: tuple[LayerSpec, ...]
    # A fresh cache of the model, the classes it restores into (the engine's own: quantized
    # where kv_cache_bits says, mlx-vlm's where the model is mlx-vlm's). Not part of equality.
    make_cache: Callable[[], list[Any]] = field(compare=False, repr=False, default=list)

    @property
    def trims(self) -> bool:
        """Whether every layer trims (then files need no checkpoints: any length restores)."""
        return all(s.trims for s in self.layers)

    @property
    def digest(self) -> str:
        """A digest of the layer specs (what a file records of the layout)."""
        text = json.dumps([asdict(s) for s in self.layers], sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def meta(self) -> dict[str, str]:
        """The metadata every file of this layout carries."""
        return {"layers": str(len(self.layers)), "layout": self.digest}

    def untrimmable(self) -> list[int]:
        """The layers a checkpoint holds: those that do not trim."""
        return [i for i, s in enumerate(self.layers) if not s.trims]

    def tensors(self, n: int, points: list[int] | tuple[int, ...] = ()) -> Shapes:
        """name -> (dtype, shape) of every tensor in a file of ``n`` tokens with checkpoints at
        ``points``, the tokens included."""
        out: Shapes = {"tokens": ("I32", (n,))}
        for i, spec in enumerate(self.layers):
            out.update(spec.tensors(str(i), n))
        for k, p in enumerate(points):
            for i in self.untrimmable():
                out.update(self.layers[i].tensors(f"c{k}.{i}", p))
        return out

    def __str__(self) -> str:
        kinds = [s.kind if s.kind != "list" else "list(" + ",".join(p.kind for p in s.parts) + ")"
                 for s in self.layers]
        return f"{len(self.layers)} layers ({', '.join(kinds)})"


def probe_layout(make_cache: Callable[[], list[Any]], forward: Callable[[mx.array, list[Any]], Any]) -> KVLayout:
    """The layout of the caches ``make_cache`` builds, as ``forward`` (the model's call on token
    ids with a cache) fills them: from shapes, nothing evaluated. Raises LayoutError for a
    cache the disk tier cannot store (a class of no known kind). MLX thread."""
    cache = make_cache()
    if not cache:
        raise LayoutError("the model keeps no cache")
    forward(mx.array([[0]]), cache)
    return KVLayout(tuple(_spec(c) for c in cache), make_cache)


def _spec(cache: Any) -> LayerSpec:
    k = kind(cache)
    name = type(cache).__name__
    if k == "list":
        return LayerSpec("list", name, parts=tuple(_spec(c) for c in cache.caches))
    if k == "state":
        arrays = getattr(cache, "cache", None)
        if not isinstance(arrays, list) or not all(a is None or isinstance(a, mx.array) for a in arrays):
            raise LayoutError(f"its {name} layers keep no list of arrays")
        fixed = tuple((f"state.{j}", tuple(a.shape), _dtype(a, name)) for j, a in enumerate(arrays) if a is not None)
        return LayerSpec("state", name, fixed=fixed)
    window = int(cache.max_size) if k == "rotating" else None
    if cache.keys is None:  # a layer the model leaves empty: nothing to keep
        return LayerSpec(k, name, window=window)
    named = [("keys", cache.keys), ("values", cache.values)]
    if k == "quantized":
        named = [(f"{kv}.{j}", x) for kv, q in named for j, x in enumerate(q)]
    seq = tuple((suffix, x.shape[1], x.shape[3], _dtype(x, name)) for suffix, x in named)
    return LayerSpec(k, name, seq=seq, window=window)


def _dtype(x: mx.array, cls: str) -> str:
    if x.dtype not in DTYPE_NAMES:
        raise LayoutError(f"its {cls} layers keep {x.dtype} arrays")
    return DTYPE_NAMES[x.dtype]


def model_layout(model: Any, bits: int | None = None, group_size: int = 64, *, plain: bool = False,
                 make_cache: Callable[[], list[Any]] | None = None,
                 forward: Callable[[mx.array, list[Any]], Any] | None = None) -> KVLayout:
    """The layout of a language model's caches as the engine keeps them: read off its fresh
    caches (``make_cache``, the model's own unless given) as ``forward`` fills them, and with
    ``bits`` its plain KV layers quantized, as ``kv_cache_bits`` says (``plain``: handed back
    dequantized; the quantized tensors follow from the plain ones' heads, width and dtype).
    Raises LayoutError. MLX thread."""
    make = make_cache or (lambda: make_prompt_cache(model))
    layout = probe_layout(make, forward or (lambda tokens, cache: model(tokens, cache=cache)))
    if not bits:
        return layout
    specs = tuple(_quantized(s, bits, group_size, plain) for s in layout.layers)
    return KVLayout(specs, lambda: quantize_caches(make(), bits, group_size, plain=plain))


def _quantized(spec: LayerSpec, bits: int, group_size: int, plain: bool) -> LayerSpec:
    """A plain KV layer's spec as ``kv_quant`` keeps it: codes, scales and biases for K and V."""
    if spec.kind == "list":
        return replace(spec, parts=tuple(_quantized(p, bits, group_size, plain) for p in spec.parts))
    if spec.kind != "kv":
        return spec
    seq = tuple(part for suffix, heads, width, dtype in spec.seq for part in (
        (f"{suffix}.0", heads, width * bits // 32, "U32"), (f"{suffix}.1", heads, width // group_size, dtype),
        (f"{suffix}.2", heads, width // group_size, dtype)))
    return replace(spec, kind="quantized", cls="SeqDequantizedKVCache" if plain else "SeqQuantizedKVCache", seq=seq)
