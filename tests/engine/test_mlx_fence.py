"""Contracts of every name behind the private-API fence (``app/engine/mlx_internals.py``).

The fence's docstring lists each private or undocumented name of mlx-lm, mlx-vlm and
mlx-embeddings that Tandem uses. Here each has a contract: that it exists, with the
parameters we pass and the attributes we read (``test_contract[<name>]``), or, for the
members of a loaded VLM, a behaviour test on the tiny Qwen2-VL in
``test_mlx_internals.py``. A test parses the list, so a name cannot be added without its
contract; an upgrade that breaks one fails here by name.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest

from app.engine import mlx_internals
from tests.engine import test_mlx_internals, test_mlx_lm_internals

# name -> (parameters we pass, attributes we read on the class or a fresh instance)
Contract = tuple[frozenset[str], frozenset[str]]


def _c(params: str = "", attrs: str = "") -> Contract:
    return frozenset(params.split()), frozenset(attrs.split())


CONTRACTS: dict[str, Contract] = {
    "mlx_lm.models.cache.TokenBuffer": _c("tokens", "update_and_fetch"),
    "mlx_lm.models.cache.trim_prompt_cache": _c("cache num_tokens"),
    "mlx_lm.models.cache.make_prompt_cache": _c("model"),
    "mlx_lm.models.cache.KVCache": _c(attrs="keys values offset step merge trim nbytes"),
    "mlx_lm.models.cache.QuantizedKVCache": _c("group_size bits", "keys values offset step trim nbytes"),
    "mlx_lm.models.cache.RotatingKVCache": _c("max_size keep", "keys values offset max_size keep _idx merge"),
    "mlx_lm.models.cache.ArraysCache": _c(
        "size left_padding", "cache left_padding lengths merge extend filter extract prepare finalize make_mask"),
    "mlx_lm.models.cache.CacheList": _c("caches", "caches merge extend filter extract prepare finalize"),
    "mlx_lm.models.cache._BaseCache": _c(),
    "mlx_lm.models.cache.BatchKVCache": _c(
        "left_padding", "merge extract filter extend prepare finalize make_mask trim state nbytes"),
    "mlx_lm.models.cache.BatchRotatingKVCache": _c(
        "max_size left_padding", "merge extract filter extend prepare finalize make_mask trim state nbytes"),
    "mlx_lm.models.cache.dynamic_roll": _c("x shifts axis"),
    "mlx_lm.models.base.create_causal_mask": _c("N offset left_padding"),
    "mlx_lm.utils.sharded_load": _c("repo pipeline_group tensor_group return_config"),
    "mlx_lm.utils._get_classes": _c("config"),
    "mlx_lm.tokenizer_utils.TokenizerWrapper": _c(attrs="detokenizer eos_token_ids has_thinking think_start think_end"),
    "mlx_lm.tokenizer_utils.SPMStreamingDetokenizer": _c("tokenizer trim_space"),
    "mlx_lm.tokenizer_utils.BPEStreamingDetokenizer": _c("tokenizer"),
    "mlx_vlm.prepare_inputs": _c("processor images prompts image_token_index add_special_tokens"),
    "mlx_vlm.models.cache.KVCache": _c(attrs="keys values offset extract"),
    "mlx_vlm.utils.should_add_special_tokens": _c("model_type processor"),
    "mlx_vlm.prompt_utils.SINGLE_IMAGE_ONLY_MODELS": _c(attrs="__contains__"),
    "mlx_vlm.tokenizer_utils.make_streaming_detokenizer": _c("processor"),
    "mlx_embeddings.utils.load_model": _c("model_path model_config"),
}

# Members of a loaded VLM: their contracts are behaviour tests on the tiny Qwen2-VL.
M = test_mlx_internals
BEHAVIOUR = {
    "mlx_lm.models.cache.BatchKVCache._idx": (
        test_mlx_lm_internals, "test_contract_batch_kv_rolls_back_to_what_each_row_kept"),
    "<vlm processor>.tokenizer.stopping_criteria.reset": (M, "test_reset_vlm_stopping_restores_the_eos"),
    "<vlm processor>.clean_output": (M, "test_vlm_clean_output_uses_the_processors_own"),
    "<vlm processor>.tokenizer.stopping_criteria.eos_token_ids": (M, "test_vlm_stop_tokens_are_where_generate_stops"),
    "<vlm model>.get_input_embeddings": (M, "test_vlm_input_embeddings_gives_embeds_and_positions"),
    "<vlm model>.get_input_embeddings.cached_image_features": (
        M, "test_vlm_cached_image_features_merge_in_place_of_the_tower"),
    "<vlm model>.vision_tower": (M, "test_vlm_vision_tower_gives_each_image_its_own_rows"),
    "<vlm model>.language_model": (M, "test_vlm_language_model_takes_embeddings_and_explicit_positions"),
    "<vlm model>.config.text_config": (M, "test_vlm_text_config_has_the_kv_geometry"),
    "<vlm model>.language_model.__call__": (M, "test_vlm_language_model_takes_embeddings_and_explicit_positions"),
    "<vlm model>.language_model.make_cache": (M, "test_vlm_make_cache_gives_mlx_lm_caches_of_each_kind"),
    "mlx_vlm.models.base.InputEmbeddingsFeatures": (M, "test_vlm_embedding_features_are_the_fields_the_step_feeds"),
    "mlx_vlm.models.base.LanguageModelOutput.logits": (
        M, "test_vlm_language_model_takes_embeddings_and_explicit_positions"),
    "mlx_vlm.models.cache.RotatingKVCache": (M, "test_vlm_make_cache_gives_mlx_lm_caches_of_each_kind"),
    "mlx_vlm.models.cache.ArraysCache": (M, "test_vlm_make_cache_gives_mlx_lm_caches_of_each_kind"),
    "mlx_vlm.models.cache.ChunkedKVCache": (M, "test_vlm_make_cache_gives_mlx_lm_caches_of_each_kind"),
    "mlx_vlm.models.cache.CacheList": (M, "test_vlm_make_cache_gives_mlx_lm_caches_of_each_kind"),
}
# Behaviours of the names above that a signature cannot show, checked on real models.
BEHAVIOUR_TOO = [
    (test_mlx_lm_internals, "test_contract_every_kv_cache_grows_in_steps_of_kv_step"),
    (test_mlx_lm_internals, "test_contract_batch_caches_are_rectangles_as_wide_as_the_widest_row"),
    (test_mlx_lm_internals, "test_contract_every_batch_kind_snapshots_and_restores_by_its_fields"),
    (test_mlx_lm_internals, "test_contract_arrays_cache_batches_rows_and_masks_padding"),
    (test_mlx_lm_internals, "test_contract_rotating_rows_merge_extract_and_restore_exactly"),
    (test_mlx_internals, "test_a_continuation_keeps_its_leading_space"),
    (test_mlx_internals, "test_new_vlm_detokenizer_is_private_per_sequence"),
]


def fenced_names() -> list[str]:
    """The names the fence's docstring lists under "Fenced names"."""
    doc = mlx_internals.__doc__ or ""
    block = doc[doc.index("Fenced names"):].split("\n\n")[1]
    return [line.strip() for line in block.splitlines() if line.strip()]


def resolve(name: str) -> Any:
    """The object an import path names: the longest importable module, then attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


def test_every_fenced_name_has_a_contract_test():
    names = fenced_names()
    assert len(names) == len(set(names)) and len(names) > 30
    missing = [n for n in names if n not in CONTRACTS and n not in BEHAVIOUR]
    assert not missing, f"fenced names without a contract test: {missing}"
    stale = [n for n in [*CONTRACTS, *BEHAVIOUR] if n not in names]
    assert not stale, f"contracts for names the fence no longer lists: {stale}"
    for module, test in [*BEHAVIOUR.values(), *BEHAVIOUR_TOO]:
        assert callable(getattr(module, test, None)), f"{module.__name__}.{test} is gone"


@pytest.mark.parametrize("name", sorted(CONTRACTS))
def test_contract(name):
    """``name`` exists, takes the parameters we pass and has the attributes we read."""
    obj = resolve(name)
    params, attrs = CONTRACTS[name]
    if params:
        signature = inspect.signature(obj.__init__ if inspect.isclass(obj) else obj)
        takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
        absent = params - set(signature.parameters)
        assert not absent or takes_kwargs, f"{name} no longer takes {sorted(absent)}"
    if attrs:
        instance = None
        if inspect.isclass(obj) and name.endswith(("KVCache", "ArraysCache", "CacheList")) and "Batch" not in name:
            instance = {"RotatingKVCache": lambda: obj(8), "ArraysCache": lambda: obj(2)}.get(
                name.rsplit(".", 1)[1], obj)()  # fields set in __init__
        lacking = [a for a in attrs if not hasattr(obj, a) and not hasattr(instance, a)]
        assert not lacking, f"{name} has no {lacking}"
