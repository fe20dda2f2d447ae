"""The Open Responses compliance suite's HTTP tests, against a loopback server.

The suite (openresponses.org/compliance; ``src/lib/compliance-tests.ts`` in the spec's
repository) is TypeScript run by bun over zod schemas generated from the spec's OpenAPI
document: no npm package to install. Its seven tests are ported here as they are
written, each request body as the suite sends it and each check as it makes it:

- every response object (the JSON answer, or a stream's last ``response``) must parse
  as the spec's ``ResponseResource``, and in a stream every event as the streaming event
  its ``type`` names (an event of a type the spec has no schema for is an error);
- then each test's own checks: output present, status ``completed``, a
  ``function_call`` item, the function-call stream events.

The schemas are the spec's, through ``openresponses-types`` (pydantic models generated
from the same OpenAPI document as the suite's zod schemas), validated strictly, as zod
does. The models are scripted tiny Ministrals (tests/fixtures/tiny_ministral.py), so
the answers are known and short: one answers in text, one calls ``get_weather`` (the
suite runs one real model for all seven; a script writes one or the other), and the
image test's picture is captioned by a tiny Qwen2-VL through the vision proxy.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import openresponses_types as spec
import pytest
import yaml
from PIL import Image, ImageDraw
from pydantic import BaseModel, ValidationError

from tests.api.serving import serving
from tests.fixtures.tiny_vlm import build_tiny_qwen2_vl

ANSWER = "Ahoy, hello there friend"
CALL = '[TOOL_CALLS]get_weather[ARGS]{"location": "San Francisco, CA"}'

def heart_png() -> str:
    """The suite's image, drawn: a red heart on a white background, 32x32, as a data URL."""
    img = Image.new("RGB", (32, 32), "white")
    draw = ImageDraw.Draw(img)
    draw.ellipse((4, 6, 16, 18), fill="red")
    draw.ellipse((15, 6, 27, 18), fill="red")
    draw.polygon([(5, 14), (26, 14), (16, 27)], fill="red")
    out = io.BytesIO()
    img.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def srv(tmp_path_factory, tiny_ministral):
    vlm = build_tiny_qwen2_vl(tmp_path_factory.mktemp("or-vlm") / "vlm")
    params = {"mem": 16, "max_tokens": 64, "max_model_len": 4096}
    models = [
        {"name": "talker", "local_path": str(tiny_ministral(ANSWER)), "params": params,
         "capabilities": {"vision_mode": "proxy", "vision_proxy": {"model": "captioner", "max_tokens": 4}}},
        {"name": "caller", "local_path": str(tiny_ministral(CALL)), "params": params},
        {"name": "captioner", "role": "vision", "local_path": str(vlm), "params": {"max_pixels": 56 * 56}},
    ]
    text = yaml.safe_dump({"server": {"shutdown_grace_s": 1}, "models": models})
    with serving(tmp_path_factory.mktemp("open-responses"), text) as served:
        yield served


# ---- the spec's schemas ---------------------------------------------------------------------


def _event_models() -> dict[str, type[BaseModel]]:
    """Each streaming event's ``type`` -> the spec's model of it (the suite's union, by tag)."""
    out: dict[str, type[BaseModel]] = {}
    for name in dir(spec):
        model = getattr(spec, name)
        if name.endswith("StreamingEvent") and isinstance(model, type) and issubclass(model, BaseModel):
            (tag,) = list(model.model_fields["type"].annotation)  # a one-member enum
            out[tag.value] = model
    return out


EVENT_MODELS = _event_models()


def schema_errors(model: type[BaseModel], data: Any) -> list[str]:
    """The ways ``data`` falls short of ``model``, as the suite words them (path: message)."""
    try:
        model.model_validate_json(json.dumps(data), strict=True)
    except ValidationError as exc:
        return [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
    return []


@dataclass
class Sse:
    events: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    final: dict[str, Any] | None = None


def parse_sse(body: str) -> Sse:
    """The suite's ``parseSSEStream``: each event checked against its type's schema, the
    last response.completed / failed / incomplete's ``response`` kept."""
    out = Sse()
    for frame in body.split("\n\n"):
        data = "\n".join(line[5:].strip() for line in frame.split("\n") if line.startswith("data:"))
        if not data or data == "[DONE]":
            continue
        event = json.loads(data)
        out.events.append(event)
        model = EVENT_MODELS.get(event.get("type"))
        if model is None:
            out.errors.append(f"Event validation failed for {event.get('type')}: no such event in the spec")
        else:
            out.errors += [f"Event validation failed for {event['type']}: {e}" for e in schema_errors(model, event)]
        if event.get("type") in ("response.completed", "response.failed", "response.incomplete"):
            out.final = event["response"]
    return out


# ---- the suite's tests ----------------------------------------------------------------------

Validator = Callable[[dict[str, Any], Sse | None], list[str]]


def has_output(r: dict[str, Any], _: Sse | None) -> list[str]:
    return [] if r.get("output") else ["Response has no output items"]


def has_output_type(kind: str) -> Validator:
    def check(r: dict[str, Any], _: Sse | None) -> list[str]:
        found = any(item.get("type") == kind for item in r.get("output") or ())
        return [] if found else [f'Expected output item of type "{kind}" but none found']
    return check


def completed_status(r: dict[str, Any], _: Sse | None) -> list[str]:
    return [] if r.get("status") == "completed" else [f'Expected status "completed" but got "{r.get("status")}"']


def streaming_events(_: dict[str, Any], sse: Sse | None) -> list[str]:
    return [] if sse is not None and sse.events else ["No streaming events received"]


def streaming_schema(_: dict[str, Any], sse: Sse | None) -> list[str]:
    return sse.errors if sse is not None else []


def function_call_events(_: dict[str, Any], sse: Sse | None) -> list[str]:
    assert sse is not None
    kinds = [e.get("type") for e in sse.events]
    errors = []
    for event in ("response.output_item.added", "response.output_item.done"):
        if not any(e.get("type") == event and (e.get("item") or {}).get("type") == "function_call" for e in sse.events):
            errors.append(f"Missing {event} event with function_call item")
    for event in ("response.function_call_arguments.delta", "response.function_call_arguments.done"):
        if event not in kinds:
            errors.append(f"Missing {event} event")
    return errors


WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Get the current weather for a location",
                "parameters": {"type": "object", "properties": {"location": {
                    "type": "string", "description": "The city and state, e.g. San Francisco, CA"}},
                    "required": ["location"]}}
WEATHER_Q = [{"type": "message", "role": "user", "content": "What's the weather like in San Francisco?"}]


@dataclass(frozen=True)
class Case:
    id: str
    model: str
    body: dict[str, Any]
    validators: tuple[Validator, ...]
    streaming: bool = False


CASES = [
    Case("basic-response", "talker",
         {"input": [{"type": "message", "role": "user", "content": "Say hello in exactly 3 words."}]},
         (has_output, completed_status)),
    Case("streaming-response", "talker",
         {"input": [{"type": "message", "role": "user", "content": "Count from 1 to 5."}]},
         (streaming_events, streaming_schema, completed_status), streaming=True),
    Case("system-prompt", "talker", {"input": [
        {"type": "message", "role": "system", "content": "You are a pirate. Always respond in pirate speak."},
        {"type": "message", "role": "user", "content": "Say hello."}]}, (has_output, completed_status)),
    Case("tool-calling", "caller", {"input": WEATHER_Q, "tools": [WEATHER_TOOL]},
         (has_output, has_output_type("function_call"))),
    Case("tool-calling-streaming", "caller", {"input": WEATHER_Q, "tools": [WEATHER_TOOL]},
         (streaming_events, streaming_schema, function_call_events), streaming=True),
    Case("image-input", "talker", {"input": [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "What do you see in this image? Answer in one sentence."},
        {"type": "input_image", "image_url": heart_png()}]}]}, (has_output, completed_status)),
    Case("multi-turn", "talker", {"input": [
        {"type": "message", "role": "user", "content": "My name is Alice."},
        {"type": "message", "role": "assistant", "content": "Hello Alice! Nice to meet you. How can I help you today?"},
        {"type": "message", "role": "user", "content": "What is my name?"}]}, (has_output, completed_status)),
]


def run_case(srv, case: Case) -> tuple[dict[str, Any] | None, list[str]]:
    """The suite's ``runTest``: the response (or the stream's last one) and every error found."""
    r = httpx.post(srv.base_url + "/v1/responses", timeout=120, headers={"Authorization": "Bearer test-key"},
                   json={"model": case.model, **case.body, "stream": case.streaming})
    if r.status_code != 200:
        return None, [f"HTTP {r.status_code}: {r.text}"]
    sse = parse_sse(r.text) if case.streaming else None
    data = sse.final if sse is not None else r.json()
    errors = schema_errors(spec.ResponseResource, data)
    if errors:
        return data, errors
    assert data is not None
    return data, [e for check in case.validators for e in check(data, sse)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_the_suite_passes(srv, case):
    _, errors = run_case(srv, case)
    assert errors == []


# ---- beyond the suite: the values are the ones used, in every copy of the object ------------


def test_sampling_values_are_the_ones_used(srv):
    """Sampled at the model's defaults where the request gives none, and at the request's
    values where it does: the response says which (no nulls)."""
    body = {"model": "talker", "input": "Hi"}
    r = httpx.post(srv.base_url + "/v1/responses", json=body, timeout=60).json()
    defaults = srv.state.config.primary.params  # the talker: the first entry
    assert (r["temperature"], r["top_p"]) == (defaults.temperature, defaults.top_p)
    assert (r["presence_penalty"], r["frequency_penalty"], r["top_logprobs"]) == (
        defaults.presence_penalty, defaults.frequency_penalty, 0)
    asked = {**body, "temperature": 0.25, "top_p": 0.5, "presence_penalty": 0.5, "frequency_penalty": -0.5,
             "top_logprobs": 2, "include": ["message.output_text.logprobs"], "max_tool_calls": 3,
             "safety_identifier": "user-7", "prompt_cache_key": "thread-1", "service_tier": "auto"}
    r = httpx.post(srv.base_url + "/v1/responses", json=asked, timeout=60).json()
    assert {k: r[k] for k in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_logprobs",
                              "max_tool_calls", "safety_identifier", "prompt_cache_key")} == {
        "temperature": 0.25, "top_p": 0.5, "presence_penalty": 0.5, "frequency_penalty": -0.5, "top_logprobs": 2,
        "max_tool_calls": 3, "safety_identifier": "user-7", "prompt_cache_key": "thread-1"}
    assert (r["service_tier"], r["background"]) == ("default", False)
    assert len(r["output"][-1]["content"][0]["logprobs"][0]["top_logprobs"]) == 2


def test_tools_are_echoed_with_strict_as_applied(srv):
    tools = [WEATHER_TOOL, {**WEATHER_TOOL, "name": "get_time", "strict": True}]
    r = httpx.post(srv.base_url + "/v1/responses", json={"model": "caller", "input": WEATHER_Q, "tools": tools},
                   timeout=60).json()
    assert [(t["name"], t["strict"]) for t in r["tools"]] == [("get_weather", False), ("get_time", True)]
    assert r["tools"][0]["parameters"] == WEATHER_TOOL["parameters"]


def test_streamed_and_stored_objects_are_whole_too(srv):
    """Every event's response (created, in_progress, completed) is a whole ResponseResource,
    ``completed_at`` null until the end; the stored copy is the streamed one."""
    r = httpx.post(srv.base_url + "/v1/responses", json={"model": "talker", "input": "Hi", "stream": True},
                   timeout=60)
    sse = parse_sse(r.text)
    assert sse.errors == [] and sse.final is not None
    states = [(e["type"], e["response"]["completed_at"]) for e in sse.events if "response" in e]
    assert [kind for kind, _ in states] == ["response.created", "response.in_progress", "response.completed"]
    assert states[0][1] is None and states[1][1] is None and isinstance(states[2][1], int)
    stored = httpx.get(srv.base_url + f"/v1/responses/{sse.final['id']}", timeout=30).json()
    assert schema_errors(spec.ResponseResource, stored) == [] and stored == sse.final


def test_a_stream_error_event_reads_in_both_shapes():
    """OpenAI's SDKs read ``code`` and ``message`` at the top; the spec's ``error`` holds them too."""
    from app.api.openai.responses import ResponseWriter
    from app.errors import EngineError

    event = json.loads(ResponseWriter(response={}).error(EngineError("the engine stopped")).data)
    assert schema_errors(spec.ErrorStreamingEvent, event) == []
    assert event["message"] == event["error"]["message"] == "the engine stopped" and event["code"]
