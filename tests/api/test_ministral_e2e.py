"""Ministral 3 Reasoning end to end, on scripted tiny models (tests/fixtures/tiny_ministral.py).

Each model writes a known text after the prompt, through the real chat template,
tokenizer, engine, streaming detokenizer and parser, so what reaches the client
is checked exactly. The models.yaml entries name no parser: the template's
``[TOOL_CALLS]`` and ``[THINK]`` make detection pick ``mistral`` and reasoning,
as it does for the real model. Two defects this guards against:

- ``thinking: false`` left ``[THINK]...[/THINK]`` in the content: the template has
  no thinking switch, so the model reasons anyway, and its reasoning must be read
  (then dropped), never left in the answer.
- A client system prompt removed the template's default one, which tells the model
  how to use ``[THINK]``: ``system_prompt: append`` (the default for such templates)
  keeps it first.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from openai import OpenAI

from tests.api.serving import serving
from tests.fixtures.tiny_ministral import DEFAULT_SYSTEM_PROMPT

REASONING = "The user wants weather."
ANSWER = "It is sunny"
THINK = f"[THINK]{REASONING}[/THINK]{ANSWER}"
CALL_REASONING = "Paris needs a lookup."
CALL = f'[THINK]{CALL_REASONING}[/THINK][TOOL_CALLS]get_weather[ARGS]{{"city": "Paris"}}'
AFTER_TOOL = "It is 18 degrees in Paris"
MARKERS = ("[THINK]", "[/THINK]", "[TOOL_CALLS]", "[ARGS]")
USER = [{"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
NO_THINKING = {"thinking": False}


def models_yaml(model_dir, **capabilities) -> str:
    entry = {"name": "ministral", "local_path": str(model_dir),
             "params": {"mem": 16, "max_tokens": 64, "temperature": 0.0, "max_model_len": 4096}}
    if capabilities:
        entry["capabilities"] = capabilities
    return yaml.safe_dump({"server": {"shutdown_grace_s": 1}, "models": [entry]})


def served_client(tmp_path_factory, model_dir, **capabilities):
    with serving(tmp_path_factory.mktemp("ministral"), models_yaml(model_dir, **capabilities)) as served:
        with OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            yield client, served


@pytest.fixture(scope="module")
def thinker(tmp_path_factory, tiny_ministral):
    """Reasons, then answers; the template's defaults decide everything."""
    yield from served_client(tmp_path_factory, tiny_ministral(THINK))


@pytest.fixture(scope="module")
def caller(tmp_path_factory, tiny_ministral):
    """Reasons, calls get_weather; after the tool's result, answers."""
    yield from served_client(tmp_path_factory, tiny_ministral({"[/INST]": CALL, "[/TOOL_RESULTS]": AFTER_TOOL}))


@pytest.fixture(scope="module")
def replacer(tmp_path_factory, tiny_ministral):
    """The thinker with ``system_prompt: replace``."""
    yield from served_client(tmp_path_factory, tiny_ministral(THINK), system_prompt="replace")


def fold(chunks):
    """A stream's content, reasoning fields (per field name) and tool calls, joined."""
    content, reasoning, calls, finish = "", {}, {}, None
    for c in chunks:
        if not c.choices:
            continue
        delta = c.choices[0].delta
        content += delta.content or ""
        for name, value in (delta.model_extra or {}).items():
            if name in ("reasoning_content", "reasoning") and value:
                reasoning[name] = reasoning.get(name, "") + value
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            call["name"] += (tc.function.name or "") if tc.function else ""
            call["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = c.choices[0].finish_reason or finish
    return content, reasoning, list(calls.values()), finish


def reasoning_of(message) -> dict:
    extra = message.model_extra or {}
    return {name: extra[name] for name in ("reasoning_content", "reasoning") if extra.get(name)}


def test_detection_reads_the_template(thinker):
    _, served = thinker
    profile = served.state.pipeline.profile("ministral")
    assert profile.parser == "mistral" and profile.reasoning
    assert not profile.thinking_switch
    assert profile.default_system_prompt == DEFAULT_SYSTEM_PROMPT
    assert profile.system_prompt == "append"


def test_thinking_on_puts_reasoning_in_its_fields(thinker):
    client, _ = thinker
    msg = client.chat.completions.create(model="ministral", messages=USER).choices[0].message
    assert msg.content == ANSWER
    assert reasoning_of(msg) == {"reasoning_content": REASONING, "reasoning": REASONING}
    content, reasoning, _, finish = fold(client.chat.completions.create(model="ministral", messages=USER, stream=True))
    assert (content, reasoning, finish) == (ANSWER, {"reasoning_content": REASONING, "reasoning": REASONING}, "stop")


@pytest.mark.parametrize("off", [NO_THINKING, {"reasoning_effort": "none"},
                                 {"chat_template_kwargs": {"enable_thinking": False}}])
def test_thinking_off_drops_reasoning_the_model_writes_anyway(thinker, off):
    client, _ = thinker
    r = client.chat.completions.create(model="ministral", messages=USER, extra_body={**off, "extensions": True})
    msg = r.choices[0].message
    assert msg.content == ANSWER and not reasoning_of(msg)
    assert not any(m in msg.content for m in MARKERS)
    # The template cannot turn thinking off: the prompt is the one thinking on gets.
    on = client.chat.completions.create(model="ministral", messages=USER, extra_body={"extensions": True})
    assert r.model_extra["extensions"]["prompt"] == on.model_extra["extensions"]["prompt"]
    chunks = list(client.chat.completions.create(model="ministral", messages=USER, stream=True, extra_body=off))
    content, reasoning, _, finish = fold(chunks)
    assert (content, reasoning, finish) == (ANSWER, {}, "stop")


def test_scripted_tool_call_becomes_a_tool_call_and_round_trips(caller):
    client, _ = caller
    kw = dict(model="ministral", messages=USER, tools=TOOLS)
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content and reasoning_of(choice.message)["reasoning_content"] == CALL_REASONING
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    # Mistral's templates take only 9 letters or digits as a call id.
    assert len(call.id) == 9 and call.id.isalnum()

    content, reasoning, calls, finish = fold(client.chat.completions.create(**kw, stream=True))
    assert (content, reasoning["reasoning_content"], finish) == ("", CALL_REASONING, "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", {"city": "Paris"})]

    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18})}]
    again = client.chat.completions.create(model="ministral", messages=history, tools=TOOLS,
                                           extra_body={"extensions": True})
    assert again.choices[0].message.content == AFTER_TOOL and again.choices[0].finish_reason == "stop"
    prompt = again.model_extra["extensions"]["prompt"]
    assert prompt.endswith('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}</s>'
                           '[TOOL_RESULTS]{"temperature_c": 18}[/TOOL_RESULTS]')


def test_tool_call_with_thinking_off_keeps_the_call_and_drops_the_reasoning(caller):
    client, _ = caller
    kw = dict(model="ministral", messages=USER, tools=TOOLS, extra_body=NO_THINKING)
    msg = client.chat.completions.create(**kw).choices[0].message
    assert not msg.content and not reasoning_of(msg)
    assert [json.loads(c.function.arguments) for c in msg.tool_calls] == [{"city": "Paris"}]
    content, reasoning, calls, finish = fold(client.chat.completions.create(**kw, stream=True))
    assert (content, reasoning, len(calls), finish) == ("", {}, 1, "tool_calls")


@pytest.mark.parametrize("kw", [{}, {"tools": TOOLS, "tool_choice": "none"}], ids=["no tools", "tool_choice none"])
def test_no_tool_calls_come_back_when_the_request_allowed_none(caller, kw):
    """As OpenAI and vLLM: without tools offered, what the model wrote is content, not a call."""
    client, _ = caller
    choice = client.chat.completions.create(model="ministral", messages=USER, **kw).choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'


def prompt_of(client, messages) -> str:
    r = client.chat.completions.create(model="ministral", messages=messages, max_tokens=1,
                                       extra_body={"extensions": True})
    return r.model_extra["extensions"]["prompt"]


def test_without_a_system_message_the_default_appears_once(thinker, replacer):
    for client, _ in (thinker, replacer):
        prompt = prompt_of(client, USER)
        assert prompt.count(DEFAULT_SYSTEM_PROMPT) == 1
        assert prompt.startswith(f"<s>[SYSTEM_PROMPT]{DEFAULT_SYSTEM_PROMPT}[/SYSTEM_PROMPT][INST]")


def test_append_keeps_the_default_before_the_clients_system_prompt(thinker):
    client, _ = thinker
    prompt = prompt_of(client, [{"role": "system", "content": "You are Open WebUI's helper."}, *USER])
    assert prompt.startswith(f"<s>[SYSTEM_PROMPT]{DEFAULT_SYSTEM_PROMPT}\n\nYou are Open WebUI's helper."
                             "[/SYSTEM_PROMPT][INST]Weather in Paris?[/INST]")
    assert prompt.count(DEFAULT_SYSTEM_PROMPT) == 1
    # A system message after the user's turn (Claude Code sends one) joins the first.
    late = prompt_of(client, [{"role": "system", "content": "One."}, *USER, {"role": "system", "content": "Two."}])
    assert late.startswith(f"<s>[SYSTEM_PROMPT]{DEFAULT_SYSTEM_PROMPT}\n\nOne.\n\nTwo.[/SYSTEM_PROMPT][INST]")
    # And the model still reasons in its format, read into the reasoning fields.
    msg = client.chat.completions.create(model="ministral", messages=[
        {"role": "system", "content": "You are Open WebUI's helper."}, *USER]).choices[0].message
    assert (msg.content, reasoning_of(msg).get("reasoning_content")) == (ANSWER, REASONING)


def test_replace_sends_the_clients_system_prompt_alone(replacer):
    client, served = replacer
    assert served.state.pipeline.profile("ministral").system_prompt == "replace"
    prompt = prompt_of(client, [{"role": "system", "content": "You are Open WebUI's helper."}, *USER])
    assert prompt.startswith("<s>[SYSTEM_PROMPT]You are Open WebUI's helper.[/SYSTEM_PROMPT][INST]")
    assert DEFAULT_SYSTEM_PROMPT not in prompt


def agui_events(served, forwarded: dict) -> list[dict]:
    import httpx

    body = {"threadId": "t1", "runId": "r1", "state": None, "context": [], "tools": [],
            "forwardedProps": forwarded, "messages": [{"id": "m0", **USER[0]}]}
    with httpx.stream("POST", served.base_url + "/v1/agui", json=body, timeout=60) as r:
        assert r.status_code == 200
        return [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]


@pytest.mark.parametrize("forwarded, reasoning", [({}, REASONING), (NO_THINKING, "")])
def test_agui_reasoning_follows_the_thinking_switch(thinker, forwarded, reasoning):
    events = agui_events(thinker[1], forwarded)
    text = "".join(e["delta"] for e in events if e["type"] == "TEXT_MESSAGE_CONTENT")
    thought = "".join(e["delta"] for e in events if e["type"] == "REASONING_MESSAGE_CONTENT")
    assert (text, thought) == (ANSWER, reasoning)
    assert any(e["type"] == "REASONING_START" for e in events) is bool(reasoning)


@pytest.mark.parametrize("extra, reasoning", [({}, {"reasoning_content": "The user", "reasoning": "The user"}),
                                              (NO_THINKING, {})])
def test_cut_inside_reasoning_leaves_no_markers(thinker, extra, reasoning):
    client, _ = thinker
    kw = dict(model="ministral", messages=USER, max_tokens=3, extra_body=extra)  # [THINK] The user
    choice = client.chat.completions.create(**kw).choices[0]
    assert (choice.message.content, reasoning_of(choice.message), choice.finish_reason) == ("", reasoning, "length")
    content, streamed, _, finish = fold(client.chat.completions.create(**kw, stream=True))
    assert (content, streamed, finish) == ("", reasoning, "length")


CODEX_REQUEST = Path(__file__).resolve().parent.parent / "fixtures" / "codex" / "responses_request.json"
CODEX_CALL = '[TOOL_CALLS]exec_command[ARGS]{"cmd": "ls"}'
CODEX_DONE = "Listed the files"


@pytest.fixture(scope="module")
def codexer(tmp_path_factory, tiny_ministral):
    """Calls exec_command after a user turn, answers after its result; room for Codex's prompt
    (~9,000 tokens, its tools as JSON)."""
    model_dir = tiny_ministral({"[/INST]": CODEX_CALL, "[/TOOL_RESULTS]": CODEX_DONE})
    config = yaml.safe_load(models_yaml(model_dir))
    config["models"][0]["params"].update(max_model_len=16384, mem=64)
    with serving(tmp_path_factory.mktemp("ministral"), yaml.safe_dump(config)) as served:
        yield served


def codex_chat_body(body: dict) -> dict:
    """Codex's recorded Responses request as the same conversation in chat completions' shape:
    developer, developer, user (its environment context), user (the prompt)."""
    tools = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters")}}
             for t in body["tools"] if t["type"] == "function"]
    messages = [{"role": item["role"], "content": item["content"]} for item in body["input"]]
    return {"model": "ministral", "messages": messages, "tools": tools, "extensions": True}


def assert_one_user_turn(prompt: str, body: dict) -> None:
    """Codex's two user messages reach the template as one turn, in their order."""
    context, ask = (item["content"][0]["text"] for item in body["input"] if item["role"] == "user")
    assert prompt.count("[INST]") == 1 and f"[INST]{context}\n{ask}[/INST]" in prompt


def test_codexs_consecutive_user_messages_reach_a_template_that_demands_alternation(codexer):
    """Codex always sends two user messages in a row; Ministral's template raises "conversation roles
    must alternate" on them, which was a 400 on /v1/responses and /v1/chat/completions (Messages
    already merged its turns). The template is probed for it and such turns are merged for every
    format; Codex's tool round trip then completes on both."""
    recorded = json.loads(CODEX_REQUEST.read_text())
    body = {**recorded, "model": "ministral", "stream": False, "extensions": True}
    r = codexer.post("/v1/responses", body)
    assert r.status_code == 200, r.text
    assert_one_user_turn(r.json()["extensions"]["prompt"], body)
    (call,) = [item for item in r.json()["output"] if item["type"] == "function_call"]
    assert (call["name"], json.loads(call["arguments"])) == ("exec_command", {"cmd": "ls"})
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": "a.txt"}
    body["input"] = [*body["input"], call, result]
    r = codexer.post("/v1/responses", body)
    assert r.status_code == 200, r.text
    assert r.json()["output"][-1]["content"][0]["text"] == CODEX_DONE

    chat = codex_chat_body(recorded)
    r = codexer.post("/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    assert_one_user_turn(r.json()["extensions"]["prompt"], recorded)
    (tool_call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert tool_call["function"]["name"] == "exec_command"
    chat["messages"] += [{"role": "assistant", "content": None, "tool_calls": [tool_call]},
                         {"role": "tool", "tool_call_id": tool_call["id"], "content": "a.txt"}]
    r = codexer.post("/v1/chat/completions", chat)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == CODEX_DONE
    assert codexer.state.pipeline.profile("ministral").alternating


def test_a_template_that_takes_consecutive_turns_gets_them_as_sent(thinker, demo_state):
    """Only templates that refuse consecutive turns get them merged: SmolLM2's renders them."""
    from app.pipeline.pipeline import build_chat
    from app.pipeline.request import ChatRequest, Message, Options

    profile = demo_state.pipeline.profile("demo") or None
    assert profile is not None and not profile.alternating
    turns = (Message.of("user", "Context."), Message.of("user", "Hi"))
    prompt = build_chat(profile, ChatRequest(Options("demo"), turns)).prompt_text
    assert prompt.count("<|im_start|>user") == 2
