"""The decode step Tandem owns: rows of any model, prefilled, decoded and verified in batches.

``DecodeBatch`` (``batch``) is continuous batching over a model's public call, for every
cache kind (``app.engine.kv.layers``); ``verify`` is its speculative verify step and
rollback; ``phase`` holds rows with their batch caches; ``rows`` the row and what a step
says of it; ``sampling`` and ``reasoning`` a row's sampler and its reasoning budget;
``mirror`` the step's operations run here or mirrored on every rank of a distributed
model. The engines (``app.engine.batch``) drive it from the MLX thread.
"""

from __future__ import annotations

from typing import Any

from app.engine.mlx_internals import eos_token_ids
from app.engine.step.batch import DecodeBatch, Forward
from app.engine.step.rows import Drawn, Feed, PromptResponse, Response, RowInputs, ScoreResponse, ScoreSpec
from app.engine.step.verify import Outcome, RowProposal

__all__ = [
    "DecodeBatch",
    "Drawn",
    "Feed",
    "Forward",
    "Outcome",
    "PromptResponse",
    "Response",
    "RowInputs",
    "RowProposal",
    "ScoreResponse",
    "ScoreSpec",
    "new_decode_batch",
]


def new_decode_batch(model: Any, tokenizer: Any, *, completion_batch_size: int, prefill_batch_size: int,
                     prefill_step_size: int, checkpoints: bool = False, max_tokens: int = 0) -> DecodeBatch:
    """A decode step over a text model that stops each row at any of the tokenizer's EOS
    tokens (``max_tokens`` is each row's own: the argument is accepted for the settings
    distributed serving records)."""
    return DecodeBatch(model, stop_tokens=eos_token_ids(tokenizer), prefill_step_size=prefill_step_size,
                       prefill_batch_size=prefill_batch_size, completion_batch_size=completion_batch_size,
                       checkpoints=checkpoints)
