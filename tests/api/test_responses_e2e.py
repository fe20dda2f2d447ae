"""The Responses API end to end: the demo model, a real server, the official openai SDK.

SmolLM2-135M copies a pattern it has seen (tests/api/test_tools_e2e.py): a few
earlier turns whose answers are tool calls, reasoning or JSON make it write the
same, so the real template, engine and parser run on real generated text.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.responses import (
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseIncompleteEvent,
    ResponseInProgressEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseReasoningTextDeltaEvent,
    ResponseReasoningTextDoneEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
)

from tests.api.serving import assert_openai_error, serving, tiny_yaml
from tests.api.sse_frames import parse_frames, read_stream
from tests.vision.sample_images import data_url, image_bytes

TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def shots(question: str, answer: str, n: int = 2) -> list[dict]:
    """``n`` earlier turns answered with ``answer``, then the question again."""
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}] * n + [
        {"role": "user", "content": question}]


CALL_SHOT = shots("Weather in Paris?", CALL)
THINK_SHOT = shots("Capital of France?", "<think>The user wants the capital.</think>The capital is Paris.")

# Each stream event type, as the SDK parses it.
TYPED = {
    "response.created": ResponseCreatedEvent, "response.in_progress": ResponseInProgressEvent,
    "response.output_item.added": ResponseOutputItemAddedEvent,
    "response.output_item.done": ResponseOutputItemDoneEvent,
    "response.content_part.added": ResponseContentPartAddedEvent,
    "response.content_part.done": ResponseContentPartDoneEvent,
    "response.output_text.delta": ResponseTextDeltaEvent, "response.output_text.done": ResponseTextDoneEvent,
    "response.reasoning_text.delta": ResponseReasoningTextDeltaEvent,
    "response.reasoning_text.done": ResponseReasoningTextDoneEvent,
    "response.function_call_arguments.delta": ResponseFunctionCallArgumentsDeltaEvent,
    "response.function_call_arguments.done": ResponseFunctionCallArgumentsDoneEvent,
    "response.completed": ResponseCompletedEvent, "response.incomplete": ResponseIncompleteEvent,
}


def _seq(*names: str, many: bool = False) -> str:
    body = "".join(re.escape(n) + " " for n in names)
    return f"(?:{body})*" if many else body


ITEM = {
    "message": _seq("response.content_part.added") + _seq("response.output_text.delta", many=True)
    + _seq("response.output_text.done", "response.content_part.done"),
    "reasoning": _seq("response.content_part.added") + _seq("response.reasoning_text.delta", many=True)
    + _seq("response.reasoning_text.done", "response.content_part.done"),
    "function_call": _seq("response.function_call_arguments.delta", many=True)
    + _seq("response.function_call_arguments.done"),
}
ORDER = re.compile(
    _seq("response.created", "response.in_progress")
    + "(?:" + re.escape("response.output_item.added ") + "(?:" + "|".join(ITEM.values()) + ")?"
    + re.escape("response.output_item.done ") + ")*"
    + "(?:response\\.completed|response\\.incomplete) $")


def check_events(events: list) -> object:
    """The stream's typed events are in the documented order, numbered from 0, and each item's
    events name that item; returns the final response."""
    for ev in events:
        assert isinstance(ev, TYPED[ev.type]), ev
    assert [ev.sequence_number for ev in events] == list(range(len(events)))
    types = " ".join(ev.type for ev in events) + " "
    assert ORDER.fullmatch(types), types
    open_item = None
    for ev in events:
        if ev.type == "response.output_item.added":
            open_item = ev
            assert ITEM[ev.item.type]  # a kind of item this server writes
        elif ev.type == "response.output_item.done":
            assert ev.item.id == open_item.item.id and ev.output_index == open_item.output_index
            assert ev.item.type == open_item.item.type
        elif hasattr(ev, "item_id"):
            assert ev.item_id == open_item.item.id and ev.output_index == open_item.output_index
            assert ev.type.split(".")[1] in {"message": ("content_part", "output_text"),
                                             "reasoning": ("content_part", "reasoning_text"),
                                             "function_call": ("function_call_arguments",)}[open_item.item.type]
    ids = {ev.response.id for ev in events if hasattr(ev, "response")}
    assert len(ids) == 1
    return events[-1].response


def shape(response) -> dict:
    """A response with what differs between two runs of one request (ids, times, cache hits) left out."""
    body = response.model_dump(exclude_none=True) if hasattr(response, "model_dump") else dict(response)
    for key in ("id", "created_at", "completed_at"):
        body.pop(key, None)
    body["usage"]["input_tokens_details"].pop("cached_tokens")
    body["output"] = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in body["output"]]
    return body


def test_stream_events_in_order_and_fold_to_the_non_stream_response(client):
    kw = dict(model="demo", input=THINK_SHOT, max_output_tokens=30, temperature=0)
    r = client.responses.create(**kw)
    assert r.status == "completed" and r.object == "response"
    assert [item.type for item in r.output] == ["reasoning", "message"]
    reasoning, message = r.output
    assert reasoning.content[0].text == "The user wants the capital." and reasoning.summary == []
    assert reasoning.encrypted_content is None  # only when include asks for it
    assert r.output_text == "The capital is Paris." and message.status == "completed"
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens

    with client.responses.stream(**kw) as stream:  # the SDK's own accumulator checks the stream too
        events = list(stream)
        accumulated = stream.get_final_response()
    final = check_events(events)
    assert isinstance(events[-1], ResponseCompletedEvent)
    assert shape(final) == shape(r) == shape(accumulated)
    deltas = "".join(ev.delta for ev in events if ev.type == "response.output_text.delta")
    assert deltas == r.output_text


def test_raw_stream_is_named_sse_and_ends_incomplete_at_the_limit(demo_server):
    raw = read_stream(demo_server.base_url, "/v1/responses",
                      {"model": "demo", "input": "Tell me a story.", "max_output_tokens": 3, "stream": True})
    frames = parse_frames(raw, named=True)
    bodies = [f.json() for f in frames]
    assert [b["sequence_number"] for b in bodies] == list(range(len(bodies)))
    last = bodies[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["status"] == "incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["response"]["output"][-1]["status"] == "incomplete"
    assert last["response"]["usage"]["output_tokens"] == 3


def test_non_stream_incomplete_at_max_output_tokens(client):
    r = client.responses.create(model="demo", input="Tell me a story.", max_output_tokens=2, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2 and r.output[-1].status == "incomplete"


def test_reasoning_off_and_its_encrypted_copy(client):
    off = client.responses.create(model="demo", input=THINK_SHOT, max_output_tokens=30, temperature=0,
                                  reasoning={"effort": "none"})
    assert [item.type for item in off.output] == ["message"]
    assert off.output_text == "The capital is Paris."  # the markers never leak into the text

    on = client.responses.create(model="demo", input=THINK_SHOT, max_output_tokens=30, temperature=0, store=False,
                                 reasoning={"effort": "high", "summary": "auto"},
                                 include=["reasoning.encrypted_content"])
    reasoning = on.output[0]
    assert reasoning.type == "reasoning" and reasoning.encrypted_content
    # This model's template cannot switch thinking off: it reasoned anyway. The reasoning is
    # dropped from the answer, and the tokens it took are still reported as reasoning.
    assert off.usage.output_tokens_details.reasoning_tokens == on.usage.output_tokens_details.reasoning_tokens > 0
    assert reasoning.content[0].text.encode() in base64.b64decode(reasoning.encrypted_content.split(":", 1)[1])
    # Codex sends reasoning back with only its encrypted copy: accepted.
    back = {"type": "reasoning", "id": reasoning.id, "summary": [], "encrypted_content": reasoning.encrypted_content}
    again = client.responses.create(model="demo", max_output_tokens=2, temperature=0, store=False, input=[
        *THINK_SHOT, back, on.output[1].model_dump(exclude_none=True), {"role": "user", "content": "And Spain?"}])
    assert again.status in ("completed", "incomplete")


def test_function_call_round_trip(client):
    kw = dict(model="demo", input=CALL_SHOT, tools=TOOLS, max_output_tokens=40, temperature=0)
    r = client.responses.create(**kw)
    (call,) = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert "<tool_call>" not in r.output_text

    events = list(client.responses.create(**kw, stream=True))
    final = check_events(events)
    assert shape(final) == shape(r)
    args = "".join(ev.delta for ev in events if ev.type == "response.function_call_arguments.delta")
    (done,) = [ev for ev in events if ev.type == "response.function_call_arguments.done"]
    assert json.loads(args) == json.loads(done.arguments) == {"city": "Paris"} and done.item_id == final.output[0].id

    history = [*CALL_SHOT, *(item.model_dump(exclude_none=True) for item in r.output),
               {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"temperature_c": 18})}]
    again = client.responses.create(model="demo", input=history, tools=TOOLS, max_output_tokens=8, temperature=0,
                                    extra_body={"extensions": True})
    assert again.status in ("completed", "incomplete")
    assert '"temperature_c": 18' in again.model_extra["extensions"]["prompt"]


def test_previous_response_id_chains_retrieves_and_deletes(client):
    first = client.responses.create(model="demo", input=THINK_SHOT, instructions="Only the first turn's rule.",
                                    max_output_tokens=30, temperature=0)
    second = client.responses.create(model="demo", previous_response_id=first.id, input="And Germany?",
                                     max_output_tokens=2, temperature=0, extra_body={"extensions": True})
    assert second.previous_response_id == first.id
    prompt = second.model_extra["extensions"]["prompt"]
    assert "Capital of France?" in prompt and "The capital is Paris." in prompt and "And Germany?" in prompt
    assert "Only the first turn's rule." not in prompt  # instructions are not carried over, as at OpenAI
    assert prompt.index("The capital is Paris.") < prompt.index("And Germany?")

    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(first.id)
    assert err.value.body["code"] == "response_not_found"
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model="demo", previous_response_id="resp_nope", input="Hi", max_output_tokens=2)
    assert err.value.body["code"] == "previous_response_not_found"
    assert err.value.body["param"] == "previous_response_id"


def test_store_false_keeps_nothing(client, demo_state):
    before = len(demo_state.responses)
    r = client.responses.create(model="demo", input="Hi", max_output_tokens=2, store=False)
    assert r.store is False and len(demo_state.responses) == before
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="demo", previous_response_id=r.id, input="Hi", max_output_tokens=2)


def test_input_image_takes_the_vision_path(client):
    # The demo server's vision model is missing: the image becomes a placeholder, with a warning.
    kw = dict(model="demo", max_output_tokens=2, temperature=0, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"},
        {"type": "input_image", "image_url": data_url(image_bytes()), "detail": "auto"}]}])
    r = client.responses.create(**kw, extra_body={"extensions": True})
    ext = r.model_extra["extensions"]
    assert "[Image 1: not available, no vision model loaded]" in ext["prompt"]
    assert ext["warnings"] and "missing-vlm" in ext["warnings"][0]
    # Tandem's own object only when asked for: OpenAI's shape otherwise.
    assert "extensions" not in client.responses.create(**kw).model_extra


NAMESPACED_CALL = '<tool_call>{"name": "mcp__files__read", "arguments": {"path": "a.txt"}}</tool_call>'


def codex_body(input_items: list[dict]) -> dict:
    """What Codex CLI sends a custom provider with ``wire_api = "responses"``."""
    return {
        "model": "demo", "instructions": "You are Codex, a coding agent.", "input": input_items,
        "tools": [
            {"type": "function", "name": "shell", "description": "Runs a command", "strict": False,
             "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
                            "required": ["command"], "additionalProperties": False}},
            {"type": "namespace", "name": "mcp__files__", "description": "Files", "tools": [
                {"type": "function", "name": "read", "description": "Reads a file",
                 "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}]},
            {"type": "web_search", "external_web_access": False},
            {"type": "custom", "name": "apply_patch", "description": "Patch files",
             "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}},
        ],
        "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": {"effort": "medium", "summary": "auto"},
        "store": False, "stream": True, "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0198a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b", "text": {"verbosity": "low"},
        "max_output_tokens": 40, "temperature": 0,
    }


@pytest.mark.slow  # a sibling in the default suite covers the path
def test_codex_shaped_request_is_served(demo_server, demo_state):
    before = len(demo_state.responses)
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: none."}]},
             *shots("Read a.txt", NAMESPACED_CALL)]
    frames = parse_frames(read_stream(demo_server.base_url, "/v1/responses", codex_body(items)), named=True)
    final = frames[-1].json()["response"]
    assert final["status"] == "completed" and len(demo_state.responses) == before  # store: false
    (call,) = [item for item in final["output"] if item["type"] == "function_call"]
    assert (call["namespace"], call["name"]) == ("mcp__files__", "read")
    assert json.loads(call["arguments"]) == {"path": "a.txt"}
    # The call goes back as Codex sends it, with its output.
    items += [call, {"type": "function_call_output", "call_id": call["call_id"], "output": "hello"}]
    body = {**codex_body(items), "stream": False, "max_output_tokens": 2, "extensions": True}
    r = httpx.post(demo_server.base_url + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    prompt = r.json()["extensions"]["prompt"]
    assert "Sandbox: none." in prompt and "mcp__files__read" in prompt and "hello" in prompt


CODEX_REQUEST = Path(__file__).resolve().parent.parent / "fixtures" / "codex" / "responses_request.json"


def test_recorded_codex_request_streams(tmp_path, tiny_model_dir):
    """The very request Codex CLI 0.169 sends for ``codex exec "say hi"`` (about 5,000 tokens: its
    instructions, 8 function tools, a namespace of 5, web_search) is served, on the tiny model with
    room for it (its rope has no trained length to outgrow)."""
    model_dir = tmp_path / "tiny-long"
    shutil.copytree(tiny_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    body = {**json.loads(CODEX_REQUEST.read_text()), "model": "tiny"}
    with serving(tmp_path, tiny_yaml(model_dir, params={"mem": 64, "max_tokens": 4})) as served:
        frames = parse_frames(read_stream(served.base_url, "/v1/responses", body), named=True)
        final = frames[-1].json()["response"]
        assert frames[-1].name in ("response.completed", "response.incomplete"), frames[-1]
        assert final["usage"]["input_tokens"] > 4000 and final["store"] is False
        assert len(served.state.responses) == 0


def test_each_api_key_sees_only_its_own_responses(tmp_path, tiny_model_dir):
    keys = {"alice": "sk-alice-0123456789", "bob": "sk-bob-0123456789"}
    with serving(tmp_path, tiny_yaml(tiny_model_dir, server={"api_keys": keys})) as served:
        def as_(name: str) -> openai.OpenAI:
            return openai.OpenAI(base_url=served.base_url + "/v1", api_key=keys[name], max_retries=0)

        r = as_("alice").responses.create(model="tiny", input="Hi")
        assert as_("alice").responses.retrieve(r.id).id == r.id
        with pytest.raises(openai.NotFoundError):
            as_("bob").responses.retrieve(r.id)
        with pytest.raises(openai.NotFoundError):
            as_("bob").responses.create(model="tiny", input="Hi", previous_response_id=r.id)
        for method in ("GET", "DELETE"):
            assert httpx.request(method, f"{served.base_url}/v1/responses/{r.id}").status_code == 401
        assert served.post("/v1/responses", {"model": "tiny", "input": "Hi"}).status_code == 401


def test_a_failure_mid_stream_ends_it_with_one_error_event(tmp_path, tiny_model_dir):
    with serving(tmp_path, tiny_yaml(tiny_model_dir, {"on_engine_death": "stay"})) as served:
        body = {"model": "tiny", "input": "Hi", "max_output_tokens": 1500, "stream": True}
        with httpx.stream("POST", served.base_url + "/v1/responses", json=body, timeout=30) as stream:
            chunks = stream.iter_raw()
            raw = next(chunks)
            assert raw.startswith(b"event: response.created\n")

            def broken_step() -> bool:  # a bug on the MLX thread ends its loop (tests/api/test_faults.py)
                raise RuntimeError("injected fault")

            served.state.worker.add_stepper(broken_step, lambda exc: None)
            raw += b"".join(chunks)
        frames = parse_frames(raw, named=True)
        error = frames[-1].json()
        assert frames[-1].name == "error" and error["code"] == "engine_unavailable"
        assert "injected fault" in error["message"] and error["sequence_number"] == len(frames) - 1
        assert not any(f.name in ("response.completed", "response.incomplete") for f in frames)


BAD = [
    ("no model", {"input": "Hi"}, "model"),
    ("empty input", {"model": "demo", "input": []}, "input"),
    ("unknown item", {"model": "demo", "input": [{"type": "item_reference", "id": "x"}]}, "input[0]"),
    ("input_file", {"model": "demo", "input": [{"role": "user", "content": [
        {"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
    ("image by file_id", {"model": "demo", "input": [{"role": "user", "content": [
        {"type": "input_image", "file_id": "f"}]}]}, "input[0].content[0]"),
    ("hosted tool_choice", {"model": "demo", "input": "Hi", "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ("unknown named tool", {"model": "demo", "input": "Hi", "tools": TOOLS,
                            "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ("temperature", {"model": "demo", "input": "Hi", "temperature": 3}, "temperature"),
    ("max_output_tokens", {"model": "demo", "input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ("schema missing", {"model": "demo", "input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format"),
    ("background", {"model": "demo", "input": "Hi", "background": True}, None),
    ("conversation", {"model": "demo", "input": "Hi", "conversation": "conv_1"}, None),
    ("prompt template", {"model": "demo", "input": "Hi", "prompt": {"id": "pmpt_1"}}, None),
    ("unknown model", {"model": "nope", "input": "Hi"}, "model"),
]


@pytest.mark.parametrize("name, body, param", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_openai_errors(demo_server, name, body, param):
    r = httpx.post(demo_server.base_url + "/v1/responses", json=body, timeout=60)
    err = assert_openai_error(r, 404 if name == "unknown model" else 400)
    if param is not None:  # validation errors name the place as "input.0", the adapter's own as "input[0]"
        assert err["param"] is not None and re.sub(r"\[(\d+)\]", r".\1", err["param"]).startswith(
            re.sub(r"\[(\d+)\]", r".\1", param)), err
    assert httpx.get(demo_server.base_url + "/health").json()["status"] == "ok"


def test_input_items_list_as_openai_pages_them(client, demo_server):
    first = client.responses.create(model="demo", input=THINK_SHOT, max_output_tokens=30, temperature=0)
    second = client.responses.create(model="demo", previous_response_id=first.id, input="And Germany?",
                                     max_output_tokens=2, temperature=0)
    page = client.responses.input_items.list(second.id)  # OpenAI's default: the latest first, 20 a page
    items = page.data
    # What the model was given: the chain (the first's input and output), then its own input.
    assert len(items) == len(THINK_SHOT) + len(first.output) + 1 and page.has_more is False
    assert items[0].type == "message" and items[0].role == "user" and items[0].content[0].text == "And Germany?"
    assert [i.id for i in items[1:1 + len(first.output)]] == [o.id for o in reversed(first.output)]
    assert items[-1].content[0].text == THINK_SHOT[0]["content"]
    ids = [i.id for i in items]
    assert len(set(ids)) == len(ids) and all(ids)
    assert (page.first_id, page.last_id) == (ids[0], ids[-1])

    # Pages of 3, oldest first, followed by the SDK's own cursor (after = the page's last id).
    asc = client.responses.input_items.list(second.id, order="asc", limit=3)
    assert len(asc.data) == 3 and asc.has_more is True
    assert [i.id for i in asc] == ids[::-1]  # iterating fetches every page
    # ``before`` (not in SDK 3.x's signature: a query parameter), within ``after``.
    r = demo_server_get(demo_server, f"/v1/responses/{second.id}/input_items",
                        params={"order": "asc", "after": ids[-1], "before": ids[-5], "limit": 2})
    assert [i["id"] for i in r["data"]] == ids[-2:-4:-1] and r["has_more"] is True
    # The first response lists only its own input, with the ids the chain kept.
    firsts = client.responses.input_items.list(first.id, order="asc")
    assert [i.id for i in firsts] == ids[::-1][:len(THINK_SHOT)]

    with pytest.raises(openai.BadRequestError) as err:
        client.responses.input_items.list(second.id, after="msg_nope")
    assert err.value.body["param"] == "after"
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(second.id, limit=0)
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_nope")


def demo_server_get(server, path: str, **kw) -> dict:
    r = httpx.get(server.base_url + path, timeout=60, **kw)
    assert r.status_code == 200, r.text
    return r.json()


def test_logprobs_come_with_include_and_top_logprobs(client):
    kw = dict(model="demo", input="Name a colour.", max_output_tokens=4, temperature=0)
    asked = {**kw, "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    r = client.responses.create(**asked)
    assert r.top_logprobs == 2
    (part,) = r.output[-1].content
    assert len(part.logprobs) == r.usage.output_tokens == 4
    assert b"".join(bytes(t.bytes) for t in part.logprobs).decode() == part.text
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in part.logprobs)
    # The same tokens, and numbers, as chat completions give for the same conversation.
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Name a colour."}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    assert [t.model_dump() for t in part.logprobs] == [t.model_dump() for t in chat.choices[0].logprobs.content]

    with client.responses.stream(**asked) as stream:
        events = list(stream)
    check_events(events)
    streamed = [lp for ev in events if ev.type == "response.output_text.delta" for lp in ev.logprobs]
    assert [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in streamed] == \
        [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in part.logprobs]
    (done,) = [ev for ev in events if ev.type == "response.output_text.done"]
    assert [t.token for t in done.logprobs] == [t.token for t in part.logprobs]

    # Without the include, the content part's logprobs stay empty, top_logprobs or not (as OpenAI's).
    for plain in (client.responses.create(**kw), client.responses.create(**kw, top_logprobs=2)):
        assert plain.output[-1].content[0].logprobs == []
