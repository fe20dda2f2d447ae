"""models.yaml -> pydantic -> the engine's frozen LoadParams / EngineParams, with CLI overrides."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from app.config.loader import load_models_file, resolve
from app.config.mapping import engine_params, load_params
from app.config.schema import ModelParams
from app.engine.params import EngineParams
from app.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "models.yaml"
    p.write_text(text)
    return p


def test_repo_models_yaml_is_valid():
    mf = load_models_file(REPO / "models.yaml")
    cfg = resolve(mf)
    assert cfg.primary.name == "smollm2-135m-instruct"
    assert cfg.vision is not None and cfg.vision.role == "vision"


def test_engine_params_are_frozen_and_logged():
    with pytest.raises(ValidationError):
        ModelParams().mem = 5  # type: ignore[misc]
    p = engine_params(ModelParams(mem=300, max_num_seqs=4, prefill_batch_size=16))
    with pytest.raises(AttributeError):
        p.kv_mem_mb = 5  # type: ignore[misc]
    assert p.prefill_batch_size == 4  # never more than the batch
    line = p.to_log_string()
    for key in ("kv_mem_mb=300", "max_num_seqs=4", "prefill_chunk_size=", "prompt_cache_share=0.25",
                "prompt_cache_entries=256", "background_share="):
        assert key in line
    assert p.prompt_cache_bytes == 75 * 2**20  # a quarter of mem unless prompt_cache_mem says
    assert engine_params(ModelParams(mem=300, prompt_cache_mem=10)).prompt_cache_bytes == 10 * 2**20
    assert load_params(ModelParams(dtype="bfloat16", quantization="q4")).quantization == "q4"


def test_every_engine_knob_has_a_default_in_one_place():
    """The engine's params type holds every knob; a models.yaml entry maps onto it."""
    defaults = EngineParams()
    mapped = engine_params(ModelParams())
    assert mapped.prompt_cache_share == defaults.prompt_cache_share
    assert mapped.starvation_s == defaults.starvation_s and mapped.channel_max_pending == defaults.channel_max_pending


@pytest.mark.parametrize(
    "yaml_text, key, allowed",
    [
        ("models:\n  - name: a\n    builtin: smollm2-135m-instruct\n    params: {dtyp: float16}\n", "models[0].params.dtyp", "unknown key"),
        ("models:\n  - name: a\n    builtin: smollm2-135m-instruct\n    params: {dtype: fp8}\n", "models[0].params.dtype", "'float16', 'bfloat16' or 'float32'"),
        ("models:\n  - name: a\n    builtin: smollm2-135m-instruct\n    capabilities: {vision_mode: maybe}\n", "models[0].capabilities.vision_mode", "'disabled', 'proxy' or 'native'"),
        ("models:\n  - name: a\n    builtin: smollm2-135m-instruct\n    params: {max_num_seqs: 0}\n", "models[0].params.max_num_seqs", "greater than or equal to 1"),
    ],
)
def test_bad_values_name_file_key_and_allowed(tmp_path, yaml_text, key, allowed):
    path = write(tmp_path, yaml_text)
    with pytest.raises(ConfigError) as info:
        load_models_file(path)
    msg = info.value.message
    assert str(path) in msg and key in msg and allowed in msg


def test_broken_yaml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_models_file(write(tmp_path, "models: [\n"))
    with pytest.raises(ConfigError, match="cannot read"):
        load_models_file(tmp_path / "nope.yaml")


def test_proxy_must_name_an_entry(tmp_path):
    text = ("models:\n  - name: a\n    builtin: smollm2-135m-instruct\n"
            "    capabilities: {vision_mode: proxy, vision_proxy: {model: ghost}}\n")
    with pytest.raises(ConfigError, match="ghost"):
        load_models_file(write(tmp_path, text))


def test_cli_overrides_win_and_are_validated(tmp_path):
    text = "models:\n  - name: a\n    builtin: smollm2-135m-instruct\n    params: {mem: 100, max_num_seqs: 2}\n"
    mf = load_models_file(write(tmp_path, text))
    cfg = resolve(mf, overrides={"mem": 300, "isq": "q8", "port": 9001, "dtype": None})
    assert cfg.primary.params.mem == 300
    assert cfg.primary.params.quantization == "q8"
    assert cfg.primary.params.max_num_seqs == 2  # from the file
    assert cfg.server.port == 9001
    with pytest.raises(ConfigError, match="max_num_seqs"):
        resolve(mf, overrides={"max_num_seqs": -1})


def test_kv_split_adds_up_when_mem_not_given():
    assert ModelParams(kvcache_mem_gpu=300, kvcache_mem_cpu=100).kv_mem_mb == 400
    assert ModelParams(mem=50, kvcache_mem_gpu=300).kv_mem_mb == 50
    assert engine_params(ModelParams(kvcache_mem_gpu=300, kvcache_mem_cpu=100)).kv_mem_mb == 400


def test_unknown_served_model(tmp_path):
    mf = load_models_file(write(tmp_path, "models:\n  - name: a\n    builtin: smollm2-135m-instruct\n"))
    with pytest.raises(ConfigError, match="no chat model 'b'"):
        resolve(mf, model="b")


def test_native_vision_is_accepted_and_image_token_is_gone(tmp_path):
    """The placeholder comes from the VLM's processor, never from configuration."""
    text = "models:\n  - name: a\n    builtin: smollm2-135m-instruct\n    capabilities: {vision_mode: native}\n"
    assert load_models_file(write(tmp_path, text)).models[0].capabilities.vision_mode == "native"
    old = text.replace("{vision_mode: native}", "{vision_mode: native, image_token: '<image>'}")
    with pytest.raises(ConfigError, match="image_token: unknown key"):
        load_models_file(write(tmp_path, old))
