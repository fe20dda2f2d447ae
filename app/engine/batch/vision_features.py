"""The vision-feature cache: the vision tower's output per image, so an image seen before
skips the tower even when the text around it changed.

Open WebUI resends every earlier image on every turn, and a new conversation about the
same screenshot sends it again: the tower's work on those pixels is the same each time.
What one image's features depend on, and so what its key holds:

    scope        the request's cache namespace (API key, cache_salt): features never
                 cross scopes, as the text prefix cache's prefixes do not
    digest       sha256 of the decoded, resized pixels (``PromptImage.digest``): the
                 same picture as PNG, lossless WebP or from another URL is one key,
                 two pictures behind one URL are two
    processor    the model's max_pixels / min_pixels, and the image's patch grid as
                 the processor made it (its resize): the shape the tower saw

The value is the tower's rows for that image (one per image token, as the processor
expanded its placeholder), an MLX array that stays on the MLX thread. The cache is an
LRU bounded in bytes (``vision_feature_cache_mb``), counted in the model's memory
budget next to its weights and the worst-case profile (``app.engine.roles``); an
entry larger than the whole cap is not kept. Models whose mlx-vlm class cannot take
features from outside (``mlx_internals.vlm_feature_rows`` None) encode every time.
MLX thread only, except ``stats``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import mlx.core as mx

from app.engine.mlx_internals import (
    vlm_blank_features,
    vlm_embedding_features,
    vlm_encode_images,
    vlm_feature_rows,
)
from app.engine.models.vlm_forward import row_inputs
from app.engine.prompt import MultimodalPrompt, Prompt, PromptImage
from app.engine.step.rows import RowInputs
from app.engine.types import CacheTierStats


class FeatureCache:
    """An LRU of per-image vision features, at most ``max_bytes`` in all."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, mx.array] = OrderedDict()
        self._bytes = 0
        self._stats = CacheTierStats(budget_bytes=max_bytes)
        # The vision tower's own runs: images encoded, and their seconds in all.
        self.encoded = 0
        self.encode_s = 0.0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def get(self, key: str) -> mx.array | None:
        """The features under ``key`` (now the most recently used), or None; counted."""
        value = self._entries.get(key)
        if value is None:
            self._stats.misses += 1
            return None
        self._entries.move_to_end(key)
        self._stats.hits += 1
        self._stats.tokens += int(value.shape[0])
        return value

    def put(self, key: str, features: mx.array) -> None:
        """Keep ``features`` under ``key``, evicting the least recently used beyond the cap."""
        size = int(features.nbytes)
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self._bytes -= int(old.nbytes)
        self._entries[key] = features
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self._bytes -= int(evicted.nbytes)
            self._stats.evictions += 1

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def stats(self) -> CacheTierStats:
        """Hits, misses, evictions, bytes and entries now (``tokens``: image tokens served)."""
        return replace(self._stats, bytes=self._bytes, entries=len(self._entries))


def feature_key(scope: str, image: PromptImage, grid: Sequence[int], max_pixels: int, min_pixels: int) -> str:
    """One image's key: its scope, its pixels, and what shaped the tower's input."""
    return "\x00".join((scope, image.digest, f"{max_pixels}/{min_pixels}", "x".join(map(str, grid))))


def prompt_row_inputs(model: Any, prompt: Prompt, cache: FeatureCache | None, scope: str, max_pixels: int,
                      min_pixels: int, *, cached_tokens: int = 0) -> RowInputs | None:
    """A native VLM's row for ``prompt`` in the decode step, from its ``cached_tokens`` on:
    its embeddings (image features merged in, from ``cache`` where the model allows, as
    ``image_features``) and the model's extras, cut where the cached prefix ends
    (``vlm_forward.row_inputs``). None for a prompt without images: a text row, which the
    forward call embeds and places itself as the model does a text prompt. MLX thread."""
    if not isinstance(prompt, MultimodalPrompt):
        return None
    inputs = {"input_ids": mx.array([prompt.tokens]), **_grown(prompt.inputs, len(prompt.tokens))}
    features = image_features(model, inputs, prompt.images, cache, scope, max_pixels, min_pixels, cached_tokens)
    return row_inputs(vlm_embedding_features(model, inputs, features), cached_tokens)


def _grown(inputs: Mapping[str, mx.array], n: int) -> dict[str, mx.array]:
    """The processor's inputs for a prompt with text tokens after what it processed (a
    decision's option read whole): its per-token arrays (those as long as its attention mask)
    grown to ``n`` tokens as it gives them for text: the mask with ones, token types with zeros."""
    mask = inputs.get("attention_mask")
    if mask is None or mask.ndim != 2 or mask.shape[1] >= n:
        return dict(inputs)
    m = mask.shape[1]
    out = {}
    for name, value in inputs.items():
        if value.ndim == 2 and value.shape == (1, m):
            fill = mx.ones if name == "attention_mask" else mx.zeros
            value = mx.concatenate([value, fill((1, n - m), dtype=value.dtype)], axis=1)
        out[name] = value
    return out


def image_features(model: Any, inputs: dict[str, Any], images: Sequence[PromptImage], cache: FeatureCache | None,
                   scope: str, max_pixels: int, min_pixels: int, cached_tokens: int = 0) -> mx.array | None:
    """Every image's rows of vision features, in order, for ``get_input_embeddings``'
    ``cached_image_features``: from ``cache``, through the tower one image at a time (then
    kept), or blank for an image inside the first ``cached_tokens``. None (the tower runs on
    the whole prompt's images inside ``get_input_embeddings``) where the model cannot take
    features image by image, or there is nothing to gain."""
    skip = any(img.start + img.length <= cached_tokens for img in images)
    rows = vlm_feature_rows(model, inputs) if (cache is not None or skip) and images else None
    if rows is None or len(rows) != len(images):
        return None
    grids = inputs["image_grid_thw"].tolist()
    keys = [feature_key(scope, img, grid, max_pixels, min_pixels) for img, grid in zip(images, grids, strict=True)]
    features: list[mx.array] = []
    for i, key in enumerate(keys):  # in order: an image twice in one prompt is encoded once
        if images[i].start + images[i].length <= cached_tokens:
            features.append(vlm_blank_features(model, images[i].placeholders))
            continue
        found = cache.get(key) if cache is not None else None
        if found is None:  # one image at a time: each entry owns exactly its rows
            started = time.perf_counter()
            start, count = rows[i]
            found = vlm_encode_images(model, inputs["pixel_values"][start:start + count], mx.array([grids[i]]))
            mx.eval(found)
            if cache is not None:
                cache.encode_s += time.perf_counter() - started
                cache.encoded += 1
                cache.put(key, found)
        features.append(found)
    return mx.concatenate(features, axis=0)
