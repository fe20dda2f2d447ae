"""llama.cpp's real templates and parser cases, served by Tandem.

The corpus (``llama_cpp.fetch``: the llama-cpp-python 0.3.36 sdist, its sha256
checked) is fetched once into a cache; nothing of it is in this repository.
Every case of ``test-chat.cpp`` is prepared through the pipeline with its
template as the model's (``corpus``), and its text parsed:

- at least 95% of the cases that are not a documented deliberate difference
  parse as llama.cpp expects, and every case of the families the issue names;
- detection picks the right family for every template, with no ``tool_parser:``
  and a model name that says nothing;
- every case reads the same fed whole or a character at a time;
- each deliberate difference is in the docs' table.
"""

from __future__ import annotations

import collections
from pathlib import Path
from typing import Any

import pytest

from tests.families import corpus
from tests.families.cpp_cases import Case, read_cases

DOCS = Path(__file__).resolve().parents[2] / "docs" / "guides" / "tool-calls.md"
# A model name that says nothing: detection reads the template alone.
NAME = "model"

# The right family of each template: what its model writes, as llama.cpp's tests say.
EXPECTED_FAMILY = {
    "Apertus-8B-Instruct": "apertus", "Apriel-1.6-15b-Thinker-fixed": "apriel", "unsloth-Apriel-1.5": "apriel",
    "Bielik-11B-v3.0-Instruct": "qwen", "ByteDance-Seed-OSS": "seed_oss", "Cohere2MoE": "cohere",
    "CohereForAI-c4ai-command-r-plus-tool_use": "cohere", "CohereForAI-c4ai-command-r7b-12-2024-tool_use": "cohere",
    "GLM-4.6": "glm", "GLM-4.7-Flash": "glm", "Spark2.5": "glm", "inclusionai-ling-3.0-flash": "glm",
    "poolside-Laguna-S-2.1": "glm", "poolside-Laguna-XS-2.1": "glm", "poolside-Laguna-XS.2": "glm",
    "GigaChat3-10B-A1.8B": "gigachat", "GigaChat3.1-10B-A1.8B": "gigachat",
    "HuggingFaceTB-SmolLM3-3B": "generic", "google-gemma-2-2b-it": "generic",
    "microsoft-Phi-3.5-mini-instruct": "generic", "llama-cpp-rwkv-world": "generic",
    "Kimi-K2-Instruct": "kimi", "Kimi-K2-Thinking": "kimi", "moonshotai-Kimi-K2": "kimi", "Kimi-K3": "kimi_k3",
    "LFM2-8B-A1B": "lfm2", "LFM2.5-8B-A1B": "lfm2", "LFM2.5-Instruct": "lfm2",
    "MiMo-VL": "qwen", "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": "qwen",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "qwen", "Qwen-QwQ-32B": "qwen", "Qwen-Qwen2.5-7B-Instruct": "qwen",
    "Qwen-Qwen3-0.6B": "qwen", "Reka-Edge": "qwen", "ibm-granite-granite-4.0": "qwen",
    "ibm-granite-granite-4.1": "qwen",
    "ibm-granite-granite-3.3-2B-Instruct": "granite",
    "MiniMax-M1": "minimax_m1", "MiniMax-M2": "minimax", "MiniMax-M3": "minimax_m3",
    "Mistral-Small-3.2-24B-Instruct-2506": "mistral", "mistralai-Ministral-3-14B-Reasoning-2512": "mistral",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral", "unsloth-mistral-Devstral-Small-2507": "mistral",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": "qwen3_coder", "Qwen3-Coder": "qwen3_coder", "Qwen3.5-4B": "qwen3_coder",
    "StepFun3.5-Flash": "qwen3_coder", "NVIDIA-Nemotron-Nano-v2": "nemotron", "openbmb-MiniCPM5-1B": "minicpm",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": "deepseek_r1",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "deepseek_r1",
    "llama-cpp-deepseek-r1": "deepseek_r1", "deepseek-ai-DeepSeek-V3.1": "deepseek_v3",
    "deepseek-ai-DeepSeek-V3.2": "deepseek_dsml", "deepseek-ai-DeepSeek-V4": "deepseek_dsml",
    "deepseek-ai-DeepSeek-V4-Flash-0731": "deepseek_dsml",
    "fireworks-ai-llama-3-firefunction-v2": "firefunction", "google-gemma-4-31B-it": "gemma4",
    "google-gemma-4-31B-it-interleaved": "gemma4", "meetkai-functionary-medium-v3.1": "functionary",
    "meetkai-functionary-medium-v3.2": "functionary", "meta-llama-Llama-3.1-8B-Instruct": "llama",
    "meta-llama-Llama-3.2-3B-Instruct": "llama", "meta-llama-Llama-3.3-70B-Instruct": "llama",
    "openai-gpt-oss-120b": "gpt_oss", "tencent-Hy3": "hunyuan", "upstage-Solar-Open-100B": "solar",
    "muse-glimmer": "muse",
}
# The families issue 28 names, by their templates: each must pass every case.
NAMED = {
    "XML parameters": ["Qwen3.5-4B", "Qwen3-Coder", "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", "ByteDance-Seed-OSS",
                       "StepFun3.5-Flash", "openbmb-MiniCPM5-1B"],
    "arg_key / arg_value": ["GLM-4.6", "GLM-4.7-Flash", "inclusionai-ling-3.0-flash", "Spark2.5"],
    "invoke / parameter": ["MiniMax-M2", "MiniMax-M3", "deepseek-ai-DeepSeek-V3.2", "deepseek-ai-DeepSeek-V4",
                           "deepseek-ai-DeepSeek-V4-Flash-0731"],
    "Python calls": ["LFM2-8B-A1B", "LFM2.5-8B-A1B", "LFM2.5-Instruct"],
    "special-token sections": ["deepseek-ai-DeepSeek-V3.1", "deepseek-ai-DeepSeek-R1-Distill-Llama-8B",
                               "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B", "llama-cpp-deepseek-r1",
                               "Kimi-K2-Instruct", "Kimi-K2-Thinking", "moonshotai-Kimi-K2", "Kimi-K3"],
    "Harmony": ["openai-gpt-oss-120b"],
    "Gemma 4": ["google-gemma-4-31B-it"],
    "Cohere": ["CohereForAI-c4ai-command-r-plus-tool_use", "CohereForAI-c4ai-command-r7b-12-2024-tool_use",
               "Cohere2MoE"],
    "Nemotron Nano v2": ["NVIDIA-Nemotron-Nano-v2"],
    "Functionary v3.2": ["meetkai-functionary-medium-v3.2"],
    "GigaChat": ["GigaChat3-10B-A1.8B", "GigaChat3.1-10B-A1.8B"],
    "Apertus": ["Apertus-8B-Instruct"],
}
PASS_RATE = 0.95


@pytest.fixture(scope="module")
def root(corpus_root: Path) -> Path:
    return corpus_root


@pytest.fixture(scope="module")
def tokenizer(corpus_tokenizer: Any) -> Any:
    return corpus_tokenizer


@pytest.fixture(scope="module")
def cases(root: Path) -> list[Case]:
    found = read_cases((root / "test-chat.cpp").read_text(encoding="utf-8"))
    assert len(found.cases) > 400, "test-chat.cpp's cases were not read"
    return found.cases


@pytest.fixture(scope="module")
def served(root: Path, tokenizer: Any, cases: list[Case]) -> dict[str, tuple[str, list[corpus.Outcome]]]:
    """Each template's detected family and its cases' outcomes (a template at a time: the
    tokenizer carries the template being served)."""
    by_template: dict[str, list[Case]] = collections.defaultdict(list)
    for case in cases:
        by_template[case.template].append(case)
    out = {}
    for template, its in by_template.items():
        profile = corpus.profile_for(tokenizer, corpus.template_text(root, template), NAME)
        split = [corpus.split_alike(profile, case) for case in its]
        out[template.removesuffix(".jinja")] = (profile.parser, [corpus.run_case(profile, c) for c in its], split)
    return out


def _report(outcomes: list[corpus.Outcome]) -> str:
    return "\n".join(f"{o.case.id} [{o.family}]\n  text: {o.case.input[:200]!r}\n  got:  {o.got}\n  want: {o.want}"
                     for o in outcomes)


def test_the_cases_parse_as_llama_cpp_expects(served: dict[str, Any]) -> None:
    counted = [o for _, outcomes, _ in served.values() for o in outcomes if o.difference is None]
    failed = [o for o in counted if not o.passed]
    rate = 1 - len(failed) / len(counted)
    assert rate >= PASS_RATE, f"{rate:.1%} of {len(counted)} cases pass\n{_report(failed)}"


@pytest.mark.parametrize("shape", sorted(NAMED))
def test_every_case_of_the_named_families_passes(served: dict[str, Any], shape: str) -> None:
    outcomes = [o for template in NAMED[shape] for o in served[template][1] if o.difference is None]
    assert outcomes and all(o.passed for o in outcomes), _report([o for o in outcomes if not o.passed])


def test_detection_picks_each_templates_family(root: Path, tokenizer: Any) -> None:
    names = sorted(p.stem for p in (root / "templates").glob("*.jinja"))
    got = {n: corpus.profile_for(tokenizer, corpus.template_text(root, f"{n}.jinja"), NAME).parser for n in names}
    assert got == {n: EXPECTED_FAMILY.get(n, "?") for n in names}


def test_every_case_reads_the_same_a_character_at_a_time(served: dict[str, Any]) -> None:
    unequal = [case_id for _, _, split in served.values() for case_id in split if case_id]
    assert not unequal


def test_each_deliberate_difference_is_documented(served: dict[str, Any]) -> None:
    docs = DOCS.read_text(encoding="utf-8")
    shown = {o.difference for _, outcomes, _ in served.values() for o in outcomes if o.difference}
    assert shown <= set(corpus.DIFFERENCES)
    assert all(f"`{name}`" in docs for name in corpus.DIFFERENCES)
