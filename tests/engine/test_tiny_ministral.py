"""The scripted tiny Ministral (tests/fixtures/tiny_ministral.py) is what the end-to-end tests take it for."""

from __future__ import annotations

import pytest

from app.config.schema import ChatParams
from app.engine.models.loader import load_text_model
from app.engine.params import ModelSource
from app.specs import load_params
from tests.fixtures.tiny_ministral import DEFAULT_SYSTEM_PROMPT, SPECIAL_TOKENS, build_tiny_ministral

THINK = "[THINK]The user wants weather.[/THINK]It is sunny"
AFTER_TOOL = "Done: Paris is sunny, Lyon is sunny!"  # repeated words, written in other tokens
CALL = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'
USER = [{"role": "user", "content": "Weather in Paris?"}]
TOOL_TURN = [*USER, {"role": "assistant", "content": "", "tool_calls": [
    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "sunny"}]


@pytest.fixture(scope="module")
def scripted(tiny_ministral):
    return tiny_ministral({"[/INST]": THINK, "[/TOOL_RESULTS]": AFTER_TOOL})


def prompt(tokenizer, messages, **kw):
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)


def test_loads_with_mlx_lm_and_writes_its_scripts(scripted):
    from mlx_lm import generate, load
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = load(str(scripted))
    assert type(model).__module__ == "mlx_lm.models.mistral3"
    vocab = tokenizer.get_vocab()
    for token in SPECIAL_TOKENS:
        assert tokenizer.encode(token, add_special_tokens=False) == [vocab[token]]
    assert generate(model, tokenizer, prompt(tokenizer, USER), max_tokens=40) == THINK
    assert generate(model, tokenizer, prompt(tokenizer, TOOL_TURN), max_tokens=40) == AFTER_TOOL
    # Sampled at temperature 1 it still follows the script: the margin is 40 logits.
    hot = make_sampler(temp=1.0)
    assert generate(model, tokenizer, prompt(tokenizer, USER), max_tokens=40, sampler=hot) == THINK
    # A prompt that ends anywhere else gets nothing.
    assert generate(model, tokenizer, "Weather in Paris?", max_tokens=40) == ""


def test_loads_with_the_servers_loader(scripted):
    loaded = load_text_model(ModelSource("m", local_path=str(scripted)), load_params(ChatParams()))
    assert loaded.config["model_type"] == "mistral3" and [g.kind for g in loaded.kv.layers] == ["kv", "kv"]
    assert loaded.tokenizer.eos_token == "</s>" and loaded.tokenizer.bos_token == "<s>"


def test_template_behaves_like_ministral_3_reasoning(scripted):
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(scripted)
    bare = prompt(tok, USER)
    assert bare == f"<s>[SYSTEM_PROMPT]{DEFAULT_SYSTEM_PROMPT}[/SYSTEM_PROMPT][INST]Weather in Paris?[/INST]"
    # No thinking switch: the prompt is byte-identical either way.
    assert prompt(tok, USER, enable_thinking=False) == prompt(tok, USER, enable_thinking=True) == bare
    framed = prompt(tok, [{"role": "system", "content": "Be brief."}, *USER])
    assert framed == "<s>[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST]Weather in Paris?[/INST]"
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    rendered = prompt(tok, TOOL_TURN, tools=tools)
    assert '[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather"}}][/AVAILABLE_TOOLS]' in rendered
    assert rendered.endswith('[INST]Weather in Paris?[/INST][TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}</s>'
                             "[TOOL_RESULTS]sunny[/TOOL_RESULTS]")
    for bad in ([*USER, *USER], [{"role": "assistant", "content": "Hi"}], [{"role": "developer", "content": "x"}]):
        with pytest.raises(Exception, match="roles"):
            prompt(tok, bad)


@pytest.mark.parametrize("script, problem", [
    ("[THINK]Sunny.[/THINK]It is sunny.", "'It is sunny.'"),  # "." merges with nothing in this BPE
    (f"{CALL}{CALL}", r"\[TOOL_CALLS\] appears twice"),
    ("a</s>", "</s>"),
])
def test_scripts_it_cannot_follow_are_refused(tmp_path, demo_model_dir, script, problem):
    with pytest.raises(ValueError, match=problem):
        build_tiny_ministral(tmp_path, script, base=demo_model_dir)
