"""What can be split over how many ranks: refused at start-up with the numbers, before any weight is read."""

from __future__ import annotations

import pytest

from app.config.schema import ChatParams
from app.engine.distributed.sharding import check_params, check_splittable
from app.errors import ConfigError
from app.specs import load_params
from tests.fixtures.tiny_ministral import _config as ministral_config

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 1000}
# The embedded demo model's heads (SmolLM2-135M).
SMOLLM2 = {**LLAMA, "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}
MINISTRAL3 = {**ministral_config(1000, 64, 2)["text_config"], "num_hidden_layers": 3}


def refusal(config: dict, world_size: int, mode: str = "tensor") -> str:
    with pytest.raises(ConfigError) as err:
        check_splittable("m", config, world_size, mode)
    return err.value.message


@pytest.mark.parametrize(("config", "world_size", "mode"), [
    (LLAMA, 2, "tensor"), (SMOLLM2, 3, "tensor"), (MINISTRAL3, 2, "tensor"), (MINISTRAL3, 3, "pipeline"),
])
def test_what_splits(config, world_size, mode):
    check_splittable("m", config, world_size, mode)


def test_heads_that_do_not_divide_are_refused_with_the_numbers():
    assert refusal(SMOLLM2, 2) == ("model 'm' has 9 attention heads and 3 KV heads; tensor parallel over 2 ranks "
                                   "needs both divisible by 2; use a world size that divides them")
    assert "has 4 attention heads and 2 KV heads; tensor parallel over 4 ranks" in refusal(LLAMA, 4)


def test_pipeline_is_offered_only_where_mlx_lm_has_it():
    odd = {**MINISTRAL3, "num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 16}
    assert "use params.distributed: pipeline or a world size that divides them" in refusal(odd, 2)
    assert "cannot be split by layers in mlx-lm: use params.distributed: tensor" in refusal(LLAMA, 2, "pipeline")
    assert "has 3 layers; pipeline parallel over 4 ranks needs at least one layer per rank" in \
        refusal(MINISTRAL3, 4, "pipeline")


def test_an_mlp_that_does_not_divide_is_refused():
    assert "has an MLP of 130 units; tensor parallel over 4 ranks" in \
        refusal({**LLAMA, "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 130}, 4)


def test_a_model_type_mlx_lm_cannot_split_is_refused():
    # Ministral 3 as its checkpoints ship it (mistral3 around ministral3): sharded_load splits neither.
    assert "(model_type mistral3) has no tensor parallel split in mlx-lm; it cannot be served distributed" in \
        refusal(ministral_config(1000, 64, 2), 2)


def test_load_time_quantization_is_refused():
    check_params("m", load_params(ChatParams(kv_cache_bits=8)))
    with pytest.raises(ConfigError, match="serve a quantized checkpoint instead"):
        check_params("m", load_params(ChatParams(quantization="q4")))
