"""Anthropic's Messages API end to end: the official ``anthropic`` SDK against a real server.

The demo model (SmolLM2-135M) copies a few-shot pattern (tool calls, reasoning), so
the real parser path runs on real generated text; scripted tiny Ministral models
(tests/fixtures/tiny_ministral.py) write Mistral's ``[THINK]`` and ``[TOOL_CALLS]``
exactly, for the call-id round trip through a template that checks ids. The SDK 2.x
sends no sampling fields of its own: ``temperature`` goes in ``extra_body``.
"""

from __future__ import annotations

import json
import re
import shutil

import anthropic
import httpx
import pytest
import yaml
from anthropic.types import (
    RawContentBlockDeltaEvent,
    RawContentBlockStartEvent,
    RawContentBlockStopEvent,
    RawMessageDeltaEvent,
    RawMessageStartEvent,
    RawMessageStopEvent,
)

from tests.api.serving import serving, tiny_yaml
from tests.api.sse_frames import parse_frames, read_stream
from tests.vision.sample_images import image_bytes

GREEDY = {"extra_body": {"temperature": 0}}
WEATHER = {"name": "get_weather", "description": "Weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
TOOL_SHOT = [
    {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": CALL},
    {"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": CALL},
    {"role": "user", "content": "Weather in Paris?"},
]
THINK = "<think>The user wants the capital.</think>The capital is Paris."
THINK_SHOT = [
    {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": THINK},
    {"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": THINK},
    {"role": "user", "content": "Capital of France?"},
]
HI = [{"role": "user", "content": "Name a colour."}]
# Anthropic's event grammar, one event type per word.
EVENT_ORDER = re.compile(r"message_start (content_block_start (content_block_delta )*content_block_stop )*"
                         r"message_delta message_stop")


def wire_order(frames) -> str:
    """The event names of a raw stream, checked to open with ``message_start`` then ``ping``
    (as Anthropic's API does), without the pings: more come while a stream is silent."""
    names = [f.name for f in frames]
    assert names[:2] == ["message_start", "ping"], names
    assert all(f.json() == {"type": "ping"} for f in frames if f.name == "ping")
    return " ".join(n for n in names if n != "ping")


RAW_TYPES = {"message_start": RawMessageStartEvent, "content_block_start": RawContentBlockStartEvent,
             "content_block_delta": RawContentBlockDeltaEvent, "content_block_stop": RawContentBlockStopEvent,
             "message_delta": RawMessageDeltaEvent, "message_stop": RawMessageStopEvent}


@pytest.fixture()
def claude(demo_server):
    with anthropic.Anthropic(base_url=demo_server.base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def check_events(events) -> None:
    """The SDK's typed raw events, in Anthropic's order, each block's deltas at its own index."""
    types = [e.type for e in events]
    assert EVENT_ORDER.fullmatch(" ".join(types)), types
    assert all(isinstance(e, RAW_TYPES[e.type]) for e in events)
    index = -1
    for e in events:
        if e.type == "content_block_start":
            index += 1
            assert e.index == index
        elif e.type in ("content_block_delta", "content_block_stop"):
            assert e.index == index
    assert events[0].message.content == [] and events[0].message.stop_reason is None


def streamed(client, **kw):
    """One answer streamed through the SDK's helper: its typed raw events, checked, and its final message."""
    with client.messages.stream(**kw) as stream:
        events = [e for e in stream if e.type in RAW_TYPES]
        final = stream.get_final_message()
    check_events(events)
    return events, final


def total_input(usage) -> int:
    """Anthropic's prompt size: input_tokens plus what the (prefix) cache supplied."""
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


def blocks(message) -> list[dict]:
    """A message's content as plain dicts (the stream helper's blocks carry a ``parsed_output`` too)."""
    return [b.model_dump(exclude={"parsed_output"}) for b in message.content]


def same_answer(a, b) -> None:
    assert blocks(a) == blocks(b)
    assert (a.stop_reason, a.stop_sequence) == (b.stop_reason, b.stop_sequence)
    assert a.usage.output_tokens == b.usage.output_tokens and total_input(a.usage) == total_input(b.usage)


def test_text_non_stream_and_stream_agree(claude):
    kw = dict(model="demo", max_tokens=16, messages=HI, **GREEDY)
    msg = claude.messages.create(**kw)
    assert (msg.type, msg.role, msg.model) == ("message", "assistant", "demo") and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text
    assert msg.stop_reason in ("end_turn", "max_tokens") and msg.stop_sequence is None
    assert msg.usage.output_tokens > 0 and msg.usage.cache_creation_input_tokens == 0

    events, final = streamed(claude, **kw)
    text = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    assert text == msg.content[0].text
    assert events[-2].delta.stop_reason == msg.stop_reason and events[-2].usage.output_tokens == msg.usage.output_tokens
    same_answer(final, msg)


def test_stream_frames_are_exact_named_events(demo_server):
    raw = read_stream(demo_server.base_url, "/v1/messages",
                      {"model": "demo", "max_tokens": 4, "messages": HI, "temperature": 0, "stream": True})
    frames = parse_frames(raw, named=True)
    assert EVENT_ORDER.fullmatch(wire_order(frames))
    delta = frames[-2].json()
    assert set(delta["usage"]) == {"input_tokens", "output_tokens", "cache_read_input_tokens",
                                   "cache_creation_input_tokens"}


def test_thinking_blocks_on_and_off(claude):
    kw = dict(model="demo", max_tokens=30, messages=THINK_SHOT, **GREEDY)
    on = claude.messages.create(**kw, thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in on.content] == ["thinking", "text"]
    assert on.content[0].thinking == "The user wants the capital." and on.content[0].signature
    assert on.content[1].text == "The capital is Paris." and on.stop_reason == "end_turn"

    events, final = streamed(claude, **kw, thinking={"type": "enabled", "budget_tokens": 1024})
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "thinking_delta" in deltas and deltas.index("signature_delta") < deltas.index("text_delta")
    same_answer(final, on)

    # Disabled, as when absent (Anthropic's default): the model's reasoning is read and dropped.
    msg = claude.messages.create(**kw, thinking={"type": "disabled"})
    assert [(b.type, b.text) for b in msg.content] == [("text", "The capital is Paris.")]

    # A signed thinking block comes back in the assistant's turn.
    again = claude.messages.create(model="demo", max_tokens=2, **GREEDY,
                                   messages=[*THINK_SHOT, on.to_param(), {"role": "user", "content": "Thanks!"}])
    assert again.stop_reason in ("end_turn", "max_tokens")


def test_tool_use_round_trip(claude):
    kw = dict(model="demo", max_tokens=40, messages=TOOL_SHOT, tools=[WEATHER], **GREEDY)
    msg = claude.messages.create(**kw)
    assert msg.stop_reason == "tool_use"
    (call,) = [b for b in msg.content if b.type == "tool_use"]
    assert re.fullmatch(r"toolu_[A-Za-z0-9]{24}", call.id)
    assert (call.name, call.input) == ("get_weather", {"city": "Paris"})
    assert not any("<tool_call>" in b.text for b in msg.content if b.type == "text")

    events, final = streamed(claude, **kw)
    start = next(e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use")
    assert start.content_block.input == {} and start.content_block.name == "get_weather"
    args = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                   and e.delta.type == "input_json_delta")
    assert json.loads(args) == {"city": "Paris"}
    assert [b.type for b in final.content] == [b.type for b in msg.content] and final.stop_reason == "tool_use"
    assert final.content[-1].input == call.input  # ids differ: each answer makes its own

    history = [*TOOL_SHOT, msg.to_param(), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": json.dumps({"temperature_c": 18})}]}]
    again = claude.messages.create(model="demo", max_tokens=8, messages=history, tools=[WEATHER], **GREEDY)
    assert again.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_tool_choice_decides_what_the_prompt_offers(claude):
    """Counted, not generated: none offers no tools, tool offers the named one, any asks for a call."""
    time_tool = {"name": "get_time", "description": "Time in a zone", "input_schema": {"type": "object"}}

    def count(**kw):
        return claude.messages.count_tokens(model="demo", messages=HI, **kw).input_tokens

    tools = [WEATHER, time_tool]
    auto = count(tools=tools, tool_choice={"type": "auto"})
    assert count(tools=tools, tool_choice={"type": "none"}) == count() < auto
    assert count(tools=tools, tool_choice={"type": "tool", "name": "get_weather"}) == count(tools=[WEATHER]) < auto
    assert count(tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True}) > auto


def test_stop_sequence_is_named(claude):
    kw = dict(model="demo", max_tokens=16, messages=HI, **GREEDY)
    text = claude.messages.create(**kw).content[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    msg = claude.messages.create(**kw, stop_sequences=["\u2063never\u2063", stop])
    assert (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", stop)
    assert stop not in msg.content[0].text and text.startswith(msg.content[0].text)
    events, final = streamed(claude, **kw, stop_sequences=[stop])
    assert (events[-2].delta.stop_reason, events[-2].delta.stop_sequence) == ("stop_sequence", stop)
    same_answer(final, msg)


def test_count_tokens_equals_the_usage_of_the_same_request(claude):
    prompt = dict(model="demo", system="You call tools.", messages=TOOL_SHOT, tools=[WEATHER])
    counted = claude.messages.count_tokens(**prompt).input_tokens
    msg = claude.messages.create(**prompt, max_tokens=1, **GREEDY)
    assert counted == total_input(msg.usage) > 0
    assert claude.messages.count_tokens(model="demo", messages=TOOL_SHOT).input_tokens < counted


def test_images_take_the_vision_path(claude, demo_server):
    """The demo's vision model is missing: images are still read and checked, then replaced by a placeholder."""
    import base64

    png = base64.b64encode(image_bytes()).decode()
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}}
    with_image = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]
    msg = claude.messages.create(model="demo", max_tokens=2, messages=with_image, **GREEDY)
    assert msg.usage.output_tokens > 0
    plain = claude.messages.count_tokens(model="demo", messages=[{"role": "user", "content": "What is this?"}])
    assert claude.messages.count_tokens(model="demo", messages=with_image).input_tokens > plain.input_tokens
    for source in ({"type": "base64", "media_type": "image/png", "data": "@@not-base64@@"},
                   {"type": "url", "url": "http://127.0.0.1:9/x.png"}):  # remote images are off by default
        bad = [{"role": "user", "content": [{"type": "image", "source": source}]}]
        r = httpx.post(demo_server.base_url + "/v1/messages", timeout=60,
                       json={"model": "demo", "max_tokens": 2, "messages": bad})
        assert_anthropic_error(r, 400, "invalid_request_error")


def assert_anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    """``r`` is ``status`` with Anthropic's error body of type ``kind``; returns the message."""
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == kind and body["error"]["message"], body
    return body["error"]["message"]


MESSAGES = [{"role": "user", "content": "hi"}]
BAD_BODIES = [
    ("no max_tokens", {"model": "demo", "messages": MESSAGES}, "max_tokens"),
    ("no messages", {"model": "demo", "max_tokens": 2, "messages": []}, "messages"),
    ("bad role", {"model": "demo", "max_tokens": 2, "messages": [{"role": "tool", "content": "x"}]}, "role"),
    ("unknown block", {"model": "demo", "max_tokens": 2,
                       "messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "document"),
    ("tool_use from the user", {"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}]}, "tool_use"),
    ("temperature", {"model": "demo", "max_tokens": 2, "messages": MESSAGES, "temperature": 3}, "temperature"),
    ("named tool not offered", {"model": "demo", "max_tokens": 2, "messages": MESSAGES, "tools": [WEATHER],
                                "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ("over the context", {"model": "demo", "max_tokens": 2,
                          "messages": [{"role": "user", "content": "word " * 3000}]}, "context length"),
]


@pytest.mark.parametrize(("name", "body", "says"), BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_requests_get_anthropic_errors(demo_server, name, body, says):
    r = httpx.post(demo_server.base_url + "/v1/messages", json=body, timeout=60)
    assert says in assert_anthropic_error(r, 400, "invalid_request_error")


def test_error_shapes_through_the_sdk(claude, demo_server):
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="claude-nope", max_tokens=2, messages=MESSAGES)
    assert err.value.body["error"]["type"] == "not_found_error" and "claude-nope" in err.value.message
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.count_tokens(model="demo", messages=[{"role": "user", "content": "word " * 3000}])
    assert err.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(demo_server.base_url + "/v1/messages", content=b"{not json",
                   headers={"content-type": "application/json"})
    assert_anthropic_error(r, 400, "invalid_request_error")
    r = httpx.post(demo_server.base_url + "/v1/messages", content=b"{}", headers={"content-type": "text/plain"})
    assert_anthropic_error(r, 415, "invalid_request_error")
    # The server goes on serving.
    assert claude.messages.create(model="demo", max_tokens=2, messages=MESSAGES, **GREEDY).usage.output_tokens


def test_a_claude_code_shaped_request_is_served(demo_server):
    """What Claude Code 2.1 sends, less its 12k-token prompt: beta query and headers, adaptive
    thinking, effort, context management, cache_control, a system message after the user's,
    tools with $schema and defer_loading, and 32000 max_tokens (clamped to the context)."""
    cache = {"type": "ephemeral"}
    schema = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
              "properties": {"command": {"type": "string"}}, "required": ["command"], "additionalProperties": False}
    body = {
        "model": "demo", "max_tokens": 32000, "stream": True,
        "thinking": {"type": "adaptive"}, "output_config": {"effort": "medium"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": "user_abc_account__session_123"},
        "system": [{"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
                   {"type": "text", "text": "Answer in one word.", "cache_control": cache}],
        "messages": [
            {"role": "user", "content": "Say hi"}, {"role": "assistant", "content": "Hi"},
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>Be brief.</system-reminder>"},
                                         {"type": "text", "text": "Say hi", "cache_control": cache}]},
            {"role": "system", "content": "The working directory is /tmp."},
        ],
        "tools": [{"name": "Bash", "description": "Run a shell command", "input_schema": schema},
                  {"name": "mcp__docs__search", "description": "Search docs", "input_schema": schema,
                   "defer_loading": True, "cache_control": cache}],
    }
    headers = {"anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27",
               "anthropic-version": "2023-06-01", "x-api-key": "anything", "x-app": "cli"}
    with httpx.stream("POST", demo_server.base_url + "/v1/messages?beta=true", json=body, headers=headers,
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        frames = parse_frames(r.read(), named=True)
    assert EVENT_ORDER.fullmatch(wire_order(frames))
    assert frames[-2].json()["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use")


CLAUDE_CODE_SYSTEM = "You are Claude Code, Anthropic's official CLI for Claude. Answer in short sentences. " * 8


def test_claude_codes_billing_block_leaves_the_prefix_cache_intact(tmp_path, tiny_model_dir):
    """Claude Code opens its system prompt with a billing block whose hash changes with the prompt
    (2.1.197: ``cc_version=2.1.197.6e2`` in one run, ``...73f`` in the next), so a new session
    missed the whole prefix cache. The block is not an instruction: the model no longer sees it,
    and two requests with different hashes share their prefix."""
    def ask(build: str, question: str) -> dict:
        billing = f"x-anthropic-billing-header: cc_version=2.1.197.{build}; cc_entrypoint=cli;"
        body = {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": question}],
                "system": [{"type": "text", "text": billing}, {"type": "text", "text": CLAUDE_CODE_SYSTEM}]}
        r = served.post("/v1/messages", body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    with serving(tmp_path, tiny_yaml(tiny_model_dir, None, {"cache_min_tokens": 16})) as served:
        first = ask("6e2", "Say hi")
        second = ask("73f", "List the files")
        # The system prompt is most of the prompt, and all of it is read from the cache.
        assert second["cache_read_input_tokens"] >= 0.8 * (first["input_tokens"] + first["cache_read_input_tokens"])
        # What the model sees is the system prompt without the block, as if it had never been sent.
        body = {"model": "tiny", "system": CLAUDE_CODE_SYSTEM, "messages": [{"role": "user", "content": "Say hi"}]}
        counted = served.post("/v1/messages/count_tokens", body).json()["input_tokens"]
        assert counted == first["input_tokens"] + first["cache_read_input_tokens"]


def test_api_key_as_x_api_key_or_bearer(tmp_path, tiny_model_dir):
    with serving(tmp_path, tiny_yaml(tiny_model_dir, server={"api_key": "sekrit"})) as served:
        def client(**auth):
            return anthropic.Anthropic(base_url=served.base_url, max_retries=0, timeout=60, **auth)

        with pytest.raises(anthropic.AuthenticationError) as err:
            client(api_key="wrong").messages.create(model="tiny", max_tokens=2, messages=MESSAGES)
        assert err.value.body["error"]["type"] == "authentication_error"
        r = served.post("/v1/messages/count_tokens", {"model": "tiny", "messages": MESSAGES})
        assert_anthropic_error(r, 401, "authentication_error")
        r = served.post("/v1/messages", {"model": "tiny", "messages": MESSAGES})  # the key is checked first
        assert_anthropic_error(r, 401, "authentication_error")
        for auth in ({"api_key": "sekrit"}, {"auth_token": "sekrit"}):  # x-api-key, Authorization: Bearer
            assert client(**auth).messages.create(model="tiny", max_tokens=2, messages=MESSAGES).usage.output_tokens


# ---- Ministral: Mistral's call ids through a template that checks them ----------------------

REASONING = "Paris needs a lookup."
MISTRAL_CALL = f'[THINK]{REASONING}[/THINK][TOOL_CALLS]get_weather[ARGS]{{"city": "Paris"}}'
AFTER_TOOL = "It is 18 degrees in Paris"
ID_CHECK = ("{%- if @ID@ is not defined or @ID@ | length != 9 -%}"
            "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif -%}")


@pytest.fixture(scope="module")
def ministral(tmp_path_factory, tiny_ministral):
    """The scripted Ministral, its template checking call ids as Mistral's own templates do."""
    src = tiny_ministral({"[/INST]": MISTRAL_CALL, "[/TOOL_RESULTS]": AFTER_TOOL})
    model_dir = tmp_path_factory.mktemp("strict-ids") / "ministral"
    shutil.copytree(src, model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    template = config["chat_template"]
    for anchor, ident in (("[TOOL_CALLS]{{ fn['name'] }}", "call['id']"),
                          ("[TOOL_RESULTS]{{ text_of(message['content']) }}", "message['tool_call_id']")):
        assert anchor in template
        template = template.replace(anchor, ID_CHECK.replace("@ID@", ident) + anchor)
    config_path.write_text(json.dumps({**config, "chat_template": template}))
    entry = {"name": "ministral", "local_path": str(model_dir),
             "params": {"mem": 16, "max_tokens": 64, "temperature": 0.0, "max_model_len": 4096}}
    text = yaml.safe_dump({"server": {"shutdown_grace_s": 1}, "models": [entry]})
    with serving(tmp_path_factory.mktemp("ministral"), text) as served:
        with anthropic.Anthropic(base_url=served.base_url, api_key="unused", max_retries=0, timeout=60) as c:
            yield c


def test_mistral_call_ids_round_trip(ministral):
    kw = dict(model="ministral", max_tokens=64, tools=[WEATHER], messages=[{"role": "user", "content": "Weather?"}],
              thinking={"type": "enabled", "budget_tokens": 1024})
    msg = ministral.messages.create(**kw)
    assert [b.type for b in msg.content] == ["thinking", "tool_use"] and msg.stop_reason == "tool_use"
    thinking, call = msg.content
    assert thinking.thinking == REASONING
    assert re.fullmatch(r"toolu_[A-Za-z0-9]{9}", call.id), call.id
    assert (call.name, call.input) == ("get_weather", {"city": "Paris"})
    _, final = streamed(ministral, **kw)
    assert [(b.type, getattr(b, "thinking", None), getattr(b, "input", None)) for b in final.content] == \
        [("thinking", REASONING, None), ("tool_use", None, {"city": "Paris"})]

    history = [*kw["messages"], msg.to_param(), {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": "18 C"}]}]}]
    again = ministral.messages.create(**{**kw, "messages": history})
    assert [(b.type, b.text) for b in again.content] == [("text", AFTER_TOOL)] and again.stop_reason == "end_turn"
    # Ids made elsewhere (real Claude's, 24 characters) are fitted to 9, the same for the
    # call and its result, where the template would refuse them.
    foreign = "toolu_01A09q90qw90lq917835lq9"
    history[1] = {"role": "assistant", "content": [
        {"type": "tool_use", "id": foreign, "name": "get_weather", "input": {"city": "Paris"}}]}
    history[-1]["content"][0]["tool_use_id"] = foreign
    again = ministral.messages.create(**{**kw, "messages": history})
    assert [(b.type, b.text) for b in again.content] == [("text", AFTER_TOOL)]


def test_an_error_mid_stream_is_one_error_event(tmp_path, tiny_model_dir):
    """Once a stream has started, a failure is one ``error`` event, then the end; after it,
    requests get an HTTP error in Anthropic's shape."""
    with serving(tmp_path, tiny_yaml(tiny_model_dir, {"on_engine_death": "stay"})) as served:
        body = {"model": "tiny", "max_tokens": 1500, "messages": MESSAGES, "stream": True}
        with httpx.stream("POST", served.base_url + "/v1/messages", json=body, timeout=30) as r:
            chunks = r.iter_raw()
            head = next(chunks)
            assert head.startswith(b"event: message_start\n")

            def broken_step() -> bool:  # a fault on the MLX thread, as tests/api/test_faults.py injects it
                raise RuntimeError("injected fault")

            served.state.worker.add_stepper(broken_step, lambda exc: None)
            frames = parse_frames(head + b"".join(chunks), named=True)
        assert [f.name for f in frames][-1] == "error" and "message_stop" not in [f.name for f in frames]
        error = frames[-1].json()["error"]
        assert error["type"] == "overloaded_error" and "injected fault" in error["message"]
        r = served.post("/v1/messages", {**body, "stream": False})
        assert_anthropic_error(r, 503, "overloaded_error")
        assert int(r.headers["retry-after"]) > 0
