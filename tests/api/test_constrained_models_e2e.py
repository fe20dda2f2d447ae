"""Constrained output on every kind of model the registry serves, end to end.

A ``response_format`` schema and a forced tool call compile to a grammar over the
model's tokenizer. Each kind of entry brings its own tokenizer: an mlx-lm
``TokenizerWrapper`` for a text model (its images captioned by a proxy, or none), a
transformers tokenizer from an mlx-vlm processor for a native VLM (whose
``eos_token_ids`` is one int: the grammar compiler used to fail on it with a 500).
A ``role: vision`` entry only captions for proxies, so clients cannot name it.

The models are random-weight tinies (a seeded llama, a Qwen2-VL): what they write is
the grammar's doing, so the schemas are bounded to keep it short.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import yaml

from tests.api.serving import assert_openai_error, serving
from tests.fixtures.tiny_vlm import build_tiny_qwen2_vl
from tests.vision.sample_images import data_url, striped_bytes

SKY = {"type": "object", "properties": {"sky": {"enum": ["clear", "cloudy"]}, "warm": {"type": "boolean"}},
       "required": ["sky", "warm"], "additionalProperties": False}
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}, "required": ["city"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                                           "parameters": CITY}}]
IMAGE = data_url(striped_bytes(7))


@pytest.fixture(scope="module")
def srv(tmp_path_factory, tiny_model_dir):
    vlm = build_tiny_qwen2_vl(tmp_path_factory.mktemp("kinds") / "vlm")
    models = [
        {"name": "text", "local_path": str(tiny_model_dir), "params": {"mem": 16, "temperature": 0.0},
         "capabilities": {"vision_mode": "proxy", "vision_proxy": {"model": "captioner", "max_tokens": 4}}},
        {"name": "captioner", "role": "vision", "local_path": str(vlm),
         "params": {"max_pixels": 56 * 56}},
        {"name": "vlm", "local_path": str(vlm),
         "params": {"mem": 16, "temperature": 0.0, "max_pixels": 56 * 56},
         "capabilities": {"vision_mode": "native"}},
    ]
    text = yaml.safe_dump({"server": {"shutdown_grace_s": 1}, "models": models})
    with serving(tmp_path_factory.mktemp("kinds-server"), text) as served:
        yield served


def _messages(image: bool) -> list[dict]:
    content: list[dict] = [{"type": "text", "text": "What is the weather?"}]
    if image:
        content.append({"type": "image_url", "image_url": {"url": IMAGE}})
    return [{"role": "user", "content": content}]


KINDS = [pytest.param("text", False, id="text-model"), pytest.param("text", True, id="proxy-vision"),
         pytest.param("vlm", False, id="native-vlm"), pytest.param("vlm", True, id="native-vlm-image")]


@pytest.mark.parametrize("model, image", KINDS)
def test_json_schema_is_followed(srv, model, image):
    r = srv.post("/v1/chat/completions", {
        "model": model, "messages": _messages(image), "max_tokens": 120,
        "response_format": {"type": "json_schema", "json_schema": {"name": "sky", "schema": SKY, "strict": True}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    jsonschema.validate(json.loads(choice["message"]["content"]), SKY)
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize("model, image", KINDS)
def test_a_forced_tool_call_comes_back_as_a_call(srv, model, image):
    r = srv.post("/v1/chat/completions", {
        "model": model, "messages": _messages(image), "max_tokens": 160, "tools": TOOLS,
        "parallel_tool_calls": False, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and choice["finish_reason"] == "tool_calls"
    jsonschema.validate(json.loads(call["function"]["arguments"]), CITY)


def test_a_vision_entry_is_not_a_chat_model(srv):
    """It captions for proxies only: a client naming it gets a 404, constraint or not."""
    r = srv.post("/v1/chat/completions", {
        "model": "captioner", "messages": _messages(False), "max_tokens": 8,
        "response_format": {"type": "json_schema", "json_schema": {"name": "sky", "schema": SKY}}})
    assert_openai_error(r, 404, "model_not_found")
