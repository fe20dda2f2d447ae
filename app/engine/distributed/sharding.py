"""One rank's shard of a chat model: what can be split over the world size, and loading it.

``check_splittable`` runs on every rank before anything is loaded and refuses, with the
numbers, a model that cannot be split: tensor parallel gives each rank a slice of the
attention heads, the KV heads and the MLP, so each must divide by the world size (mlx_lm.server
starts such a model anyway and dies on its first request); pipeline parallel gives each rank a
run of layers. ``load_shard`` loads with mlx-lm's ``sharded_load`` and sizes the KV cache
for the shard this rank holds. MLX thread only.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from app.engine.mlx_internals import sharded_load, sharding_support
from app.engine.models.loader import (
    LoadedModel,
    apply_params,
    loaded_model,
    model_geometry,
    model_source,
)
from app.engine.params import LoadParams, ModelSource
from app.errors import ConfigError

log = logging.getLogger("tandem.distributed")


def read_config(source: str) -> dict[str, Any]:
    """A model's config.json, from its directory (``model_source``: a hub id's verified snapshot)."""
    path = Path(source)
    try:
        config: dict[str, Any] = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path / 'config.json'}: {exc}") from exc
    return config


def _value(config: dict[str, Any], key: str) -> Any:
    return config.get(key, config.get("text_config", {}).get(key))


def check_splittable(name: str, config: dict[str, Any], world_size: int, mode: str) -> None:
    """Raise ConfigError, naming the numbers, unless ``mode`` can split this model over
    ``world_size`` ranks."""
    try:
        tensor_ok, pipeline_ok = sharding_support(config)
    except Exception as exc:  # noqa: BLE001 - an unknown model type: mlx-lm cannot load it at all
        raise ConfigError(f"model {name!r}: mlx-lm cannot build model_type {config.get('model_type')!r}: "
                          f"{exc}") from exc
    model_type = config.get("model_type")
    if mode == "pipeline":
        layers = int(_value(config, "num_hidden_layers") or 0)
        if not pipeline_ok:
            raise ConfigError(f"model {name!r} (model_type {model_type}) cannot be split by layers in mlx-lm: "
                              "use params.distributed: tensor")
        if layers < world_size:
            raise ConfigError(f"model {name!r} has {layers} layers; pipeline parallel over {world_size} ranks "
                              f"needs at least one layer per rank")
        return
    if not tensor_ok:
        alternative = "use params.distributed: pipeline" if pipeline_ok else "it cannot be served distributed"
        raise ConfigError(f"model {name!r} (model_type {model_type}) has no tensor parallel split in mlx-lm; "
                          f"{alternative}")
    heads = int(_value(config, "num_attention_heads") or 0)
    kv_heads = int(_value(config, "num_key_value_heads") or heads)
    if heads % world_size or kv_heads % world_size:
        alternative = " params.distributed: pipeline or" if pipeline_ok else ""
        raise ConfigError(
            f"model {name!r} has {heads} attention heads and {kv_heads} KV heads; tensor parallel over "
            f"{world_size} ranks needs both divisible by {world_size}; use{alternative} a world size that "
            f"divides them")
    mlp = _value(config, "intermediate_size")
    if mlp and int(mlp) % world_size:
        raise ConfigError(f"model {name!r} has an MLP of {mlp} units; tensor parallel over {world_size} ranks "
                          f"needs it divisible by {world_size}")


def check_params(name: str, params: LoadParams) -> None:
    """Load params a shard cannot take."""
    if params.quantization is not None:
        # The sharded linear layers have no load-time quantization; a quantized checkpoint shards fine.
        raise ConfigError(f"model {name!r}: params.quantization ({params.quantization}) cannot be applied to a "
                          "sharded model; serve a quantized checkpoint instead (mlx_lm.convert -q)")


def load_shard(entry: ModelSource, params: LoadParams, world_size: int) -> LoadedModel:
    """This rank's shard of ``entry``, with the KV geometry of the shard. Every rank calls it
    at the same point (it ends with a collective). MLX thread only."""
    source = model_source(entry)
    pipeline = params.distributed == "pipeline"
    if pipeline and Path(source).is_dir() and not (Path(source) / "model.safetensors.index.json").exists():
        raise ConfigError(f"model {entry.name!r}: pipeline parallel needs {source}/model.safetensors.index.json "
                          "(mlx_lm.convert writes one)")
    try:
        model, tokenizer, config = sharded_load(source, pipeline=pipeline)
    except ValueError as exc:
        raise ConfigError(f"model {entry.name!r}: cannot shard {source}: {exc}") from exc
    apply_params(model, params)
    # This rank's own part, read off its shard's cache: pipeline, its layers only (rank 0 holds
    # the most: the low ranks take the extra ones); tensor parallel, its share of each layer's heads.
    kv = model_geometry(model, params.kv_cache_bits)
    loaded = loaded_model(entry, params, source, model, tokenizer, config, kv)
    log.info("model %s: this rank's %s shard: %.0f MB of weights, KV %d bytes/token", entry.name,
             params.distributed, loaded.weights_bytes / 2**20, kv.bytes_per_token)
    return loaded
