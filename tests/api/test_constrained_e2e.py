"""Structured output and forced tool calls through the OpenAI API, end to end.

The demo model (SmolLM2-135M, no tool support in its template: tools reach it as
the compact note, calls as bare JSON) answers free text when asked nothing; asked
for a schema, its answer must follow it. The scripted tiny Ministral (Mistral's
``[TOOL_CALLS]name[ARGS]{...}`` syntax, ``[THINK]`` reasoning) writes something
else than what is asked, so what comes back is the constraint's doing: its
reasoning is kept word for word, and the rest follows the schema or the tool.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.api.test_ministral_e2e import THINK, served_client

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "sunny": {"type": "boolean"}},
    "required": ["city", "sunny"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                       "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Local time in a timezone",
        "parameters": {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
                       "required": ["tz"], "additionalProperties": False}}},
]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": strict}}


def test_json_schema_answer_follows_the_schema(client: OpenAI) -> None:
    r = client.chat.completions.create(model="demo", messages=USER, max_tokens=48,
                                       response_format=_schema_format(WEATHER))
    jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER)
    assert r.choices[0].finish_reason == "stop"


BOUNDED = {
    "type": "object",
    "properties": {"sky": {"enum": ["clear", "cloudy", "rain"]}, "warm": {"type": "boolean"},
                   "city": {"type": "string", "maxLength": 10}},
    "required": ["sky", "warm", "city"],
}


# Streamed at temperature 1.5 is slow-only:
# test_streamed_json_schema_joins_into_valid_json streams in the default suite.
@pytest.mark.parametrize("stream", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_bounded_schema_holds_at_temperature_1_5(client: OpenAI, stream: bool) -> None:
    """Sampling far from the model's preference: the schema still holds, because what is
    not allowed is never sampled."""
    for seed in (1, 2, 3):
        kw = dict(model="demo", messages=USER, max_tokens=64, temperature=1.5, seed=seed,
                  response_format=_schema_format(BOUNDED, strict=False))
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True)
                           if c.choices)
        else:
            text = client.chat.completions.create(**kw).choices[0].message.content
        jsonschema.validate(json.loads(text), BOUNDED)


def test_the_sdk_parses_a_pydantic_model(client: OpenAI) -> None:
    class Weather(BaseModel):
        city: str = Field(max_length=12)
        sunny: bool

    r = client.chat.completions.parse(model="demo", messages=USER, max_tokens=48, response_format=Weather)
    assert isinstance(r.choices[0].message.parsed, Weather)


def test_streamed_json_schema_joins_into_valid_json(client: OpenAI) -> None:
    stream = client.chat.completions.create(model="demo", messages=USER, max_tokens=48, stream=True,
                                            response_format=_schema_format(WEATHER))
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), WEATHER)


def test_json_object_is_one_object(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model="demo", max_tokens=40, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": 'Give the capital of France as JSON, like {"capital": "..."}.'}])
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_required_tool_choice_calls_a_tool_with_valid_arguments(client: OpenAI) -> None:
    r = client.chat.completions.create(model="demo", messages=USER, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=48)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_named_tool_choice_calls_that_tool(client: OpenAI) -> None:
    r = client.chat.completions.create(
        model="demo", messages=USER, tools=TOOLS, max_tokens=48, parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time"
    assert json.loads(call.function.arguments)["tz"] in ("UTC", "CET")


def test_streamed_forced_call_arrives_as_tool_call_deltas(client: OpenAI) -> None:
    stream = client.chat.completions.create(
        model="demo", messages=USER, tools=TOOLS, max_tokens=48, stream=True, parallel_tool_calls=False,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    args, names, content = "", set(), ""
    for c in stream:
        if not c.choices:
            continue
        delta = c.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            if tc.function and tc.function.name:
                names.add(tc.function.name)
            args += (tc.function.arguments or "") if tc.function else ""
    assert names == {"get_weather"} and content == ""
    jsonschema.validate(json.loads(args), TOOLS[0]["function"]["parameters"])


def test_auto_with_a_response_format_answers_or_calls(client: OpenAI) -> None:
    r = client.chat.completions.create(model="demo", messages=USER, tools=TOOLS, max_tokens=48,
                                       parallel_tool_calls=False, response_format=_schema_format(WEATHER))
    message = r.choices[0].message
    if message.tool_calls:
        assert message.tool_calls[0].function.name in ("get_weather", "get_time")
    else:
        jsonschema.validate(json.loads(message.content), WEATHER)


@pytest.mark.parametrize("response_format, param, fragment", [
    (_schema_format({"type": "object", "properties": {"a": {"type": "strng"}}}), "response_format", "schema"),
    (_schema_format({"$ref": "#/$defs/missing"}), "response_format", "schema"),
    ({"type": "json_schema"}, None, "json_schema"),
    ({"type": "xml"}, None, "response_format"),
])
def test_a_schema_that_cannot_be_compiled_is_a_400(client: OpenAI, response_format, param, fragment) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=USER, max_tokens=8, response_format=response_format)
    body = err.value.body
    assert fragment in body["message"]
    if param:
        assert body["param"] == param


def test_a_bad_tool_schema_under_a_forced_call_is_a_400(client: OpenAI) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "nonsense"}}}}}]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="demo", messages=USER, max_tokens=8, tools=tools,
                                       tool_choice="required")
    assert err.value.body["param"] == "tools" and "'f'" in err.value.body["message"]


# ---- a reasoning model with its own call syntax --------------------------------------

SKY = {"type": "object", "properties": {"sky": {"enum": ["clear", "cloudy"]}}, "required": ["sky"],
       "additionalProperties": False}
CITY_TOOL = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Lyon"]}}, "required": ["city"],
                   "additionalProperties": False}}}]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory, tiny_ministral):
    """Scripted to reason, then answer "It is sunny" in plain text."""
    yield from served_client(tmp_path_factory, tiny_ministral(THINK))


def test_reasoning_stays_free_and_the_answer_follows_the_schema(thinker) -> None:
    client, _ = thinker
    r = client.chat.completions.create(model="ministral", messages=USER, max_tokens=200,
                                       response_format=_schema_format(SKY))
    message = r.choices[0].message
    assert message.reasoning_content == "The user wants weather."
    jsonschema.validate(json.loads(message.content), SKY)


def test_a_forced_call_is_written_in_mistral_syntax_and_parsed(thinker) -> None:
    client, _ = thinker
    r = client.chat.completions.create(model="ministral", messages=USER, tools=CITY_TOOL, max_tokens=200,
                                       tool_choice="required", parallel_tool_calls=False)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert message.reasoning_content == "The user wants weather."
    (call,) = message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Lyon")
    assert not message.content


# ---- the same through Anthropic's Messages API -----------------------------------------


@pytest.fixture()
def claude(demo_server):
    import anthropic

    with anthropic.Anthropic(base_url=demo_server.base_url, api_key="unused", max_retries=0, timeout=120) as c:
        yield c


ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


def test_anthropic_any_tool_choice_forces_one_valid_tool_use(claude) -> None:
    msg = claude.messages.create(model="demo", max_tokens=48, messages=USER, tools=ANTHROPIC_TOOLS,
                                 tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                 extra_body={"temperature": 0.0})
    assert msg.stop_reason == "tool_use"
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    schema = next(t["input_schema"] for t in ANTHROPIC_TOOLS if t["name"] == use.name)
    jsonschema.validate(use.input, schema)


def test_anthropic_output_format_is_followed(claude) -> None:
    msg = claude.messages.create(model="demo", max_tokens=48, messages=USER,
                                 extra_body={"temperature": 0.0,
                                             "output_config": {"format": {"type": "json_schema", "schema": WEATHER}}})
    (text,) = [b.text for b in msg.content if b.type == "text"]
    jsonschema.validate(json.loads(text), WEATHER)


def test_a_bad_schema_is_named_where_each_api_has_it(demo_server) -> None:
    import httpx

    bad = {"type": "object", "properties": {"a": {"type": "strng"}}}
    base = demo_server.base_url
    r = httpx.post(f"{base}/v1/responses", json={
        "model": "demo", "input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": bad}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format"
    r = httpx.post(f"{base}/v1/messages", json={
        "model": "demo", "max_tokens": 8, "messages": USER,
        "output_config": {"format": {"type": "json_schema", "schema": bad}}})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "invalid JSON schema" in r.json()["error"]["message"]


# ---- a grammar limit met while generating -----------------------------------------------------

def exploding(n: int) -> dict:
    """Compiles; llguidance's lexer explodes once the answer is inside the string with a, b and c
    in it. A grammar's lexer is shared by its requests: each test request takes its own ``n``."""
    pattern = f"^(.*a.{{{n}}})|(.*b.{{{n}}})|(.*c.{{{n}}})$"
    return {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}, "required": ["a"],
            "additionalProperties": False}


def _writes_abc(demo_model_dir) -> dict[str, int]:
    """logit_bias that makes the model write '{"a": "abcabc...' (the grammar still masks each
    step, so the property name stays "a"; "a" alone is left unbiased, else it wins the string)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(demo_model_dir / "tokenizer.json"))
    ids = [t for piece in ('{"', '":', ' "', "abc") for t in tok.encode(piece, add_special_tokens=False).ids]
    return {str(t): 100 for t in ids}


def test_a_grammar_limit_mid_run_is_an_error_not_a_stop(client: OpenAI, demo_model_dir) -> None:
    """It was a 200 with finish_reason "stop" and '{"a": "abc' for content."""
    kw = dict(model="demo", messages=USER, max_tokens=24, logit_bias=_writes_abc(demo_model_dir))
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**kw, response_format=_schema_format(exploding(15)))
    body = err.value.body
    assert body["code"] == "grammar_limit_exceeded" and "too many expressions constructed" in body["message"], body
    with client.chat.completions.create(**kw, response_format=_schema_format(exploding(16)), stream=True) as stream:
        with pytest.raises(openai.APIError) as streamed:
            for chunk in stream:
                assert all(c.finish_reason != "stop" for c in chunk.choices), chunk
    assert "JSON schema is beyond the grammar engine's limits" in streamed.value.message
    test_json_schema_answer_follows_the_schema(client)  # the server goes on serving
