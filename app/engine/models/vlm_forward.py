"""A native VLM's rows in Tandem's decode step: each row's inputs, and the forward call.

The step (``app.engine.step.DecodeBatch``) runs every pass through one call,
``forward(tokens (B, L), cache, feed) -> logits (B, L, vocab)``, and never reads a row's
``RowInputs``. For an mlx-vlm model that call is ``VlmForward``: the language model
(``model.language_model``) given what mlx-vlm's own generators give it.

A row's inputs (``row_inputs``) are what ``get_input_embeddings`` gave for its whole
prompt (mlx-vlm's ``InputEmbeddingsFeatures``: the embeddings with the image features
merged in, and the model's extras), cut where its cached prefix ends: a row resumed from
a prefix gets exactly the embeddings and positions a full prefill gives it.

One pass feeds row i its tokens [start, start + length) after its base (``Feed``). Where
its inputs cover them (its prompt), it feeds their embeddings and extras; past them (the
tokens it drew) and for a row without inputs (a text prompt), the token ids, embedded by
the model's own text embedding, at the positions its language model gives them. A pass in
which no row feeds a covered position feeds token ids alone, as mlx-vlm decodes.

The fields of ``InputEmbeddingsFeatures``, and how a pass batches each across its rows
(mlx-vlm's own conventions: its batch generator's sequence-aligned prompt kwargs, and
its language models' decode positions):

    inputs_embeds            per token (hidden): the row's slice; tokens past it, and rows
                             without inputs, the model's text embeddings of their ids
    position_ids             per token, (3, n) M-RoPE sections or (1, n); past the prompt,
                             index + rope_deltas in every section, as mlx-vlm's language
                             models place decode tokens; a row without inputs: its index
                             (a text prompt's positions, checked at load)
    rope_deltas              per row: read into the decode positions above (the positions
                             are always passed explicit, never left to the language
                             model's own state, which is one per model, not per row)
    visual_pos_masks         per token, bool: which positions are image tokens
    deepstack_visual_embeds  per image token, compact, one array per layer: the image
                             tokens of the pass, row after row (Qwen3-VL's deepstack
                             reads them in that order)
    attention_mask_4d        dropped: a whole-prompt mask the step cannot cut into chunks;
                             Gemma 3's language model takes it into ``**kwargs`` unread
                             (mlx-vlm's generate passes it so), and the step's masks come
                             from the caches
    anything else            refused at load (``check_features``): cross attention,
                             encoder-decoder inputs, per-layer inputs

Positions are passed only for models whose embeddings carry them; the others place every
token by its row's cache offset, as the batch caches keep it. A row past its prompt for
good lets its embeddings and image features go. Its caches are mlx-lm's classes
(``make_cache``: the language model's own kinds, translated), so what the step and the
engine do with a cache (merge, snapshot and restore, checkpoints, quantized KV, KV files)
is the same for a VLM's rows as for a text model's. ``new_vlm_decode_batch`` makes the
step. MLX thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import mlx.core as mx
import numpy as np

from app.engine.kv.kv_quant import quantize_caches
from app.engine.mlx_internals import (
    vlm_embedding_features,
    vlm_forward,
    vlm_language_model,
    vlm_make_cache,
    vlm_stop_tokens,
    vlm_text_embeddings,
)
from app.engine.step.batch import DecodeBatch
from app.engine.step.rows import Feed, Row, RowInputs
from app.errors import ConfigError

# Fields of get_input_embeddings' output this module batches, and the one it drops.
_BATCHED = frozenset({"inputs_embeds", "position_ids", "rope_deltas", "visual_pos_masks", "deepstack_visual_embeds"})
_DROPPED = frozenset({"attention_mask_4d"})


def check_features(name: str, features: dict[str, Any]) -> None:
    """Refuse a model whose embeddings come with a field the step cannot batch."""
    unknown = sorted(set(features) - _BATCHED - _DROPPED)
    if unknown:
        raise ConfigError(f"model {name!r}: its embeddings come with {', '.join(unknown)}, "
                          "which Tandem's decode step cannot feed")


def row_inputs(features: dict[str, Any], start: int) -> RowInputs:
    """A row's inputs from its whole prompt's ``features`` (``vlm_embedding_features``),
    for its tokens from ``start`` on (the end of its cached prefix)."""
    extras: dict[str, Any] = {}
    positions = features.get("position_ids")
    if positions is not None:
        positions = positions[:, 0] if positions.ndim == 3 else positions  # (sections, L)
        extras["position_ids"] = positions[:, start:]
        extras["sections"] = int(positions.shape[0])
        deltas = features.get("rope_deltas")
        extras["rope_delta"] = int(deltas.reshape(-1)[0].item()) if deltas is not None else 0
    mask, deepstack = features.get("visual_pos_masks"), features.get("deepstack_visual_embeds")
    if mask is not None and deepstack is not None:  # the mask alone (no deepstack features) feeds nothing
        visual = np.asarray(mask[0]).astype(bool)
        before = int(visual[:start].sum())
        extras["visual_pos_masks"] = visual[start:]
        extras["deepstack_visual_embeds"] = [layer[before:] for layer in deepstack]
    return RowInputs(embeddings=features["inputs_embeds"][0, start:], extras=extras)


def rebase(inputs: RowInputs | None, n: int) -> RowInputs | None:
    """A row's inputs for its sequence re-inserted with ``n`` more tokens in its cache than
    when ``inputs`` were made (a row paused, for memory or for interactive work, and resumed
    from its KV): the per-token inputs from there on, the per-row ones as they are."""
    if inputs is None or n == 0:
        return inputs
    extras = dict(inputs.extras)
    if "position_ids" in extras:
        extras["position_ids"] = extras["position_ids"][:, n:]
    visual = extras.get("visual_pos_masks")
    if visual is not None:
        before = int(visual[:n].sum())
        extras["visual_pos_masks"] = visual[n:]
        extras["deepstack_visual_embeds"] = [layer[before:] for layer in extras["deepstack_visual_embeds"]]
    embeddings = inputs.embeddings[n:] if inputs.embeddings is not None else None
    return RowInputs(embeddings=embeddings, extras=extras)


class VlmForward:
    """The decode step's forward call for an mlx-vlm model (see the module docstring)."""

    def __init__(self, model: Any, name: str = "vlm") -> None:
        self.model = model
        # Whether a text prompt's embeddings carry positions (M-RoPE): then every pass
        # passes them, rows without inputs at their index, which must be the model's own.
        probe = vlm_embedding_features(model, {"input_ids": mx.array([[0, 0, 0]])})
        check_features(name, probe)
        self.positions = "position_ids" in probe
        if self.positions:
            own = np.asarray(probe["position_ids"]).reshape(-1, 3)
            delta = np.asarray(probe.get("rope_deltas", mx.zeros((1,)))).reshape(-1)
            if not (own == np.arange(3)).all() or delta.any():
                raise ConfigError(f"model {name!r}: a text prompt's positions are not its token indices")

    def make_cache(self) -> list[Any]:
        """A fresh cache for one row (mlx-lm's classes, one per layer)."""
        return vlm_make_cache(self.model)

    def quantized_cache(self, bits: int, group_size: int, plain: bool = False) -> list[Any]:
        """A fresh cache for one row with its plain KV layers quantized (``kv_cache_bits``),
        its windows and recurrent state as they are (``kv_quant.quantize_caches`` over this
        model's caches; ``plain``: handed back dequantized). ConfigError for a model without
        plain KV layers."""
        return quantize_caches(self.make_cache(), bits, group_size, plain=plain)

    def __call__(self, tokens: mx.array, cache: list[Any], feed: Feed) -> mx.array:
        width = tokens.shape[1]
        covered = [_covered(row, start, n) for row, start, n in zip(feed.rows, feed.starts, feed.lengths, strict=True)]
        features: dict[str, Any] = {}
        if any(covered):
            features["inputs_embeds"] = self._embeddings(tokens, feed, covered)
            features.update(_deepstack(feed, covered, width))
        if self.positions or any("sections" in _extras(row) for row in feed.rows):
            features["position_ids"] = _positions(feed, covered, width)
        _release(feed, covered)
        return vlm_forward(self.model, tokens, cache, **features)

    def _embeddings(self, tokens: mx.array, feed: Feed, covered: Sequence[int]) -> mx.array:
        """(B, L, hidden): each row's own embeddings where covered, the text embeddings of
        its ids after (cast to the text embeddings' dtype, so a row's numbers never depend
        on which rows share its pass)."""
        text = vlm_text_embeddings(self.model, tokens)
        rows = []
        for i, (row, start, n) in enumerate(zip(feed.rows, feed.starts, covered, strict=True)):
            if not n:
                rows.append(text[i])
                continue
            assert row.inputs is not None
            own = row.inputs.embeddings[start:start + n].astype(text.dtype)
            rows.append(own if n == tokens.shape[1] else mx.concatenate([own, text[i, n:]]))
        return mx.stack(rows)


class _Caches:
    """A VLM seen as ``make_prompt_cache`` sees a model: its caches are ``vlm_make_cache``'s."""

    def __init__(self, model: Any) -> None:
        self._model = model

    def make_cache(self) -> list[Any]:
        return vlm_make_cache(self._model)


def new_vlm_decode_batch(model: Any, processor: Any, *, completion_batch_size: int, prefill_batch_size: int,
                         prefill_step_size: int, checkpoints: bool = False, name: str = "vlm") -> DecodeBatch:
    """A decode step over an mlx-vlm model's language model, its rows fed by ``VlmForward``
    (rows inserted with ``inputs=``: ``row_inputs``, or None for a text prompt), each
    stopping where ``mlx_vlm.generate`` stops (``vlm_stop_tokens``)."""
    forward = VlmForward(model, name)
    return DecodeBatch(vlm_language_model(model), stop_tokens=vlm_stop_tokens(processor, model),
                       prefill_step_size=prefill_step_size, prefill_batch_size=prefill_batch_size,
                       completion_batch_size=completion_batch_size, forward=forward, make_cache=forward.make_cache,
                       checkpoints=checkpoints)


def _extras(row: Row) -> dict[str, Any]:
    return row.inputs.extras if row.inputs is not None else {}


def _release(feed: Feed, covered: Sequence[int]) -> None:
    """Rows past their prompt for good (a pass starts after their inputs end; a rollback
    never goes back into the prompt) keep only what places their next tokens: their
    embeddings and image features are let go (a long prompt's are megabytes per row)."""
    for row, start, n in zip(feed.rows, feed.starts, covered, strict=True):
        inputs = row.inputs
        if not n and inputs is not None and inputs.embeddings is not None and start >= inputs.embeddings.shape[0]:
            keep = {k: v for k, v in inputs.extras.items() if k in ("rope_delta", "sections")}
            row.inputs = RowInputs(embeddings=None, extras=keep)  # a new one: rows may share their inputs


def _covered(row: Row, start: int, length: int) -> int:
    """How many of the pass's positions of ``row`` its inputs cover (from the first)."""
    if row.inputs is None or row.inputs.embeddings is None:
        return 0
    return max(0, min(length, int(row.inputs.embeddings.shape[0]) - start))


def _positions(feed: Feed, covered: Sequence[int], width: int) -> mx.array:
    """The pass's positions: (3, B, L) when any row has M-RoPE sections, else (B, L)."""
    sections = max((_extras(r).get("sections", 1) for r in feed.rows), default=1)
    if not any(covered):  # a decode pass: each row's next positions, index + delta
        first = [r.base + s + _extras(r).get("rope_delta", 0) for r, s in zip(feed.rows, feed.starts, strict=True)]
        plain = mx.array(first, dtype=mx.int32)[:, None] + mx.arange(width, dtype=mx.int32)[None]
        return mx.broadcast_to(plain[None], (3, *plain.shape)) if sections == 3 else plain
    rows = []
    for row, start, n in zip(feed.rows, feed.starts, covered, strict=True):
        extras = _extras(row)
        index = row.base + start
        tail = mx.arange(index + n, index + width, dtype=mx.int32) + extras.get("rope_delta", 0)
        tail = mx.broadcast_to(tail[None], (sections, width - n))
        if n:
            own = extras["position_ids"][:, start:start + n].astype(mx.int32)
            tail = mx.concatenate([mx.broadcast_to(own, (sections, n)), tail], axis=1)
        rows.append(tail)
    stacked = mx.stack(rows, axis=1)  # (sections, B, L)
    return stacked if sections == 3 else stacked[0]


def _deepstack(feed: Feed, covered: Sequence[int], width: int) -> dict[str, Any]:
    """Qwen3-VL's per-layer image features for the pass's image tokens, with their mask;
    nothing when the pass has none."""
    masks, parts = [], []
    for row, start, n in zip(feed.rows, feed.starts, covered, strict=True):
        visual = _extras(row).get("visual_pos_masks")
        mask = np.zeros(width, dtype=bool)
        if visual is not None and n:
            mask[:n] = visual[start:start + n]
            count = int(mask.sum())
            if count:
                before = int(visual[:start].sum())
                parts.append([layer[before:before + count] for layer in _extras(row)["deepstack_visual_embeds"]])
        masks.append(mask)
    if not parts:
        return {}
    layers = [mx.concatenate([p[j] for p in parts]) for j in range(len(parts[0]))]
    return {"visual_pos_masks": mx.array(np.stack(masks)), "deepstack_visual_embeds": layers}
