"""Each LoadParams / EngineParams -> MLX mapping, checked on a real loaded model."""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
import pytest

from app.config.schema import ChatParams
from app.engine.batch.engine import TextEngine
from app.engine.models.loader import activation_dtype, load_text_model
from app.engine.params import ModelSource
from app.engine.worker import MLXWorker
from app.errors import ConfigError
from app.specs import engine_params, load_params


def load(path, **params):
    p = ChatParams(**params)
    return load_text_model(ModelSource("m", local_path=str(path)), load_params(p)), p


def linear_types(model):
    return {type(m) for _, m in model.named_modules() if isinstance(m, (nn.Linear, nn.QuantizedLinear))}


@pytest.mark.parametrize(
    "dtype, expected", [("bfloat16", mx.bfloat16), ("float16", mx.float16), ("float32", mx.float32)]
)
def test_dtype_sets_unquantized_weights(tiny_model_dir, dtype, expected):
    loaded, _ = load(tiny_model_dir, dtype=dtype)
    w = loaded.model.model.layers[0].self_attn.q_proj.weight
    assert w.dtype == expected and activation_dtype(loaded.model) == expected


@pytest.mark.parametrize("isq, bits", [("q4", 4), ("q8", 8)])
def test_quantization_at_load(tiny_model_dir, isq, bits):
    loaded, _ = load(tiny_model_dir, quantization=isq)
    q = loaded.model.model.layers[0].self_attn.q_proj
    assert isinstance(q, nn.QuantizedLinear) and q.bits == bits and q.group_size == 64
    out = loaded.model(mx.array([[1, 2, 3]]))
    assert out.shape == (1, 3, 49152)


def test_already_quantized_weights_load_as_they_are(demo_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="tandem.engine"):
        loaded, _ = load(demo_model_dir, quantization="q8")
    q = loaded.model.model.layers[0].self_attn.q_proj
    assert isinstance(q, nn.QuantizedLinear) and q.bits == 4  # the GGUF's own 4 bits
    assert "already quantized" in caplog.text


def test_mem_maps_to_kv_budget_in_tokens(tiny_model_dir):
    loaded, _ = load(tiny_model_dir, mem=64)
    # tiny: 2 layers x 2 kv heads x head_dim 16 x (K and V) x 4 bytes (float32)
    assert loaded.kv.bytes_per_token == 2 * 2 * 16 * 2 * 4
    assert loaded.kv.budget_tokens(64) == 64 * 2**20 // 512


def test_kv_cache_bits_needs_a_head_dim_the_group_size_divides(tiny_model_dir):
    # The tiny model's head_dim is 16; quantized KV groups are 64 wide.
    with pytest.raises(
        ConfigError, match="'m': kv_cache_bits=8 needs every attention layer's head_dim divisible by 64"
    ):
        load(tiny_model_dir, kv_cache_bits=8)


def test_engine_maps_batch_and_prefill_params(tiny_model_dir, caplog):
    p = ChatParams(mem=32, max_num_seqs=3, prefill_chunk_size=48)
    worker = MLXWorker()
    worker.start()
    try:
        source = ModelSource("m", local_path=str(tiny_model_dir))
        loaded = worker.submit(lambda: load_text_model(source, load_params(p))).result()
        with caplog.at_level(logging.INFO, logger="tandem.engine"):
            eng = TextEngine(worker, loaded, engine_params(p))
        assert eng._bg.prefill_step_size == 48
        assert eng._bg.completion_batch_size == 3 and eng.admission.max_seqs == 3
        assert eng.admission.budget_tokens == 32 * 2**20 // 512
        assert f"budget {eng.admission.budget_tokens} tokens" in caplog.text
    finally:
        worker.stop()


def test_max_model_len_is_capped_to_the_model(tiny_model_dir):
    loaded, _ = load(tiny_model_dir, max_model_len=100_000)
    assert loaded.max_model_len == 2048
    loaded, _ = load(tiny_model_dir, max_model_len=512)
    assert loaded.max_model_len == 512
