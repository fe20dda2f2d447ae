"""models.yaml -> pydantic -> the engine's frozen LoadParams / EngineParams, with CLI overrides;
one entry type per role, and each default written once."""

from __future__ import annotations

from dataclasses import MISSING, fields
from pathlib import Path
from typing import get_args

import pytest
from pydantic import BaseModel, ValidationError

from app.config import schema
from app.config.loader import PARAM_FLAGS, SERVER_FLAGS, load_models_file, param_field, resolve
from app.config.schema import ROLE_ENTRIES, ChatEntry, ChatParams, EncoderParams, ModelsFile, VisionParams
from app.engine.params import EncoderLimits, EngineParams, LoadParams, SpeculativeParams, VisionSpec
from app.engine.types import SamplingParams
from app.errors import ConfigError
from app.specs import engine_params, load_params, model_spec

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
        ChatParams().mem = 5  # type: ignore[misc]
    p = engine_params(ChatParams(mem=300, max_num_seqs=4, prefill_batch_size=16))
    with pytest.raises(AttributeError):
        p.kv_mem_mb = 5  # type: ignore[misc]
    assert p.prefill_batch_size == 4  # never more than the batch
    line = p.to_log_string()
    for key in ("kv_mem_mb=300", "max_num_seqs=4", "prefill_chunk_size=", "prompt_cache_share=0.25",
                "prompt_cache_entries=256", "background_share="):
        assert key in line
    assert p.prompt_cache_bytes == 75 * 2**20  # a quarter of mem unless prompt_cache_mem says
    assert engine_params(ChatParams(mem=300, prompt_cache_mem=10)).prompt_cache_bytes == 10 * 2**20
    assert load_params(ChatParams(dtype="bfloat16", quantization="q4")).quantization == "q4"


def test_every_engine_knob_has_a_default_in_one_place():
    """The engine's params type holds every knob; a models.yaml entry maps onto it. A knob that
    models.yaml sets has its default on the schema only: the engine's field has none."""
    mapped = engine_params(ChatParams())
    internal = {f.name for f in fields(EngineParams) if f.default is not MISSING}
    assert internal == {"starvation_s", "prompt_cache_share", "prompt_cache_disk_queue_mb", "channel_max_pending"}
    assert mapped.prompt_cache_share == 0.25 and mapped.starvation_s == 5.0
    for params_type in (LoadParams, EncoderLimits, VisionSpec, SamplingParams, SpeculativeParams):
        assert all(f.default is MISSING for f in fields(params_type)), params_type
    # Renamed on the way: each engine field is a schema field, or says where it comes from.
    schema = set(ChatParams.model_fields)
    renamed = {"kv_mem_mb": "mem", "prompt_cache_mb": "prompt_cache_mem"}
    for f in fields(EngineParams):
        assert f.name in internal or renamed.get(f.name, f.name) in schema, f.name


@pytest.mark.parametrize(
    "yaml_text, key, allowed",
    [
        ("models:\n  - name: a\n    builtin: smollm2-135m-instruct\n    params: {dtyp: float16}\n",
         "models[0].params.dtyp", "unknown key"),
        ("models:\n  - name: a\n    builtin: smollm2-135m-instruct\n    params: {dtype: fp8}\n",
         "models[0].params.dtype", "'float16', 'bfloat16' or 'float32'"),
        ("models:\n  - name: a\n    builtin: smollm2-135m-instruct\n    capabilities: {vision_mode: maybe}\n",
         "models[0].capabilities.vision_mode", "'disabled', 'proxy' or 'native'"),
        ("models:\n  - name: a\n    builtin: smollm2-135m-instruct\n    params: {max_num_seqs: 0}\n",
         "models[0].params.max_num_seqs", "greater than or equal to 1"),
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
    assert ChatParams(kvcache_mem_gpu=300, kvcache_mem_cpu=100).kv_mem_mb == 400
    assert ChatParams(mem=50, kvcache_mem_gpu=300).kv_mem_mb == 50
    assert engine_params(ChatParams(kvcache_mem_gpu=300, kvcache_mem_cpu=100)).kv_mem_mb == 400


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



# ---- speculative decoding -------------------------------------------------------------------------

SPEC_YAML = """models:
  - name: big
    builtin: smollm2-135m-instruct
    params: {{speculative: {big}}}
  - name: small
    local_path: /tmp/small
    params: {{speculative: {small}}}
  - name: minilm
    role: embedding
    builtin: all-minilm-l6-v2
  - name: eyes
    local_path: /tmp/vlm
    capabilities: {{vision_mode: native}}
"""


def test_speculative_defaults_and_a_draft_map_onto_engine_params(tmp_path):
    mf = load_models_file(write(tmp_path, SPEC_YAML.format(big="{draft: small, tokens: 6, prompt_lookup: false}",
                                                          small="{}")))
    big = model_spec(mf.models[0], None)
    assert big.engine is not None and big.engine.speculative == SpeculativeParams(False, "small", 6)
    small = model_spec(mf.models[1], None)
    assert small.engine is not None and small.engine.speculative == SpeculativeParams(True, None, 4)
    assert "speculative=" in big.engine.to_log_string()


@pytest.mark.parametrize("big, small, why", [
    ("{draft: ghost}", "{}", "draft 'ghost' is not an entry (chat entries: small, eyes)"),
    ("{draft: big}", "{}", "a model cannot draft for itself"),
    ("{draft: minilm}", "{}", "draft 'minilm' has role embedding"),
    ("{draft: eyes}", "{}", "draft 'eyes' is a native VLM"),
    ("{draft: small}", "{draft: big}", "draft 'small' has a draft of its own ('big')"),
    ("{tokens: -1}", "{}", "greater than or equal to 0"),
    ("{tokens: 17}", "{}", "less than or equal to 16"),
    ("{tokens: 4, drafter: x}", "{}", "unknown key"),
])
def test_a_bad_draft_stops_start_up_naming_file_and_key(tmp_path, big, small, why):
    path = write(tmp_path, SPEC_YAML.format(big=big, small=small))
    with pytest.raises(ConfigError) as info:
        load_models_file(path)
    msg = info.value.message
    assert str(path) in msg and "models[0].params.speculative" in msg and why in msg, msg


def test_draft_model_flag_is_validated_like_the_file(tmp_path):
    mf = load_models_file(write(tmp_path, SPEC_YAML.format(big="{tokens: 3}", small="{}")))
    cfg = resolve(mf, model="big", overrides={"draft_model": "small"})
    assert cfg.primary.params.speculative.draft == "small"
    assert cfg.primary.params.speculative.tokens == 3  # the file's, kept beside the flag's
    assert resolve(mf, model="big", overrides={"speculative_tokens": 8}).primary.params.speculative.tokens == 8
    with pytest.raises(ConfigError, match="draft 'minilm' has role embedding"):
        resolve(mf, model="big", overrides={"draft_model": "minilm"})
    with pytest.raises(ConfigError, match="speculative.tokens"):
        resolve(mf, model="big", overrides={"speculative_tokens": 99})


# ---- one entry type per role ------------------------------------------------------------------------

EMBEDDING = "models:\n  - name: a\n    builtin: smollm2-135m-instruct\n  - name: minilm\n    role: embedding\n" \
            "    builtin: all-minilm-l6-v2\n"


def test_an_embedding_entry_with_temperature_fails_naming_entry_and_key(tmp_path):
    """The acceptance test: a key of another role is a start-up error, not ignored."""
    path = write(tmp_path, EMBEDDING + "    params: {max_inputs: 64, temperature: 0.5}\n")
    with pytest.raises(ConfigError) as info:
        load_models_file(path)
    msg = info.value.message
    assert str(path) in msg and "models[1].params.temperature" in msg
    assert "model 'minilm' has role embedding, which takes no 'temperature' (a key of chat entries)" in msg
    assert "embedding params: dtype, max_model_len, max_queue, queue_timeout_s, max_batch" in msg


@pytest.mark.parametrize(
    "entry, key, message",
    [
        ("  - name: v\n    role: vision\n    hf_id: x/y\n    params: {temperature: 0.0}\n",
         "models[1].params.temperature", "model 'v' has role vision, which takes no 'temperature' (a key of chat "
                                         "entries); vision params: dtype, max_model_len, quantization"),
        ("  - name: c\n    hf_id: x/y\n    params: {max_batch: 4}\n",
         "models[1].params.max_batch", "model 'c' has role chat, which takes no 'max_batch' "
                                       "(a key of embedding and rerank entries)"),
        ("  - name: r\n    role: rerank\n    hf_id: x/y\n    params: {max_pixels: 4096}\n",
         "models[1].params.max_pixels", "(a key of chat and vision entries); rerank params: dtype"),
        ("  - name: e\n    role: embedding\n    hf_id: x/y\n    capabilities: {tool_parser: qwen}\n",
         "models[1].capabilities", "model 'e' has role embedding, which takes no 'capabilities' (a key of chat "
                                   "entries); embedding keys: name, hf_id"),
        ("  - name: e\n    role: embedding\n    hf_id: x/y\n    params: {max_inputz: 3}\n",
         "models[1].params.max_inputz", "unknown key"),
        ("  - name: e\n    role: embeddings\n    hf_id: x/y\n",
         "models[1].role", "got 'embeddings'; allowed: 'chat', 'vision', 'embedding', 'rerank'"),
    ],
)
def test_keys_of_another_role_are_refused(tmp_path, entry, key, message):
    path = write(tmp_path, "models:\n  - name: a\n    builtin: smollm2-135m-instruct\n" + entry)
    with pytest.raises(ConfigError) as info:
        load_models_file(path)
    assert f"{key}: " in info.value.message and message in info.value.message


def test_each_role_gets_its_own_entry_and_params_type(tmp_path):
    mf = load_models_file(write(tmp_path, EMBEDDING + "    params: {max_inputs: 64, dtype: float16}\n"))
    chat, minilm = mf.models
    assert isinstance(chat, ChatEntry) and chat.role == "chat"  # no role: chat
    assert isinstance(minilm, ROLE_ENTRIES["embedding"]) and isinstance(minilm.params, EncoderParams)
    spec = model_spec(minilm, None)
    assert spec.encoder is not None and spec.encoder.dtype == "float16" and spec.encoder.limits.max_inputs == 64
    assert spec.engine is None and spec.load is None and spec.kv_budget_bytes == 0
    assert (spec.max_queue, spec.queue_timeout_s) == (64, 120.0)
    assert model_spec(chat, None).encoder is None
    # One table of roles: the union models.yaml is validated with is its rows, each keyed on its role.
    union = get_args(schema.ModelsFile.model_fields["models"].annotation)[0]
    assert [get_args(m)[0] for m in get_args(get_args(union)[0])] == list(schema.ROLE_ENTRIES.values())
    for role, entry_type in schema.ROLE_ENTRIES.items():
        assert get_args(entry_type.model_fields["role"].annotation) == (role,)
        assert entry_type.__name__ == f"{role.capitalize()}Entry" and entry_type.__doc__


# ---- each default once; descriptions for the generated docs and CLI --------------------------------


def _schema_models() -> list[type[BaseModel]]:
    named = [v for v in vars(schema).values() if isinstance(v, type) and issubclass(v, BaseModel)
             and v.__module__ == schema.__name__]
    return named + [e for e in schema.ROLE_ENTRIES.values() if e not in named]  # the generated entries


def test_every_config_field_has_a_description():
    """The docs' reference tables and the CLI's help are generated from these."""
    names = {m.__name__ for m in _schema_models()}
    assert {"ChatParams", "VisionParams", "EncoderParams", "ModelCapabilities", "VisionProxyConfig",
            "ModelEntryBase", "ChatEntry", "VisionEntry", "EmbeddingEntry", "RerankEntry", "ServerSettings",
            "ModelsFile"} <= names
    for model in _schema_models():
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name}"


def test_sampling_defaults_are_the_schemas():
    """SamplingParams has no defaults of its own: every model-level knob comes from ChatParams."""
    per_request = {"seed", "logit_bias"}
    assert {f.name for f in fields(SamplingParams)} - per_request <= set(ChatParams.model_fields)
    assert ChatParams().temperature == 0.7


def test_cli_flags_are_generated_from_the_fields():
    from app.cli import build_parser

    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    actions = {a.dest: a for a in serve._actions}
    for flag, key in [*PARAM_FLAGS.items(), *((f, f) for f in SERVER_FLAGS)]:
        field = param_field(key) if flag in PARAM_FLAGS else schema.ServerSettings.model_fields[key]
        assert actions[flag].help.startswith(field.description.replace("%", "%%")), flag
        assert actions[flag].default is None
    assert actions["dtype"].choices == list(get_args(schema.Dtype))
    assert actions["isq"].choices == ["q4", "q8"] and actions["kv_cache_bits"].choices == [4, 8]
    assert actions["kv_cache_bits"].type is int and actions["mem"].type is int
    assert actions["temperature"].type is float and actions["port"].type is int
    args = build_parser().parse_args(["serve", "--isq", "q4", "--kv-cache-bits", "8", "--temperature", "0.2"])
    assert (args.isq, args.kv_cache_bits, args.temperature, args.mem) == ("q4", 8, 0.2, None)
    # A nested model's keys are flags too: params.speculative.draft is --draft-model.
    args = build_parser().parse_args(["serve", "--draft-model", "small", "--speculative-tokens", "2"])
    assert (args.draft_model, args.speculative_tokens) == ("small", 2)


def test_vision_params_are_its_engines_keys_without_sampling_or_prefix_cache():
    """A captioning VLM runs a VLM engine: loading, KV memory, batching, queueing and image bounds;
    captions are greedy and never continued, so no sampling and no prefix-cache keys."""
    fields = set(VisionParams.model_fields)
    assert {"max_pixels", "min_pixels", "max_images_per_request", "mem", "max_num_seqs", "dtype"} <= fields
    assert not fields & {"temperature", "top_p", "max_tokens", "prompt_cache", "background_share"}
    assert fields <= set(ChatParams.model_fields)
    assert VisionParams.model_fields["max_pixels"].default == ChatParams.model_fields["max_pixels"].default
    assert VisionParams().mem < ChatParams().mem  # a caption needs less KV than a conversation
    assert ModelsFile.model_fields["models"].description
