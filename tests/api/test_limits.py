"""Every limit over HTTP: refused fast, in OpenAI's error shape, and the server keeps serving.

One private server on the tiny model with tight limits, run the way `tandem serve`
runs it (uvicorn's connection limit and backlog included).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.api.serving import assert_openai_error, serving, tiny_yaml
from tests.api.test_anthropic_e2e import assert_anthropic_error
from tests.vision.sample_images import data_url, image_bytes, png_claiming_size

BODY_LIMIT = 4 * 1024 * 1024
VALUE_LIMIT = 100_000
SERVER = {"max_body_bytes": BODY_LIMIT, "max_json_values": VALUE_LIMIT, "max_messages": 4, "max_connections": 8,
          "max_image_bytes": 64 * 1024, "max_image_pixels": 1_000_000}
# One sequence at a time and a queue of one: the third request finds the server full.
PARAMS = {"max_num_seqs": 1, "max_queue": 1, "queue_timeout_s": 2.0}
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory, tiny_model_dir):
    yaml = tiny_yaml(tiny_model_dir, SERVER, PARAMS, vision={"max_images_per_request": 2})
    with serving(tmp_path_factory.mktemp("limits"), yaml) as served:
        yield served


def chat(srv, messages=HI, **kw):
    return srv.post("/v1/chat/completions", {"model": "tiny", "messages": messages, **kw})


def assert_serving(srv):
    assert srv.get("/health").json()["status"] == "ok"
    r = chat(srv, max_tokens=1)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


def test_body_over_the_limit_is_413(srv):
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"x" * BODY_LIMIT + b'"}]}'
    r = srv.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    err = assert_openai_error(r, 413, "request_too_large")
    assert str(BODY_LIMIT) in err["message"]
    # Without a content-length the body is counted as it arrives.
    r = srv.post(
        "/v1/chat/completions", content=iter([body[:1 << 20]] * 5), headers={"content-type": "application/json"}
    )
    assert_openai_error(r, 413, "request_too_large")
    assert_serving(srv)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                                  "/v1/agui"])
def test_a_body_of_too_many_json_values_is_413_before_decoding(srv, path):
    """3 bytes a value on the wire, ~70 once decoded: an ignored field of `{}`s is refused by count."""
    base = {"model": "tiny", "messages": HI, "prompt": "Hi", "input": "Hi", "max_tokens": 1}
    over = json.dumps({**base, "x": [{}] * VALUE_LIMIT}).encode()
    r = srv.post(path, content=over, headers={"content-type": "application/json"})
    if path == "/v1/messages":
        assert "max_json_values" in assert_anthropic_error(r, 413, "request_too_large")
    else:
        assert "max_json_values" in assert_openai_error(r, 413, "request_too_large")["message"]
    # Commas and brackets inside strings are text: a long string of them is one value.
    within = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": '"[{}],' * 200}],
                         "max_tokens": 1, "x": [{}] * (VALUE_LIMIT - 20)}).encode()
    r = srv.post("/v1/chat/completions", content=within, headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    assert_serving(srv)


def test_too_many_messages(srv):
    err = assert_openai_error(chat(srv, HI * 5), 400)
    assert err["param"] == "messages" and "at most 4" in err["message"]


def test_a_long_agent_session_is_not_refused_by_its_message_count(tmp_path, demo_model_dir):
    """600 short messages (a long Claude Code or Codex session: each tool call and result is one)
    pass the default message bound (512 refused them); tokens and bytes bound the request."""
    from tests.fixtures.tiny_llama import TINY_LLAMA, build_tiny_llama

    config = {**TINY_LLAMA, "max_position_embeddings": 8192}
    model_dir = build_tiny_llama(tmp_path / "tiny-long", demo_model_dir, config)
    turns = [{"role": ("user", "assistant")[i % 2], "content": "ok"} for i in range(599)]
    with serving(tmp_path, tiny_yaml(model_dir, params={"mem": 64})) as served:
        r = served.post("/v1/chat/completions", {"model": "tiny", "messages": [*turns, *HI], "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] > 3000


def test_megabyte_prompts_are_refused_before_tokenizing(srv):
    """2 MB of prompt would take seconds of tokenizer CPU each; they are refused by length."""
    huge = "word " * 400_000
    requests = [("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": huge}]}),
                ("/v1/completions", {"model": "tiny", "prompt": huge})] * 3

    def send(req):
        started = time.monotonic()
        return srv.post(*req), time.monotonic() - started

    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(send, requests))
        health_started = time.monotonic()
        assert srv.get("/health").status_code == 200
        assert time.monotonic() - health_started < 1.0
    for r, took in results:
        err = assert_openai_error(r, 400, "context_length_exceeded")
        assert "characters" in err["message"]
        assert took < 2.0, took
    assert_serving(srv)


def test_a_dense_script_under_the_character_cut_is_refused_at_a_context_worth_of_tokenizing(srv):
    """330,000 CJK characters pass the character cut of the 2,048-token model (331,776) and were
    ~900,000 tokens, seconds each; now tokenizing stops once the count is past the context."""
    cjk = "".join(chr(0x4E00 + (i * 7919) % 0x5000) for i in range(330_000))
    for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": cjk}]}),
                       ("/v1/completions", {"prompt": cjk}),
                       ("/v1/messages", {"max_tokens": 1, "messages": [{"role": "user", "content": cjk}]})]:
        started = time.monotonic()
        r = srv.post(path, {"model": "tiny", **body})
        took = time.monotonic() - started
        if path == "/v1/messages":
            assert "maximum context length is 2048 tokens" in assert_anthropic_error(r, 400, "invalid_request_error")
        else:
            err = assert_openai_error(r, 400, "context_length_exceeded")
            assert "maximum context length is 2048 tokens" in err["message"], err
        assert took < 1.5, (path, took)
    assert_serving(srv)


def test_max_tokens_beyond_the_context_is_clamped_and_a_prompt_beyond_it_refused(srv):
    """max_tokens is clamped to what the context leaves (clients routinely ask for more);
    only a prompt that does not fit is refused, naming the prompt."""
    prompt = " ".join(["hello"] * 2040)
    r = srv.post("/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 5000})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert (
        usage["prompt_tokens"] + usage["completion_tokens"] == 2048
        and r.json()["choices"][0]["finish_reason"] == "length"
    )
    r = srv.post("/v1/completions", {"model": "tiny", "prompt": prompt * 2, "max_tokens": 5})
    assert assert_openai_error(r, 400, "context_length_exceeded")["param"] == "prompt"


@pytest.mark.parametrize("name, urls, code", [
    ("too many images", [data_url(image_bytes((i, 0, 0))) for i in range(3)], "too_many_images"),
    ("too many bytes", [data_url(bytes(100_000))], "image_too_large"),  # refused before any decode
    ("too many pixels", [data_url(png_claiming_size(2000, 2000))], "image_too_large"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_image_limits(srv, name, urls, code):
    content = [{"type": "text", "text": "Look"}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    assert_openai_error(chat(srv, [{"role": "user", "content": content}]), 400, code)


def stream_lines(srv, max_tokens, stack):
    """Open a streaming chat and return its line iterator once generation runs."""
    r = stack.enter_context(httpx.stream("POST", srv.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": HI, "max_tokens": max_tokens, "stream": True}))
    assert r.status_code == 200
    lines = r.iter_lines()
    next(line for line in lines if '"content":"' in line and '"content":""' not in line)
    return lines


def test_full_queue_429_and_queue_timeout_503(srv):
    """A long stream holds the only slot; the next request waits, the one after finds the
    queue full (429); the waiting one times out (503). A streaming request gets the same 429:
    nothing is sent before the engine has queued it; once queued, its stream starts at once
    (Claude Code gives up after 300 s without a byte), so its queue timeout is an error event."""
    from contextlib import ExitStack

    engine = srv.state.engine
    with ExitStack() as stack:
        running = stream_lines(srv, 1500, stack)  # kept: dropping the iterator closes the stream
        waited = {}
        waiter = threading.Thread(target=lambda: waited.update(r=chat(srv)))
        waiter.start()
        deadline = time.monotonic() + 10
        while engine.stats().waiting < 1:
            assert time.monotonic() < deadline, (engine.stats(), waited)
            time.sleep(0.01)
        for stream in (False, True):
            r = chat(srv, stream=stream)
            assert_openai_error(r, 429, "rate_limit_exceeded")
            assert int(r.headers["retry-after"]) > 0
        waiter.join(timeout=30)
        r = waited["r"]
        assert_openai_error(r, 503, "engine_busy")
        assert int(r.headers["retry-after"]) > 0
        r = chat(srv, stream=True)
        assert r.status_code == 200
        data = [json.loads(line.removeprefix("data: ")) for line in r.text.splitlines() if line.startswith("data: ")]
        assert data[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert data[-1]["error"]["code"] == "engine_busy"  # one error event, then the end
        assert '"finish_reason":null' in next(line for line in running if line)  # still streaming
    deadline = time.monotonic() + 20
    while engine.stats().active:  # the closed stream's sequence is cancelled
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert_serving(srv)


def test_when_every_connection_is_busy_a_request_gets_503_but_health_is_answered(srv):
    """Idle connections make room (tests/api/test_connections.py); busy ones, here each in the
    middle of a request head, do not: a request beyond them gets an OpenAI-shaped 503."""
    limit = srv.state.config.server.max_connections
    host, port = srv.base_url.removeprefix("http://").split(":")
    busy = [socket.create_connection((host, int(port))) for _ in range(limit)]
    try:
        for s in busy:
            s.sendall(b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n")
        time.sleep(0.2)
        r = chat(srv)
        err = assert_openai_error(r, 503, "too_many_connections")
        assert err["type"] == "service_unavailable" and "server.max_connections" in err["message"]
        assert int(r.headers["retry-after"]) > 0 and r.headers["x-request-id"].startswith("req-")
        assert srv.get("/health").json()["status"] == "ok"
    finally:
        for s in busy:
            s.close()
    deadline = time.monotonic() + 10
    while chat(srv, max_tokens=1).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert_serving(srv)


@pytest.mark.parametrize("seed, status", [(-1, 200), (2**64 - 1, 200), (2**64, 400), (-(2**63) - 1, 400)])
def test_seeds_are_64_bit(srv, seed, status):
    """MLX takes an unsigned 64-bit seed: a negative one wraps, a wider one is a 400 (it was a 500)."""
    r = chat(srv, max_tokens=1, temperature=1.0, seed=seed)
    assert r.status_code == status, r.text
    if status == 400:
        assert assert_openai_error(r, 400)["param"] == "seed"


def test_a_burst_of_connections_is_answered_not_reset(tmp_path, tiny_model_dir):
    """200 clients connecting at once, with the default backlog and connection limit."""
    import asyncio

    async def burst(base: str) -> list[int]:
        async with httpx.AsyncClient(base_url=base, timeout=30, limits=httpx.Limits(max_connections=200)) as c:
            return [r.status_code for r in await asyncio.gather(*(c.get("/health") for _ in range(200)))]

    with serving(tmp_path, tiny_yaml(tiny_model_dir)) as defaults:
        assert defaults.state.config.server.backlog >= 1024
        assert asyncio.run(burst(defaults.base_url)) == [200] * 200


def test_a_queued_client_that_hangs_up_leaves_the_queue(tmp_path, tiny_model_dir):
    """A streaming client that gives up while waiting for a slot frees its place at once,
    not when its queue timeout (60 s here) runs out."""
    from contextlib import ExitStack

    params = {"max_num_seqs": 1, "max_queue": 4, "queue_timeout_s": 60.0}
    with serving(tmp_path, tiny_yaml(tiny_model_dir, None, params)) as srv, ExitStack() as stack:
        engine = srv.state.engine
        running = stream_lines(srv, 1500, stack)
        first = engine.stats().kv_reserved_tokens
        with pytest.raises(httpx.TimeoutException):
            srv.post("/v1/chat/completions", {"model": "tiny", "messages": HI, "stream": True}, timeout=1.0)
        deadline = time.monotonic() + 15
        while engine.stats().waiting:
            assert time.monotonic() < deadline, engine.stats()
            time.sleep(0.02)
        # It left while the long stream still held the only slot (not when that one ended).
        stats = engine.stats()
        # (The long stream's reservation grows as it decodes: what it holds plus a step.)
        assert stats.active == 1 and stats.kv_reserved_tokens >= first
        assert '"finish_reason":null' in next(line for line in running if line)
