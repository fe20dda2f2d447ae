"""Contracts of the private mlx-vlm APIs in ``app/engine/mlx_internals.py`` (the signatures of
every fenced name are in ``test_mlx_fence.py``).

Each test checks one behaviour Tandem relies on, on the tiny random Qwen2-VL,
and its name says which, so an mlx-vlm upgrade that breaks one fails here by
name instead of somewhere deep in the engine.
"""

from __future__ import annotations

from io import BytesIO

import mlx.core as mx
import pytest
from PIL import Image

from app.engine import mlx_internals as mi
from tests.fixtures.tiny_vlm import build_tiny_qwen2_vl
from tests.vision.sample_images import striped_bytes


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from mlx_vlm import apply_chat_template, load

    model, processor = load(str(build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"))))

    def prompt(images: int) -> str:
        content = [{"type": "image"}] * images + [{"type": "text", "text": "Describe"}]
        return str(apply_chat_template(processor, model.config, [{"role": "user", "content": content}],
                                       num_images=images))

    return model, processor, prompt


def image(seed: int) -> Image.Image:
    return Image.open(BytesIO(striped_bytes(seed))).convert("RGB")


def test_vlm_prompt_inputs_expands_each_placeholder(vlm):
    model, processor, prompt = vlm
    inputs = mi.vlm_prompt_inputs(model, processor, prompt(2), [image(1), image(2)])
    ids = inputs["input_ids"]
    assert ids.shape[0] == 1 and "pixel_values" in inputs
    grid = inputs["image_grid_thw"].tolist()
    merged = sum(t * h * w for t, h, w in grid) // 4  # 2x2 patches per token
    assert ids[0].tolist().count(model.config.image_token_id) == merged


def test_vlm_input_embeddings_gives_embeds_and_positions(vlm):
    model, processor, prompt = vlm
    inputs = mi.vlm_prompt_inputs(model, processor, prompt(1), [image(1)])
    kw = mi.vlm_embedding_features(model, inputs)
    assert kw["inputs_embeds"].shape == (1, inputs["input_ids"].shape[1], model.config.text_config.hidden_size)
    assert "position_ids" in kw and "rope_deltas" in kw  # Qwen2-VL's M-RoPE extras
    text_only = mi.vlm_embedding_features(model, {"input_ids": mx.array([[1, 2, 3]])})
    assert text_only["inputs_embeds"].shape[:2] == (1, 3)


def test_vlm_vision_tower_gives_each_image_its_own_rows(vlm):
    """One row per image token, image after image; an image encoded alone gives the rows
    it has among others (the vision-feature cache encodes and keeps images one by one)."""
    model, processor, prompt = vlm
    inputs = mi.vlm_prompt_inputs(model, processor, prompt(2), [image(1), Image.new("RGB", (60, 120), "red")])
    rows = mi.vlm_feature_rows(model, inputs)
    grid = inputs["image_grid_thw"]
    assert rows is not None and len(rows) == 2 and rows[1][0] == rows[0][1]
    both = mi.vlm_encode_images(model, inputs["pixel_values"], grid)
    tokens = [n // 4 for _, n in rows]  # 2x2 patches per token
    assert both.shape == (sum(tokens), model.config.text_config.hidden_size)
    for i, (start, n) in enumerate(rows):
        alone = mi.vlm_encode_images(model, inputs["pixel_values"][start:start + n], grid[i:i + 1])
        at = sum(tokens[:i])
        assert mx.allclose(alone, both[at:at + tokens[i]], atol=1e-5).item()
    assert mi.vlm_feature_rows(model, {"input_ids": inputs["input_ids"]}) is None


def test_vlm_cached_image_features_merge_in_place_of_the_tower(vlm):
    model, processor, prompt = vlm
    inputs = mi.vlm_prompt_inputs(model, processor, prompt(1), [image(1)])
    ran = mi.vlm_embedding_features(model, inputs)
    features = mi.vlm_encode_images(model, inputs["pixel_values"], inputs["image_grid_thw"])
    given = mi.vlm_embedding_features(model, inputs, features)
    assert mx.array_equal(given["inputs_embeds"], ran["inputs_embeds"]).item()
    assert mx.array_equal(given["position_ids"], ran["position_ids"]).item()
    # Other features in: they are what is merged (the tower did not run).
    other = mi.vlm_embedding_features(model, inputs, features * 0)
    assert not mx.array_equal(other["inputs_embeds"], ran["inputs_embeds"]).item()


def test_vlm_embedding_features_are_the_fields_the_step_feeds(vlm):
    """``get_input_embeddings`` gives an image prompt its embeddings and M-RoPE positions,
    and a text-only prompt (no pixels) its token indices as positions, deltas 0."""
    model, processor, prompt = vlm
    inputs = mi.vlm_prompt_inputs(model, processor, prompt(1), [image(1)])
    features = mi.vlm_embedding_features(model, inputs)
    length = inputs["input_ids"].shape[1]
    assert set(features) == {"inputs_embeds", "position_ids", "rope_deltas"}
    assert features["position_ids"].shape == (3, 1, length) and features["rope_deltas"].shape == (1, 1)
    text = mi.vlm_embedding_features(model, {"input_ids": mx.array([[5, 6, 7]])})
    assert text["position_ids"].tolist() == [[0, 1, 2]] and text["rope_deltas"].tolist() == [[0]]
    embeds = mi.vlm_text_embeddings(model, mx.array([[5, 6, 7]]))
    assert mx.array_equal(embeds, text["inputs_embeds"]).item()


def test_vlm_language_model_takes_embeddings_and_explicit_positions(vlm):
    """The language model given its own text embeddings computes what it computes from the
    ids; it places tokens where explicit ``position_ids`` say (and nowhere else), in a batch
    cache of mlx-lm's classes (``vlm_make_cache``); it returns ``LanguageModelOutput.logits``."""
    model, _, _ = vlm
    ids = mx.array([[5, 6, 7, 8], [9, 10, 11, 12]])

    def logits(**features):
        from app.engine.step.phase import merge

        cache = merge([mi.vlm_make_cache(model) for _ in range(2)])
        return mi.vlm_forward(model, ids, cache, **features)

    plain = logits()
    assert plain.shape[:2] == (2, 4)
    assert mx.allclose(logits(inputs_embeds=mi.vlm_text_embeddings(model, ids)), plain, atol=1e-5).item()
    at = mx.broadcast_to(mx.arange(4)[None, None], (3, 2, 4))
    assert mx.allclose(logits(position_ids=at), plain, atol=1e-5).item()
    gap = at + mx.array([0, 0, 0, 7])  # RoPE is relative: only a change of distances shows
    assert not mx.allclose(logits(position_ids=gap)[:, 3], plain[:, 3], atol=1e-3).item()


def test_vlm_make_cache_gives_mlx_lm_caches_of_each_kind():
    """mlx-vlm's cache classes (a language model's ``make_cache()``) as mlx-lm's, kind by kind."""
    from types import SimpleNamespace

    from mlx_lm.models import cache as lc
    from mlx_vlm.models import cache as vc

    from app.errors import ConfigError

    def made(*layers):
        return mi.vlm_make_cache(SimpleNamespace(language_model=SimpleNamespace(make_cache=lambda: list(layers))))

    kv, window, state, chunked, both = made(vc.KVCache(), vc.RotatingKVCache(max_size=8, keep=2), vc.ArraysCache(3),
                                            vc.ChunkedKVCache(16), vc.CacheList(vc.KVCache(), vc.ArraysCache(1)))
    assert type(kv) is lc.KVCache and type(window) is lc.RotatingKVCache and type(chunked) is lc.ChunkedKVCache
    assert (window.max_size, window.keep, chunked.chunk_size, len(state.cache)) == (8, 2, 16, 3)
    assert type(state) is lc.ArraysCache and isinstance(both, lc.CacheList)
    assert [type(c) for c in both.caches] == [lc.KVCache, lc.ArraysCache]
    with pytest.raises(ConfigError, match="SimpleKVCache"):
        made(vc.SimpleKVCache())
    no_own = SimpleNamespace(language_model=SimpleNamespace(layers=[1, 2]))
    assert [type(c) for c in mi.vlm_make_cache(no_own)] == [lc.KVCache, lc.KVCache]


def test_vlm_stop_tokens_are_where_generate_stops(vlm):
    """The config's EOS ids, and the processor's stopping criteria's, once reset as generate does."""
    model, processor, _ = vlm
    eos = model.config.eos_token_id
    stops = mi.vlm_stop_tokens(processor, model)
    assert set(stops) >= set(eos if isinstance(eos, list) else [eos])
    assert stops == list(processor.tokenizer.stopping_criteria.eos_token_ids)


def test_vlm_text_config_has_the_kv_geometry(vlm):
    config = mi.vlm_text_config(vlm[0])
    assert {"num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
            "max_position_embeddings", "vocab_size"} <= set(config)


def test_vlm_image_limit(vlm):
    assert mi.vlm_image_limit(vlm[0]) is None  # Qwen2-VL takes several images


def test_new_vlm_detokenizer_is_private_per_sequence(vlm):
    _, processor, _ = vlm
    ids = processor.tokenizer.encode("a red square", add_special_tokens=False)
    one, two = mi.new_vlm_detokenizer(processor), mi.new_vlm_detokenizer(processor)
    for t in ids:
        one.add_token(t)
    one.finalize()
    two.add_token(ids[0])
    assert one.text == "a red square" and two.text != one.text


def test_a_continuation_keeps_its_leading_space(demo_model_dir):
    """mlx-lm's BPE detokenizer drops the first token's leading space; new_detokenizer keeps it."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer
    from mlx_lm.utils import load_tokenizer

    from app.engine.mlx_internals import new_detokenizer

    tokenizer = load_tokenizer(demo_model_dir)
    assert isinstance(tokenizer.detokenizer, BPEStreamingDetokenizer)
    ids = tokenizer.encode(" Paris is lovely", add_special_tokens=False)
    detok = new_detokenizer(tokenizer)
    pieces = []
    for token in ids:
        detok.add_token(token)
        pieces.append(detok.last_segment)
    detok.finalize()
    pieces.append(detok.last_segment)
    assert "".join(pieces) == " Paris is lovely"


def test_reset_vlm_stopping_restores_the_eos(vlm):
    """``processor.tokenizer.stopping_criteria.reset(eos)``: what ``mlx_vlm.generate`` does
    before each generation and ``reset_vlm_stopping`` does for ours."""
    model, processor, _ = vlm
    criteria = processor.tokenizer.stopping_criteria
    eos = model.config.eos_token_id
    criteria.eos_token_ids = [123456]
    mi.reset_vlm_stopping(processor, model)
    assert set(criteria.eos_token_ids) >= set(eos if isinstance(eos, list) else [eos])
    assert 123456 not in criteria.eos_token_ids


def test_vlm_clean_output_uses_the_processors_own(vlm):
    """``processor.clean_output(text)`` when the model's processor defines one (GLM-4V strips
    its box markers), the text unchanged when it does not (Qwen2-VL)."""
    from mlx_vlm.models.glm4v.processing import _BOX_TOKENS, Glm46VProcessor

    assert mi.vlm_clean_output(vlm[1], "a <b> c") == "a <b> c"
    glm = object.__new__(Glm46VProcessor)  # only its clean_output is used
    assert mi.vlm_clean_output(glm, f"x{_BOX_TOKENS[0]}y") == "xy"
