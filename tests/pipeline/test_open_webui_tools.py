"""Open WebUI attaches its ~40 built-in tools to every chat. On a template without tool
support they are described compactly, so the default chat fits the demo model's context."""

from __future__ import annotations

import json

import pytest

from app.api.openai.protocol import ChatCompletionRequest
from app.config.schema import ChatParams, ModelCapabilities
from app.pipeline.pipeline import build_chat
from app.pipeline.prompting import make_profile
from tests.fixtures.open_webui import OPEN_WEBUI_SYSTEM, OPEN_WEBUI_TOOLS


@pytest.fixture(scope="module")
def profile(demo_model_dir):
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(demo_model_dir)
    return make_profile("demo", tokenizer, ChatParams(), 8192, ModelCapabilities())


def prompt_tokens(profile, tools: list[dict]) -> int:
    body = {"model": "demo", "tools": tools, "messages": [
        {"role": "system", "content": OPEN_WEBUI_SYSTEM},
        {"role": "user", "content": "What is the capital of France?"}]}
    if not tools:
        del body["tools"]
    return len(build_chat(profile, ChatCompletionRequest.model_validate(body).to_request()).gen.prompt_tokens)


def test_forty_tools_cost_a_fraction_of_their_schemas(profile):
    assert not profile.template_takes_tools  # SmolLM2's template has no tools
    bare = prompt_tokens(profile, [])
    with_tools = prompt_tokens(profile, OPEN_WEBUI_TOOLS)
    schemas = len(profile.tokenizer.encode("\n".join(json.dumps(t["function"]) for t in OPEN_WEBUI_TOOLS)))
    per_tool = (with_tools - bare) / len(OPEN_WEBUI_TOOLS)
    assert per_tool < 40, per_tool  # a name, a sentence, the parameter names
    assert with_tools - bare < schemas / 2.5
    assert with_tools < 2048  # the whole default chat, well inside the 8k context


def test_the_note_names_every_tool_and_its_parameters(profile):
    body = {"model": "demo", "tools": OPEN_WEBUI_TOOLS, "tool_choice": "required",
            "messages": [{"role": "user", "content": "Weather in Paris?"}]}
    text = build_chat(profile, ChatCompletionRequest.model_validate(body).to_request()).prompt_text
    assert "You must call one of them." in text
    assert "- get_weather(location: string, unit?: string): Current weather and a three-day forecast for a place." \
        in text
    assert "- get_current_timestamp(): Return the current date and time, with the user's time zone." in text
    for tool in OPEN_WEBUI_TOOLS:
        assert f"- {tool['function']['name']}(" in text
