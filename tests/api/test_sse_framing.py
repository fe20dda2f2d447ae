"""Every streaming route's bytes: ``data: <json or [DONE]>\\n\\n`` and nothing else, an error
after the start included (``tests/api/sse_frames.py`` says exactly what is checked)."""

from __future__ import annotations

import pytest

from tests.api.serving import serving, tiny_yaml
from tests.api.sse_frames import DONE, parse_frames, read_stream, stream_chunks

Q = "What is the capital of France?"
# Text that looks like SSE framing, to travel inside the JSON (completions echo the prompt).
HOSTILE = "a\r\nb\r\n\r\nc\n\nd\re data: [DONE]\n\n: comment\n\u2028\u2029 é"


def agui_body(max_tokens: int, model: str | None = None) -> dict:
    props: dict = {"max_tokens": max_tokens, **({"model": model} if model else {})}
    return {"threadId": "t", "runId": "r", "state": {}, "tools": [], "context": [], "forwardedProps": props,
            "messages": [{"id": "1", "role": "user", "content": Q}]}


ROUTES = {
    "chat": ("/v1/chat/completions", {"model": "demo", "messages": [{"role": "user", "content": Q}], "max_tokens": 4,
                                      "stream": True, "stream_options": {"include_usage": True}}),
    "completions": ("/v1/completions", {"model": "demo", "prompt": "The capital of France is", "max_tokens": 4,
                                        "stream": True, "stream_options": {"include_usage": True}}),
    "completions-echo": ("/v1/completions", {"model": "demo", "prompt": HOSTILE, "echo": True, "max_tokens": 2,
                                             "stream": True}),
    "agui": ("/v1/agui", agui_body(4)),
    "responses": ("/v1/responses", {"model": "demo", "input": Q, "max_output_tokens": 16, "stream": True}),
    "messages": ("/v1/messages", {"model": "demo", "messages": [{"role": "user", "content": Q}], "max_tokens": 4,
                                  "stream": True}),
}
# Formats whose events are named (``event:`` lines) and end with their own last event, not [DONE].
NAMED = {"/v1/responses": ("response.created", ("response.completed", "response.incomplete")),
         "/v1/messages": ("message_start", ("message_stop",))}


@pytest.mark.parametrize("route", ROUTES)
def test_every_stream_is_framed_with_bare_newlines(demo_server, route):
    path, body = ROUTES[route]
    frames = parse_frames(read_stream(demo_server.base_url, path, body), named=path in NAMED)
    if path in NAMED:
        first, last = NAMED[path]
        assert frames[0].name == first and frames[-1].name in last and len(frames) >= 4
    elif path == "/v1/agui":
        types = [f.json()["type"] for f in frames]
        assert types[0] == "RUN_STARTED" and types[-1] == "RUN_FINISHED" and "TEXT_MESSAGE_CONTENT" in types
    else:
        assert frames[-1].data == DONE and len(frames) >= 3
        assert all(f.json()["object"] in ("chat.completion.chunk", "text_completion") for f in frames[:-1])
    if body.get("echo"):
        assert frames[0].json()["choices"][0]["text"] == HOSTILE


ERROR_ROUTES = {
    "chat": ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": Q}],
                                      "max_tokens": 1500, "stream": True}),
    "completions": ("/v1/completions", {"model": "tiny", "prompt": Q, "max_tokens": 1500, "stream": True}),
    "agui": ("/v1/agui", agui_body(1500, model="tiny")),
    "responses": ("/v1/responses", {"model": "tiny", "input": Q, "max_output_tokens": 1500, "stream": True}),
    "messages": ("/v1/messages", {"model": "tiny", "messages": [{"role": "user", "content": Q}],
                                  "max_tokens": 1500, "stream": True}),
}


@pytest.mark.parametrize("route", ERROR_ROUTES)
def test_an_error_after_the_start_is_framed_the_same(tmp_path, tiny_model_dir, route):
    path, body = ERROR_ROUTES[route]
    with serving(tmp_path, tiny_yaml(tiny_model_dir)) as srv:
        chunks = stream_chunks(srv.base_url, path, body, timeout=30)
        raw = [next(chunks)]  # the stream has started: its status and first event are out

        def broken_step() -> bool:  # ends the engine thread's loop, as in test_faults
            raise RuntimeError("injected fault")

        srv.state.worker.add_stepper(broken_step, lambda exc: None)
        raw += chunks
    frames = parse_frames(b"".join(raw), named=path in NAMED)
    last = frames[-1].json()
    if path in NAMED:
        assert frames[-1].name == "error" and "injected fault" in str(last), last
    elif path == "/v1/agui":
        assert last["type"] == "RUN_ERROR" and last["code"] == "engine_unavailable", last
    else:
        assert last["error"]["code"] == "engine_unavailable" and "injected fault" in last["error"]["message"], last
    assert DONE not in (f.data for f in frames)


GOOD = b'data: {"a":1}\n\ndata: [DONE]\n\n'
BAD = {
    "crlf": b'data: {"a":1}\r\n\r\n',
    "cr": b'data: {"a":"x"}\r\r',
    "comment": b': hello\n\ndata: {"a":1}\n\n',  # a comment other than the keep-alive
    "comment-line": b': keep-alive\ndata: {"a":1}\n\n',
    "empty-event": b'data: {"a":1}\n\n\ndata: {"a":2}\n\n',
    "two-data-lines": b'data: {"a":\ndata: 1}\n\n',
    "unterminated": b'data: {"a":1}\n',
    "not-json": b"data: hello\n\n",
    "not-an-object": b"data: [1]\n\n",
    "no-space": b'data:{"a":1}\n\n',
    "done-not-last": b'data: [DONE]\n\ndata: {"a":1}\n\n',
    "named-without-name": b'data: {"type":"x"}\n\n',
    "named-other-type": b'event: ping\ndata: {"type":"pong"}\n\n',
    "bad-utf8": b'data: {"a":"\xff"}\n\n',
}


def test_the_frame_check_accepts_the_shape():
    assert [f.data for f in parse_frames(GOOD)] == ['{"a":1}', DONE]
    # The keep-alive of a silent stream (server.sse_keepalive_s) is skipped, as SSE readers skip it.
    assert [f.data for f in parse_frames(b': keep-alive\n\n' + GOOD)] == ['{"a":1}', DONE]
    (named,) = parse_frames(b'event: ping\ndata: {"type":"ping"}\n\n', named=True)
    assert named.name == "ping" and named.json() == {"type": "ping"}
    (escaped,) = parse_frames(b'data: {"a":"\\r\\n\\n"}\n\n')  # line breaks inside JSON are escaped
    assert escaped.json() == {"a": "\r\n\n"}


@pytest.mark.parametrize("case", BAD)
def test_the_frame_check_refuses_anything_else(case):
    with pytest.raises((AssertionError, ValueError)):  # ValueError: bad JSON or UTF-8
        parse_frames(BAD[case], named=case.startswith("named"))
