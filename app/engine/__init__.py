"""The engine: everything that runs on MLX, behind one thread.

This module is the engine's public face: the rest of the app imports the engine from here
alone (``from app.engine import Registry``), never from its modules. Names load on first
use, so a command that needs ``cache_root`` does not import MLX.

Inside, each part imports only the parts below it (``tests/test_layering.py``):

    registry.py, distributed/  every served model by name under one memory budget, typed leases;
                      one model across ranks: shards, rank 0's control channel, a rank's engine
    roles.py          the table of roles: each role's handle class, loader and memory rule
    batch/            the batching engines (text and native VLM rows, encoders), admission,
                      channels, pacing, stop strings, the native VLM's vision-feature cache
    speculative/      drafters (prompt lookup, predictions, draft models) and the adaptive rule
    constrain/        constrained decoding: grammars and their per-sequence matchers
    models/           where weights come from and how each kind of model loads
    step/             the decode step Tandem owns: rows of any model, prefilled, decoded, verified,
                      their samplers, and the step's operations mirrored on every rank
    kv/               the cache kinds per layer, the prefix cache's memory and disk tiers
    worker.py, types.py, prompt.py, params.py, paths.py, chat_templates.py, mlx_internals.py
                      the leaves: the one MLX thread, what passes between the pipeline and the
                      engine, the prompt, the parameters config maps models.yaml into, where
                      files go, templates, and every private mlx-lm / mlx-vlm API in one place

Nothing here imports the API layer, the pipeline, Litestar or pydantic.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# The face: module -> the names it lends. The ``TYPE_CHECKING`` imports below say the same
# for type checkers (a test holds the two equal).
_FACE: dict[str, tuple[str, ...]] = {
    "app.engine.batch.admission": ("KV_STEP",),
    "app.engine.batch.encoder_engine": ("EncoderStats",),
    "app.engine.constrain.constraints": ("Constraint", "JsonObject", "JsonSchema", "Reasoning", "Tool",
                                         "ToolCalls"),
    "app.engine.constrain.grammar": ("Grammar", "compiler_for"),
    "app.engine.distributed.distributed": ("Distributed", "DistributedInfo", "join", "launched_backend"),
    "app.engine.distributed.sharding": ("check_params", "check_splittable", "load_shard", "read_config"),
    "app.engine.mlx_internals": ("has_thinking", "think_markers", "vlm_clean_output"),
    "app.engine.models.builtin_models": ("MINILM_NAME", "ensure_builtin", "ensure_minilm", "minilm_zip_path"),
    "app.engine.models.demo_model": ("DEMO_MODEL_NAME", "demo_gguf_path", "ensure_demo_model"),
    "app.engine.models.encoder": ("Embeddings", "Ranking"),
    "app.engine.models.encoder_inputs": ("EncoderInput", "EncoderInputs", "TokenIds"),
    "app.engine.models.hub": ("cached_snapshot", "download", "repo_id_like"),
    "app.engine.models.loader": ("model_source",),
    "app.engine.models.progress": ("LoadStep",),
    "app.engine.params": ("EncoderLimits", "EncoderSpec", "EngineParams", "LoadParams", "ModelSource",
                          "ModelSpec", "Quantization", "SpeculativeParams", "VisionSpec"),
    "app.engine.paths": ("cache_root",),
    "app.engine.prompt": ("MultimodalPrompt", "Prompt", "PromptBuilder", "TextPrompts", "TokenPrompt",
                          "completion_room", "pixel_digest"),
    "app.engine.registry": ("Lease", "Registry"),
    "app.engine.roles": ("ROLES",),
    "app.engine.types": ("SCORED", "CacheBreakpoint", "CacheTierStats", "DraftCounts", "Engine", "EngineStats",
                         "GenerationRecord", "GenerationRequest", "ModelHandle", "ReasoningBlock",
                         "SamplingParams", "ScoreRequest", "SpeculationRequest", "TokenDelta", "TokenLogprob"),
    "app.engine.worker": ("MLXWorker",),
}
_HOME = {name: module for module, names in _FACE.items() for name in names}
__all__ = sorted(_HOME)

if TYPE_CHECKING:
    from app.engine.batch.admission import KV_STEP
    from app.engine.batch.encoder_engine import EncoderStats
    from app.engine.constrain.constraints import Constraint, JsonObject, JsonSchema, Reasoning, Tool, ToolCalls
    from app.engine.constrain.grammar import Grammar, compiler_for
    from app.engine.distributed.distributed import Distributed, DistributedInfo, join, launched_backend
    from app.engine.distributed.sharding import check_params, check_splittable, load_shard, read_config
    from app.engine.mlx_internals import has_thinking, think_markers, vlm_clean_output
    from app.engine.models.builtin_models import MINILM_NAME, ensure_builtin, ensure_minilm, minilm_zip_path
    from app.engine.models.demo_model import DEMO_MODEL_NAME, demo_gguf_path, ensure_demo_model
    from app.engine.models.encoder import Embeddings, Ranking
    from app.engine.models.encoder_inputs import EncoderInput, EncoderInputs, TokenIds
    from app.engine.models.hub import cached_snapshot, download, repo_id_like
    from app.engine.models.loader import model_source
    from app.engine.models.progress import LoadStep
    from app.engine.params import (
        EncoderLimits,
        EncoderSpec,
        EngineParams,
        LoadParams,
        ModelSource,
        ModelSpec,
        Quantization,
        SpeculativeParams,
        VisionSpec,
    )
    from app.engine.paths import cache_root
    from app.engine.prompt import (
        MultimodalPrompt,
        Prompt,
        PromptBuilder,
        TextPrompts,
        TokenPrompt,
        completion_room,
        pixel_digest,
    )
    from app.engine.registry import Lease, Registry
    from app.engine.roles import ROLES
    from app.engine.types import (
        SCORED,
        CacheBreakpoint,
        CacheTierStats,
        DraftCounts,
        Engine,
        EngineStats,
        GenerationRecord,
        GenerationRequest,
        ModelHandle,
        ReasoningBlock,
        SamplingParams,
        ScoreRequest,
        SpeculationRequest,
        TokenDelta,
        TokenLogprob,
    )
    from app.engine.worker import MLXWorker


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'app.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return __all__
