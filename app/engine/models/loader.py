"""Load a model into MLX, mapping its ``LoadParams`` onto mlx-lm.

The mapping, one line each:
- ``dtype``        -> the dtype of unquantized floating-point weights;
- ``quantization`` -> ``nn.quantize`` at load (weights already quantized are left alone);
- ``kv_cache_bits`` -> K/V stored quantized (``kv_quant``), bits/8 bytes per element
                      plus a scale and a bias per group of ``KV_GROUP_SIZE``;
- ``mem`` (``EngineParams.kv_mem_mb``) -> the KV budget in bytes, which admission fills
  by what each layer of a row really holds (``KVGeometry``, read off the model's cache:
  full attention by tokens, sliding windows to their size, recurrent state per row).
Must run on the MLX-owner thread.
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from app.engine.kv.geometry import KVGeometry, probe_geometry
from app.engine.kv.layers import batched
from app.engine.mlx_internals import make_prompt_cache
from app.engine.models.progress import LoadProgress
from app.engine.params import LoadParams, ModelSource
from app.errors import ConfigError

log = logging.getLogger("tandem.engine")

DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}
QUANT_BITS = {"q4": 4, "q8": 8}
# Group size of a quantized KV cache; each group stores a scale and a bias.
KV_GROUP_SIZE = 64


def model_source(entry: ModelSource, role: str = "chat", progress: LoadProgress | None = None) -> str:
    """The local directory mlx-lm / mlx-vlm / mlx-embeddings load ``entry`` from. A hub id is
    resolved here to its verified snapshot (``app.engine.models.hub``: the cache, else a checked
    download of what the loader of ``role`` needs), so no loader ever downloads by itself.
    A download or a GGUF conversion reports its progress to ``progress``."""
    if entry.builtin:
        from app.engine.models.builtin_models import ensure_builtin

        return str(ensure_builtin(entry.builtin))
    if entry.local_path:
        path = Path(entry.local_path).expanduser()
        if not path.is_dir():
            raise ConfigError(f"model {entry.name!r}: local_path {path} is not a directory")
        return str(path)
    if entry.weight_file:
        from app.engine.models.gguf import convert_gguf
        from app.engine.paths import cache_root

        gguf = Path(entry.weight_file).expanduser()
        if not gguf.is_file():
            raise ConfigError(f"model {entry.name!r}: weight_file {gguf} does not exist")
        out = cache_root() / "converted" / entry.name
        if not (out / "config.json").exists():
            convert_gguf(gguf, out, progress=None if progress is None else
                         lambda stage, fraction: progress.report(f"converting GGUF ({stage})", fraction, 1.0))
        return str(out)
    assert entry.hf_id is not None
    from app.engine.models.hub import local_snapshot

    return str(local_snapshot(entry.name, entry.hf_id, role, progress))


def model_geometry(model: nn.Module, kv_bits: int | None, plain: bool = False) -> KVGeometry:
    """The model's KV cost per layer (``app.engine.kv.geometry``), read off its own cache:
    with ``kv_bits``, its plain KV layers quantized as the engine will keep them (``plain``:
    handed back dequantized, ``kv_quant.quantized_attention``)."""
    from app.engine.kv.kv_quant import make_quantized_prompt_cache

    make = (lambda: make_quantized_prompt_cache(model, kv_bits, KV_GROUP_SIZE, plain=plain)) if kv_bits else \
        (lambda: make_prompt_cache(model))
    # As the decode step gives them to the model: one-row batch caches (a quantized layer's is
    # what hands a plain-attention model its K/V dequantized).
    return probe_geometry(lambda: batched(make()), lambda tokens, cache: model(tokens, cache=cache))


def config_value(config: dict[str, Any], *keys: str) -> Any:
    """The first of ``keys`` in the config or its ``text_config``."""
    text = config.get("text_config", {})
    for key in keys:
        if key in config:
            return config[key]
        if key in text:
            return text[key]
    return None


def _is_quantized(model: nn.Module) -> bool:
    return any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())


def apply_params(model: nn.Module, params: LoadParams, *, evaluate: bool = True) -> None:
    """dtype and load-time quantization onto a loaded model (evaluated here unless the
    caller evaluates it in slices)."""
    if params.dtype is not None:
        dtype = DTYPES[params.dtype]
        # Only floating-point arrays; packed quantized weights are uint32 and stay.
        model.set_dtype(dtype, predicate=lambda d: mx.issubdtype(d, mx.floating))
    if params.quantization is not None:
        if _is_quantized(model):
            log.info("weights are already quantized; quantization=%s not applied", params.quantization)
        else:
            nn.quantize(
                model,
                group_size=params.quantization_group_size,
                bits=QUANT_BITS[params.quantization],
                class_predicate=lambda _, m: hasattr(m, "to_quantized")
                and m.weight.shape[-1] % params.quantization_group_size == 0,
            )
    if evaluate:
        mx.eval(model.parameters())


def activation_dtype(model: nn.Module) -> mx.Dtype:
    """The dtype activations (and so the KV cache) take: that of the norms' weights."""
    flat: list[tuple[str, Any]] = nn.utils.tree_flatten(model.parameters())  # type: ignore[assignment]
    for _, value in flat:
        if mx.issubdtype(value.dtype, mx.floating):
            return value.dtype
    return mx.float16


@dataclass
class LoadedModel:
    """A text model ready for the engine."""

    name: str
    model: nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    config: dict[str, Any]
    kv: KVGeometry
    max_model_len: int
    path: str
    # The KV cache's bits per element when quantized (LoadParams.kv_cache_bits).
    kv_cache_bits: int | None = None
    # Bytes the weights take in memory, as loaded (after dtype and quantization).
    weights_bytes: int = 0
    # A digest of what this model's KV depends on (disk_cache.kv_identity): the prefix
    # cache's files are kept per identity, so they never feed another model.
    kv_identity: str = ""
    # Quantized KV handed back dequantized: the model's attention reads plain K/V only
    # (``kv_quant.quantized_attention``).
    kv_plain_attention: bool = False


# Bytes of weights evaluated per step of a sliced load: a running stream's longest
# pause while another model loads is about the time to read this much.
LOAD_SLICE_BYTES = 64 * 2**20


def load_text_model(entry: ModelSource, params: LoadParams) -> LoadedModel:
    """Load a chat model with mlx-lm and apply its params, in one go. MLX thread only."""
    steps = load_text_model_steps(entry, params)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            loaded: LoadedModel = done.value
            return loaded


def load_text_model_steps(entry: ModelSource, params: LoadParams, progress: LoadProgress | None = None
                          ) -> Generator[None, None, LoadedModel]:
    """Load a chat model in slices (``MLXWorker.submit_steps``): the weights are mapped
    lazily, then read ``LOAD_SLICE_BYTES`` at a time, so the batches of models already
    loaded take their steps in between; ``progress`` hears of each slice. MLX thread only."""
    from mlx_lm import load

    progress = progress or LoadProgress()
    source = model_source(entry, progress=progress)
    progress.report("reading the model's config")
    yield
    try:
        loaded: Any = load(source, return_config=True, lazy=True)
        model, tokenizer, config = loaded
    except Exception as exc:  # noqa: BLE001 - any load failure is a config problem for the user
        raise ConfigError(f"model {entry.name!r}: cannot load {source}: {exc}") from exc
    yield
    apply_params(model, params, evaluate=False)
    arrays = _arrays(model)
    read = progress.bytes("loading weights", sum(a.nbytes for a in arrays))
    batch: list[Any] = []
    size = 0
    for array in arrays:
        batch.append(array)
        size += array.nbytes
        if size >= LOAD_SLICE_BYTES:
            mx.eval(batch)
            read(size)
            batch, size = [], 0
            yield
    mx.eval(batch)
    read(size)
    progress.report("starting engine")
    return loaded_model(entry, params, source, model, tokenizer, config)


def loaded_model(entry: ModelSource, params: LoadParams, source: str, model: nn.Module, tokenizer: Any,
                 config: dict[str, Any], kv: KVGeometry | None = None) -> LoadedModel:
    """A loaded (and evaluated) model as the engine takes it; ``kv`` overrides the geometry
    read from the config (a shard holds part of the KV)."""
    plain = False
    try:
        if params.kv_cache_bits is not None:
            from app.engine.kv.kv_quant import make_quantized_prompt_cache, quantized_attention

            bits = params.kv_cache_bits
            plain = quantized_attention(lambda cache: model(mx.array([[0]]), cache=cache),
                                        lambda p: make_quantized_prompt_cache(model, bits, KV_GROUP_SIZE, plain=p),
                                        bits, KV_GROUP_SIZE)
            if plain:
                log.info("model %s: its attention reads plain K/V only: its KV is kept at %d bits and dequantized "
                         "for each step", entry.name, bits)
        kv = kv or model_geometry(model, params.kv_cache_bits, plain)
    except ConfigError as exc:
        raise ConfigError(f"model {entry.name!r}: {exc.message}") from exc
    native_len = config_value(config, "max_position_embeddings") or 4096
    max_len = min(params.max_model_len or native_len, native_len)
    from app.engine.kv.kv_snapshot import kv_identity

    identity = kv_identity(model, source, {
        "activation_dtype": str(activation_dtype(model)), "dtype": params.dtype, "quantization": params.quantization,
        "quantization_group_size": params.quantization_group_size, "kv_cache_bits": params.kv_cache_bits,
        "kv_group_size": KV_GROUP_SIZE})
    return LoadedModel(entry.name, model, tokenizer, config, kv, int(max_len), source, params.kv_cache_bits,
                       weights_bytes=sum(a.nbytes for a in _arrays(model)), kv_identity=identity,
                       kv_plain_attention=plain)


def _arrays(model: nn.Module) -> list[Any]:
    flat: list[tuple[str, Any]] = nn.utils.tree_flatten(model.parameters())  # type: ignore[assignment]
    return [array for _, array in flat]
