"""Convert a llama-architecture GGUF file into an mlx-lm model directory.

MLX reads GGUF itself (``mx.load``): Q4_0, Q4_1 and Q8_0 tensors come back as
MLX affine-quantized triplets ``X.weight`` (packed uint32), ``X.scales`` and
``X.biases``, so nothing is requantized. This module supplies what mlx-lm
needs around those arrays:

    GGUF                              mlx-lm directory
    token_embd.*                  ->  model.embed_tokens.*
    blk.N.attn_q.* / attn_k.*     ->  model.layers.N.self_attn.q_proj.* / k_proj.*
                                      (rows un-permuted, see ``_unpermute_rows``)
    blk.N.ffn_gate.* ...          ->  model.layers.N.mlp.gate_proj.* ...
    output.*                      ->  lm_head.* (absent: tie_word_embeddings)
    llama.* metadata              ->  config.json, with a "quantization" block
    tokenizer.ggml.*              ->  tokenizer.json, tokenizer_config.json, ...

The result is written beside ``out_dir`` and renamed into place, with a
``tandem-conversion.json`` marker inside, so a directory either is a complete
conversion or does not exist.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from app.errors import ConfigError

# Bump whenever the output changes, so cached conversions are redone.
CONVERTER_VERSION = 1
MARKER_NAME = "tandem-conversion.json"

ProgressFn = Callable[[str, float], None]

_LAYER_PARTS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_PARTS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_TENSOR_NAME = re.compile(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|scales|biases|bias)")

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_CONTROL, _USER_DEFINED = 3, 4


def convert_gguf(gguf_path: Path, out_dir: Path, *, progress: ProgressFn | None = None) -> Path:
    """Convert ``gguf_path`` into an mlx-lm model directory at ``out_dir``.

    ``progress(stage, fraction)`` is called a few dozen times with the stage
    ("reading", "weights", "tokenizer", "saving", "done") and the overall
    fraction done, 0.0 to 1.0. An existing ``out_dir`` is replaced. Raises
    ``ConfigError`` for a missing or unreadable file or an unsupported model.
    """
    report = progress or (lambda stage, fraction: None)
    report("reading", 0.0)
    tensors, meta = _read_gguf(Path(gguf_path))
    config = _model_config(meta, tensors)
    report("weights", 0.05)
    weights = _rename_weights(tensors, config, report)
    if quantization := _quantization(weights, config):
        config["quantization"] = quantization
    report("tokenizer", 0.4)
    tokenizer = _build_tokenizer(meta)
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        _write_tokenizer_files(tmp, tokenizer, meta, config)
        _write_json(tmp / "config.json", config)
        report("saving", 0.5)
        # Saving evaluates the lazy un-permute and writes the ~100 MB of weights.
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        marker = {"converter_version": CONVERTER_VERSION, **_source_identity(Path(gguf_path))}
        _write_json(tmp / MARKER_NAME, marker)
        report("saving", 0.95)
        publish_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    report("done", 1.0)
    return out_dir


def conversion_is_current(out_dir: Path, gguf_path: Path) -> bool:
    """True when ``out_dir`` holds a complete conversion of ``gguf_path`` by this converter."""
    try:
        marker = json.loads((Path(out_dir) / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    expected = {"converter_version": CONVERTER_VERSION, **_source_identity(Path(gguf_path))}
    return marker == expected


def remove_partials(out_dir: Path) -> None:
    """Delete the temp dirs that interrupted conversions into ``out_dir`` left behind.

    Only safe while holding a lock that keeps other converters of ``out_dir`` out.
    """
    out_dir = Path(out_dir)
    for leftover in out_dir.parent.glob(f".{out_dir.name}.partial-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    for leftover in out_dir.parent.glob(f".{out_dir.name}.old-*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _source_identity(gguf_path: Path) -> dict[str, Any]:
    try:
        size = gguf_path.stat().st_size
    except OSError:
        size = None
    return {"source": gguf_path.name, "source_bytes": size}


def _read_gguf(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    if not path.is_file():
        raise ConfigError(f"GGUF file not found: {path}")
    try:
        loaded: Any = mx.load(str(path), format="gguf", return_metadata=True)
        tensors, meta = loaded
    except (RuntimeError, ValueError, OSError) as exc:
        raise ConfigError(f"Cannot read {path} as GGUF: {exc}") from exc
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ConfigError(
            f"{path.name}: architecture {arch!r} is not supported; only 'llama' GGUFs convert"
        )
    return tensors, meta


def _value(meta: dict[str, Any], key: str, default: Any = ...) -> Any:
    """A metadata value as plain Python (MLX hands scalars back as 0-d arrays)."""
    if key not in meta:
        if default is ...:
            raise ConfigError(f"GGUF metadata lacks {key!r}")
        return default
    value = meta[key]
    if not isinstance(value, mx.array):
        return value
    if value.dtype == mx.float32 and value.ndim == 0:
        scalar: Any = value.item()
        return _shortest_float32(scalar)
    return value.tolist()


def _shortest_float32(x: float) -> float:
    """The shortest decimal that is the same float32 (1e-05, not 9.999999747e-06)."""
    exact = struct.pack("<f", x)
    for digits in range(1, 10):
        candidate = float(f"{x:.{digits}g}")
        if struct.pack("<f", candidate) == exact:
            return candidate
    return x


def _model_config(meta: dict[str, Any], tensors: dict[str, mx.array]) -> dict[str, Any]:
    hidden = _value(meta, "llama.embedding_length")
    heads = _value(meta, "llama.attention.head_count")
    tokens = _value(meta, "tokenizer.ggml.tokens")
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": _value(meta, "llama.block_count"),
        "intermediate_size": _value(meta, "llama.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _value(meta, "llama.attention.head_count_kv", heads),
        "head_dim": _value(meta, "llama.attention.key_length", hidden // heads),
        "rms_norm_eps": _value(meta, "llama.attention.layer_norm_rms_epsilon"),
        "rope_theta": _value(meta, "llama.rope.freq_base", 10000.0),
        "vocab_size": _value(meta, "llama.vocab_size", len(tokens)),
        "max_position_embeddings": _value(meta, "llama.context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _value(meta, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _value(meta, "tokenizer.ggml.eos_token_id", None),
    }
    scaling = _value(meta, "llama.rope.scaling.type", "none")
    if scaling == "linear":
        factor = _value(meta, "llama.rope.scaling.factor")
        config["rope_scaling"] = {"type": "linear", "factor": factor}
    elif scaling != "none" or "rope_freqs.weight" in tensors:
        raise ConfigError(f"GGUF rope scaling {scaling!r} (or rope_freqs) is not supported")
    return config


def _rename_weights(
    tensors: dict[str, mx.array], config: dict[str, Any], report: ProgressFn
) -> dict[str, mx.array]:
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    weights = {}
    for i, (name, array) in enumerate(sorted(tensors.items())):
        match = _TENSOR_NAME.fullmatch(name)
        part = match and (_LAYER_PARTS if match[1] else _TOP_PARTS).get(match[2])
        if not part or match is None:
            raise ConfigError(f"GGUF tensor {name!r} has no mlx-lm llama counterpart")
        block, kind, suffix = match.groups()
        if kind in heads:
            array = _unpermute_rows(array, heads[kind])
        # Norms stay float32 as GGUF stores them: that keeps activations float32,
        # which MLX's CPU backend runs ~30x faster than float16.
        prefix = f"model.layers.{block}." if block else ""
        weights[f"{prefix}{part}.{suffix}"] = array
        if i % 100 == 0:
            report("weights", 0.05 + 0.35 * i / len(tensors))
    return weights


def _unpermute_rows(x: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's q/k row permutation (interleaved rotary -> HF half-split).

    llama.cpp's convert script reorders each head's rows from [first half,
    second half] to pairs; only rows move, so this works on packed weights,
    scales and biases alike.
    """
    rows = x.shape[0]
    return x.reshape(n_heads, rows // n_heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _quantization(weights: dict[str, mx.array], config: dict[str, Any]) -> dict[str, Any] | None:
    """mlx-lm's "quantization" block: the commonest setting plus per-path overrides."""
    found = {}
    for key, scales in weights.items():
        if not key.endswith(".scales"):
            continue
        path = key[: -len(".scales")]
        in_dims = _input_dims(path, config)
        packed = weights[f"{path}.weight"].shape[-1]
        found[path] = {"group_size": in_dims // scales.shape[-1], "bits": packed * 32 // in_dims}
    if not found:
        return None
    common = Counter(tuple(q.items()) for q in found.values()).most_common(1)[0][0]
    block = {**dict(common), "mode": "affine"}
    for path, q in found.items():
        if tuple(q.items()) != common:
            block[path] = {**q, "mode": "affine"}
    return block


def _input_dims(path: str, config: dict[str, Any]) -> int:
    if path.endswith("down_proj"):
        return config["intermediate_size"]
    if path.endswith("o_proj"):
        return config["num_attention_heads"] * config["head_dim"]
    return config["hidden_size"]


def _build_tokenizer(meta: dict[str, Any]) -> Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` from the GGUF vocabulary."""
    kind = _value(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ConfigError(f"GGUF tokenizer {kind!r} is not supported; only byte-level BPE ('gpt2')")
    tokens = _value(meta, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _value(meta, "tokenizer.ggml.merges")]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = _pre_tokenizer(_value(meta, "tokenizer.ggml.pre", "gpt2"))
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(meta, tokens)
    types = _value(meta, "tokenizer.ggml.token_type", [])
    tokenizer.add_tokens(
        [
            AddedToken(tokens[i], special=t == _CONTROL, normalized=False)
            for i, t in enumerate(types)
            if t in (_CONTROL, _USER_DEFINED)
        ]
    )
    return tokenizer


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # SmolLM splits every digit on its own before the GPT-2 regex.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt2", "gpt-2", "default"):
        return byte_level
    raise ConfigError(f"GGUF pre-tokenizer {pre!r} is not supported (known: smollm, gpt2)")


def _post_processor(meta: dict[str, Any], tokens: list[str]) -> processors.PostProcessor:
    byte_level = processors.ByteLevel(trim_offsets=False)
    bos_id = _value(meta, "tokenizer.ggml.bos_token_id", None)
    if not _value(meta, "tokenizer.ggml.add_bos_token", False) or bos_id is None:
        return byte_level
    bos = tokens[bos_id]
    template = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)]
    )
    return processors.Sequence([byte_level, template])


def _write_tokenizer_files(
    out: Path, tokenizer: Tokenizer, meta: dict[str, Any], config: dict[str, Any]
) -> None:
    tokenizer.save(str(out / "tokenizer.json"))
    tokens = _value(meta, "tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        index = _value(meta, f"tokenizer.ggml.{key}_token_id", None)
        return tokens[index] if index is not None else None

    special = {
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "unk_token": token("unknown"),
        "pad_token": token("padding") or token("eos"),
    }
    special = {k: v for k, v in special.items() if v is not None}
    types = _value(meta, "tokenizer.ggml.token_type", [])
    controls = (tokens[i] for i, t in enumerate(types) if t == _CONTROL)
    extra = [t for t in controls if t not in special.values()]
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "additional_special_tokens": extra,
        "add_bos_token": bool(_value(meta, "tokenizer.ggml.add_bos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    template = _value(meta, "tokenizer.chat_template", None)
    if template:
        tokenizer_config["chat_template"] = template
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "special_tokens_map.json", {**special, "additional_special_tokens": extra})
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if config[k] is not None}
    _write_json(out / "generation_config.json", generation)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def publish_dir(tmp: Path, out_dir: Path) -> None:
    """Rename ``tmp`` to ``out_dir``, moving an older ``out_dir`` aside first.

    Between the two renames ``out_dir`` is briefly absent, never half-written.
    """
    old = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, old / out_dir.name)
    os.replace(tmp, out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
