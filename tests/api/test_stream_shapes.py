"""Stream shapes clients compare with the references, on scripted tiny Ministral models.

What a scripted model writes is known in advance (tests/fixtures/tiny_ministral.py),
so each stream's exact shape can be asserted:

- chat completions: an answer that begins with a tool call opens with the role on that
  call's delta and ``content: null``, as OpenAI's does (llama.cpp's test helpers reject
  an empty content delta there); no ``extensions`` unless the request asks.
- Messages: a tool call's input streams as several ``input_json_delta`` while the model
  writes it, their concatenation the whole JSON, and the anthropic SDK's accumulator
  builds the input from them; a call the parser gives up on halfway ends the stream in
  an ``error`` event, not a turn with half a call in it.
"""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
import yaml

from tests.api.serving import serving
from tests.api.sse_frames import DONE, parse_frames, read_stream

NOTE = "Remember to buy fresh bread, cheese and apples before Sunday"
CALL = f'[TOOL_CALLS]write_note[ARGS]{{"text": "{NOTE}"}}'
BROKEN = "[TOOL_CALLS]write_note[ARGS]{\"text\": unquoted words here}"
WRITE_NOTE = {"name": "write_note", "description": "Write a note",
              "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}
USER = [{"role": "user", "content": "Note it."}]


def _serve(tmp_path_factory, tiny_ministral, script: str):
    entry = {"name": "ministral", "local_path": str(tiny_ministral({"[/INST]": script})),
             "params": {"mem": 16, "max_tokens": 64, "temperature": 0.0, "max_model_len": 4096}}
    text = yaml.safe_dump({"server": {"shutdown_grace_s": 1}, "models": [entry]})
    return serving(tmp_path_factory.mktemp("shapes"), text)


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_ministral):
    """A model whose answer is one tool call with a long argument."""
    with _serve(tmp_path_factory, tiny_ministral, CALL) as s:
        yield s


def chat_chunks(base_url: str, **body) -> list[dict]:
    raw = read_stream(base_url, "/v1/chat/completions", {"model": "ministral", "messages": USER,
                                                          "tools": [{"type": "function", "function": WRITE_NOTE}],
                                                          "stream": True, **body})
    frames = parse_frames(raw)
    assert frames[-1].data == DONE
    return [f.json() for f in frames[:-1]]


def test_chat_stream_that_begins_with_a_tool_call_opens_with_null_content(served):
    chunks = chat_chunks(served.base_url)
    # The role goes out as soon as the request is queued (before the prefill); with tools
    # offered the answer may be a call, so its content is null, as llama.cpp sends it.
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    call = chunks[1]["choices"][0]["delta"]
    assert call == {"tool_calls": [{"index": 0, "id": call["tool_calls"][0]["id"], "type": "function",
                                    "function": {"name": "write_note", "arguments": ""}}]}
    assert not any("role" in c["choices"][0]["delta"] for c in chunks[1:])
    assert not any("content" in c["choices"][0]["delta"] for c in chunks[1:])  # no empty content deltas
    args = "".join(tc["function"]["arguments"] for c in chunks[2:] for tc in c["choices"][0]["delta"].get(
        "tool_calls", []))
    assert json.loads(args) == {"text": NOTE}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert not any("extensions" in c for c in chunks)  # Tandem's own object only when asked for


def test_chat_extensions_only_when_asked(served):
    asked = chat_chunks(served.base_url, extensions=True)
    assert "[TOOL_CALLS]" not in asked[0]["extensions"]["prompt"]  # the prompt the model saw, on the first chunk
    assert not any("extensions" in c for c in asked[1:])
    client = openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0)
    kw = dict(model="ministral", messages=USER, tools=[{"type": "function", "function": WRITE_NOTE}])
    assert "extensions" not in client.chat.completions.create(**kw).model_extra
    r = client.chat.completions.create(**kw, extra_body={"extensions": True})
    assert r.model_extra["extensions"]["tool_call_chunks"][0]["type"] == "start"


def test_messages_stream_tool_input_as_it_is_written(served):
    body = {"model": "ministral", "max_tokens": 64, "messages": USER, "stream": True,
            "tools": [{"name": "write_note", "description": "Write a note",
                       "input_schema": WRITE_NOTE["parameters"]}]}
    events = [f.json() for f in parse_frames(read_stream(served.base_url, "/v1/messages", body), named=True)]
    deltas = [e["delta"]["partial_json"] for e in events
              if e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta"]
    assert len(deltas) > 5, deltas  # the note comes word by word, not in one piece at the end
    assert json.loads("".join(deltas)) == {"text": NOTE}
    assert [e["type"] for e in events][-2:] == ["message_delta", "message_stop"]
    assert events[-2]["delta"]["stop_reason"] == "tool_use"

    with anthropic.Anthropic(base_url=served.base_url, api_key="unused", max_retries=0, timeout=60) as client:
        kw = {k: v for k, v in body.items() if k != "stream"}
        with client.messages.stream(**kw) as stream:
            snapshots = [e.snapshot for e in stream if e.type == "input_json"]
            final = stream.get_final_message()
        whole = client.messages.create(**kw)
    assert len(snapshots) == len(deltas) and snapshots[-1] == {"text": NOTE}
    assert snapshots[0] == {}  # the SDK's partial parse leaves an unfinished string out
    (call,) = final.content
    assert (call.type, call.name, call.input) == ("tool_use", "write_note", {"text": NOTE})
    assert [b.model_dump(exclude={"id", "parsed_output"}) for b in final.content] == \
        [b.model_dump(exclude={"id"}) for b in whole.content]


def test_a_tool_call_broken_halfway_ends_the_messages_stream_in_an_error(tmp_path_factory, tiny_ministral):
    body = {"model": "ministral", "max_tokens": 64, "messages": USER,
            "tools": [{"name": "write_note", "input_schema": WRITE_NOTE["parameters"]}]}
    with _serve(tmp_path_factory, tiny_ministral, BROKEN) as s:
        events = [f.json() for f in parse_frames(read_stream(s.base_url, "/v1/messages", {**body, "stream": True}),
                                                 named=True)]
        whole = s.post("/v1/messages", body).json()
    deltas = "".join(e["delta"].get("partial_json", "") for e in events if e["type"] == "content_block_delta")
    assert deltas.rstrip() == '{"text":'  # what went out still parses as the start of JSON; the rest did not
    assert events[-1]["type"] == "error" and "message_stop" not in [e["type"] for e in events]
    assert events[-1]["error"]["type"] == "api_error" and "tool call" in events[-1]["error"]["message"]
    # Non-streaming, the raw text is the answer, as before.
    assert [b["type"] for b in whole["content"]] == ["text"] and "unquoted words here" in whole["content"][0]["text"]
    assert whole["stop_reason"] == "end_turn"


def test_held_back_logprobs_wait_for_the_opening_chunk():
    """Tokens the parser holds back (a call's marker) before a choice's role has gone out:
    their logprobs ride on the opening chunk, which still carries ``content: null``."""
    from app.api.openai.chat import ChunkWriter
    from app.pipeline.logprobs import LogprobInfo, TokenInfo
    from app.pipeline.results import Step, ToolCallArgsDelta, ToolCallStart

    def lp(token: str) -> LogprobInfo:
        return LogprobInfo(TokenInfo(token, tuple(token.encode()), -0.5))

    writer = ChunkWriter("m", with_logprobs=True)
    assert writer.step(Step([], logprobs=[lp("[TOOL_CALLS]")])) == []
    chunks = writer.step(Step([ToolCallStart(0, "abc", "f"), ToolCallArgsDelta(0, "{}")], logprobs=[lp("f")]))
    first = chunks[0]["choices"][0]
    assert first["delta"]["role"] == "assistant" and first["delta"]["content"] is None
    assert [t["token"] for t in first["logprobs"]["content"]] == ["[TOOL_CALLS]", "f"]
    # A choice that ends with nothing written still opens, its held logprobs on the opening.
    quiet = ChunkWriter("m", with_logprobs=True)
    assert quiet.step(Step([], logprobs=[lp("<")])) == []
    opening, last = quiet.last("stop")
    assert opening["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [t["token"] for t in opening["choices"][0]["logprobs"]["content"]] == ["<"]
    assert last["choices"][0]["finish_reason"] == "stop"


def test_a_plain_content_chunk_is_written_as_the_dict_path_writes_it():
    """The per-token path (``content_json``) gives the bytes ``to_json(chunk(...))`` gives."""
    from app.api.openai.chat import ChunkWriter
    from app.api.streaming import to_json
    from app.pipeline.results import ContentDelta, ReasoningDelta, Step

    writer = ChunkWriter('m "quoted" \u00e9')
    texts = ["plain", 'a "quote" \\ back', "line\nbreak\ttab\r", "\u00e9\u4e2d\U0001f600", "\x00\x1f ctl", " "]
    for i, text in enumerate(texts):
        assert writer.content_json(text, i) == to_json(writer.chunk({"content": text}, index=i))
    writer.first(0)
    assert writer.plain_content(Step([ContentDelta("hi")])) == "hi"
    assert writer.plain_content(Step([ContentDelta("hi")], index=1)) is None  # choice 1 not open: its role goes first
    assert writer.plain_content(Step([ContentDelta("hi")], finish_reason="stop")) is None
    assert writer.plain_content(Step([ReasoningDelta("hm")])) is None
    assert writer.plain_content(Step([ContentDelta("a"), ContentDelta("b")])) is None
