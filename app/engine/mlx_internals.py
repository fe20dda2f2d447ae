"""Every private or undocumented mlx-lm / mlx-vlm API Tandem relies on, in one place.

mlx-lm's continuous batching and its cache classes are not a documented API:
the names, fields and behaviours below were read from mlx-lm 0.32.x and
mlx-vlm 0.7.x. ``pyproject.toml`` pins those minor versions, and
``tests/engine/test_mlx_internals.py`` checks each contract listed here and
fails naming it, so an upgrade that breaks one is caught before it ships.
Nothing else in Tandem imports these names from mlx-lm or mlx-vlm directly.

mlx-lm
- ``BatchGenerator(model, max_tokens=, stop_tokens=, completion_batch_size=,
  prefill_batch_size=, prefill_step_size=)``;
  ``insert_segments(segments, max_tokens=, caches=, all_tokens=, samplers=,
  logits_processors=) -> uids`` (each sequence's prompt in segments; the batch
  stops at segment ends so the KV up to there can be extracted);
  ``next() -> (prompt_responses, generation_responses)``: prompt responses carry
  ``uid, end_of_segment, end_of_prompt``; generation responses carry ``uid,
  token, logprobs, finish_reason`` and, on the last one, ``prompt_cache,
  all_tokens``; ``extract_cache(uids)`` and ``remove(uids,
  return_prompt_caches=True)`` give ``{uid: (cache, tokens)}``;
  ``prompt_cache_nbytes``: the bytes of every cache it holds (queued, prefilling,
  decoding), read by ``batch_kv_nbytes``. Its batch caches are rectangles: each
  row as wide as the widest (left padding, right-padded prefill chunks rolled
  left), grown ``KVCache.step`` (256) tokens at a time (``admission`` relies on it).
- ``models.cache``: ``LRUPromptCache(max_size=, max_bytes=)`` with
  ``fetch_nearest_cache(model, tokens) -> (cache, rest)``, ``insert_cache(model,
  tokens, cache, cache_type=)``, ``trim_to(n_bytes=)``, ``nbytes``;
  LRUPromptCache's ``__len__`` and ``trim_to(n_sequences=, n_bytes=)``, which
  evicts in its own LRU order (``prefix_cache`` enforces the limits with it);
  ``trim_prompt_cache``; ``make_prompt_cache``; ``KVCache`` and
  ``QuantizedKVCache`` fields (``keys``, ``values``, ``offset``, ``step``), which
  ``kv_snapshot`` reads and sets to save and restore a cache;
  ``_BaseCache``; ``dynamic_roll``; ``models.base.create_causal_mask``; the
  batch-cache protocol (``merge``, ``extract``, ``filter``, ``extend``,
  ``prepare``, ``finalize``, ``make_mask``) that ``kv_quant`` implements.
- ``TokenizerWrapper``: ``detokenizer`` (a fresh streaming detokenizer on each
  access), ``eos_token_ids``, ``has_thinking``.

mlx-vlm
- the processor's ``tokenizer.stopping_criteria.reset(eos_token_id)``, which
  ``mlx_vlm.generate`` calls before each generation (``stream_generate`` does not);
- ``processor.clean_output(text)`` when the model defines one;
- ``stream_generate`` responses' ``is_draft`` (speculative decoding).
"""

from __future__ import annotations

from typing import Any

from mlx_lm.generate import BatchGenerator
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import (
    KVCache,
    LRUPromptCache,
    QuantizedKVCache,
    _BaseCache,
    dynamic_roll,
    make_prompt_cache,
    trim_prompt_cache,
)

__all__ = [
    "BatchGenerator",
    "KVCache",
    "LRUPromptCache",
    "QuantizedKVCache",
    "_BaseCache",
    "batch_kv_nbytes",
    "create_causal_mask",
    "dynamic_roll",
    "eos_token_ids",
    "has_thinking",
    "is_draft",
    "make_prompt_cache",
    "new_batch_generator",
    "new_detokenizer",
    "reset_vlm_stopping",
    "trim_prompt_cache",
    "vlm_clean_output",
]


def new_batch_generator(
    model: Any, tokenizer: Any, *, max_tokens: int, completion_batch_size: int, prefill_batch_size: int,
    prefill_step_size: int,
) -> BatchGenerator:
    """A BatchGenerator that stops each sequence at any of the tokenizer's EOS tokens."""
    return BatchGenerator(
        model,
        max_tokens=max_tokens,
        stop_tokens=[[t] for t in eos_token_ids(tokenizer)],
        completion_batch_size=completion_batch_size,
        prefill_batch_size=prefill_batch_size,
        prefill_step_size=prefill_step_size,
    )


def batch_kv_nbytes(batch: BatchGenerator) -> int:
    """Bytes of KV the BatchGenerator's caches hold: queued, prefilling and decoding sequences."""
    return int(batch.prompt_cache_nbytes)


def eos_token_ids(tokenizer: Any) -> list[int]:
    """Every token id that ends a turn (mlx-lm's wrapper gathers them from the configs)."""
    return list(tokenizer.eos_token_ids)


def new_detokenizer(tokenizer: Any) -> Any:
    """A fresh streaming detokenizer: ``add_token``, ``finalize``, ``last_segment``."""
    return tokenizer.detokenizer


def has_thinking(tokenizer: Any) -> bool:
    """Whether mlx-lm knows the model's single-token think markers."""
    return bool(getattr(tokenizer, "has_thinking", False))


def reset_vlm_stopping(processor: Any, model: Any) -> None:
    """Reset mlx-vlm's stopping criteria before a generation, as ``mlx_vlm.generate`` does."""
    tokenizer = getattr(processor, "tokenizer", processor)
    if hasattr(tokenizer, "stopping_criteria"):
        tokenizer.stopping_criteria.reset(model.config.eos_token_id)


def vlm_clean_output(processor: Any, text: str) -> str:
    """The model's own clean-up of generated text, when it defines one."""
    clean = getattr(processor, "clean_output", None)
    return clean(text) if callable(clean) else text


def is_draft(response: Any) -> bool:
    """Whether an mlx-vlm stream response is a speculative draft, not accepted text."""
    return bool(getattr(response, "is_draft", False))
