"""Each family end to end: a tiny model with the family's tokens and real template, served.

For a template from llama.cpp's corpus, a tiny random-weight llama is built
(``tiny_family``: the family's markers are special tokens, the template is the
real one) and served by Tandem from a models.yaml with no ``tool_parser:`` line.
A call forced by ``tool_choice`` (named on chat completions and Messages,
``required`` without parallel calls on Responses; thinking off: random weights would
think until max_tokens) comes back over HTTP on each format as a call of the
offered tool whose arguments follow its schema: detection found the family, the
grammar wrote its syntax over its special tokens, the parser read it back, and
each wire format rendered it.

A few families run in the default suite (one of each call shape); the rest are
``slow``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from app.families import FAMILIES
from tests.api.serving import Served, serving
from tests.families import corpus
from tests.fixtures.tiny_family import build_tiny_family, markers_of

PARAMETERS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                               "unit": {"enum": ["c", "f"]}},
              "required": ["city", "unit"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Weather in Paris?"}]

FAST = {  # template -> family: XML parameters, a Harmony channel, Gemma 4, a special-token section
    "Qwen3.5-4B": "qwen3_coder", "openai-gpt-oss-120b": "gpt_oss", "google-gemma-4-31B-it": "gemma4",
    "moonshotai-Kimi-K2": "kimi",
}
SLOW = {
    "ByteDance-Seed-OSS": "seed_oss", "openbmb-MiniCPM5-1B": "minicpm", "GLM-4.7-Flash": "glm",
    "MiniMax-M2": "minimax", "MiniMax-M3": "minimax_m3", "deepseek-ai-DeepSeek-V3.2": "deepseek_dsml",
    "deepseek-ai-DeepSeek-V3.1": "deepseek_v3", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "deepseek_r1",
    "Kimi-K3": "kimi_k3", "LFM2.5-8B-A1B": "lfm2", "CohereForAI-c4ai-command-r7b-12-2024-tool_use": "cohere",
    "NVIDIA-Nemotron-Nano-v2": "nemotron", "Apertus-8B-Instruct": "apertus", "GigaChat3.1-10B-A1.8B": "gigachat",
    "Qwen-Qwen3-0.6B": "qwen", "mistralai-Ministral-3-14B-Reasoning-2512": "mistral",
    "tencent-Hy3": "hunyuan", "upstage-Solar-Open-100B": "solar", "muse-glimmer": "muse",
}


def _markers(template: str, family: str) -> list[str]:
    """The family's call markers and the template's control tokens: what its tokenizer has as
    single tokens (a reasoning marker only where the template writes it: Kimi K2 Instruct's
    does not, and a tokenizer with <think> as a token makes mlx-lm call the model a reasoner)."""
    f = FAMILIES[family]
    texts = [t for s in f.reads for t in (*(v for v in vars(s).values() if isinstance(v, str)),
                                          *(m for v in vars(s).values() if isinstance(v, tuple) for m in v))]
    texts += [m for pair in f.reasoning for m in pair if m in template] + list(f.dropped)
    return markers_of(*texts, template)


def _serve(tmp_path_factory: pytest.TempPathFactory, root: Path, demo: Path,
           templates: dict[str, str]) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("families")
    models = []
    for i, template in enumerate(templates):
        text = corpus.template_text(root, f"{template}.jinja")
        out = build_tiny_family(tmp / f"m{i}", text, _markers(text, templates[template]), demo)
        models.append({"name": template, "local_path": str(out),
                       "params": {"mem": 16, "max_tokens": 160, "temperature": 0.0, "max_model_len": 4096}})
    with serving(tmp, yaml.safe_dump({"server": {"shutdown_grace_s": 1}, "models": models})) as served:
        yield served


@pytest.fixture(scope="module")
def fast(tmp_path_factory: pytest.TempPathFactory, corpus_root: Path, demo_model_dir: Path) -> Iterator[Served]:
    yield from _serve(tmp_path_factory, corpus_root, demo_model_dir, FAST)


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory, corpus_root: Path, demo_model_dir: Path) -> Iterator[Served]:
    yield from _serve(tmp_path_factory, corpus_root, demo_model_dir, SLOW)


def _calls_of(fmt: str, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    if fmt == "chat":
        return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in body["choices"][0]["message"].get("tool_calls") or []]
    if fmt == "responses":
        return [(o["name"], json.loads(o["arguments"])) for o in body["output"] if o["type"] == "function_call"]
    return [(b["name"], b["input"]) for b in body["content"] if b["type"] == "tool_use"]


def _ask(served: Served, model: str, fmt: str) -> dict[str, Any]:
    function = {"name": "get_weather", "description": "Weather", "parameters": PARAMETERS}
    if fmt == "chat":
        body = {"model": model, "messages": ASK, "tools": [{"type": "function", "function": function}],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 160,
                "reasoning_effort": "none"}
        path = "/v1/chat/completions"
    elif fmt == "responses":
        body = {"model": model, "input": ASK, "tools": [{"type": "function", **function}],
                "tool_choice": "required", "max_output_tokens": 160, "reasoning": {"effort": "none"},
                "parallel_tool_calls": False}
        path = "/v1/responses"
    else:
        body = {"model": model, "messages": ASK, "max_tokens": 160,
                "tool_choice": {"type": "tool", "name": "get_weather"},
                "tools": [{"name": "get_weather", "description": "Weather", "input_schema": PARAMETERS}]}
        path = "/v1/messages"
    r = served.post(path, json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _streamed_calls(served: Served, model: str) -> list[tuple[str, dict[str, Any]]]:
    """The same chat request streamed, its tool-call deltas folded."""
    import httpx

    function = {"name": "get_weather", "description": "Weather", "parameters": PARAMETERS}
    body = {"model": model, "messages": ASK, "tools": [{"type": "function", "function": function}],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 160,
            "reasoning_effort": "none", "stream": True}
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    with httpx.stream("POST", served.base_url + "/v1/chat/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                for tc in choice.get("delta", {}).get("tool_calls") or []:
                    names[tc["index"]] = tc.get("function", {}).get("name") or names.get(tc["index"], "")
                    args[tc["index"]] = args.get(tc["index"], "") + (tc.get("function", {}).get("arguments") or "")
    return [(names[i], json.loads(args[i])) for i in sorted(names)]


def _check(served: Served, template: str, family: str, *, stream: bool = False) -> None:
    for fmt in ("chat", "responses", "messages"):
        body = _ask(served, template, fmt)
        calls = _calls_of(fmt, body)
        assert calls, (fmt, body)
        for name, arguments in calls:
            assert name == "get_weather"
            jsonschema.validate(arguments, PARAMETERS)
        if stream and fmt == "chat":  # streamed as written, the same call
            assert _streamed_calls(served, template) == calls
    health = served.get("/health").json()
    assert health["models"][template]["family"]["tool_parser"] == family, health["models"][template]


@pytest.mark.parametrize(("template", "family"), sorted(FAST.items()))
def test_a_forced_call_comes_back_on_every_wire_format(fast: Served, template: str, family: str) -> None:
    _check(fast, template, family, stream=True)


@pytest.mark.slow
@pytest.mark.parametrize(("template", "family"), sorted(SLOW.items()))
def test_every_family_end_to_end(slow: Served, template: str, family: str) -> None:
    _check(slow, template, family)
