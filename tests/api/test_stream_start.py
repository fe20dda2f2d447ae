"""A stream starts at once and stays alive through a long prefill, and a prefill its client
gave up on is kept for the retry (issue 20, item 2).

Claude Code gives up on a request after 300 s without a byte and sends it again; its
first prompt (4k-20k tokens) takes minutes to prefill on a small machine, and proxies
drop silent streams. So the headers and the format's opening event go out as soon as
the engine has queued the request, a keep-alive follows while nothing else does, and
the KV of a prefill cut short goes to the prefix cache. The MLX thread is held here by
a job on it (as one long prefill step of a big model holds it), so "before the first
token" does not depend on this machine's speed.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.api.serving import serving, tiny_yaml
from tests.api.sse_frames import KEEPALIVE, parse_frames

KEEPALIVE_S = 0.2
LONG = [{"role": "user", "content": "tell me everything about the history of the world " * 40}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory, tiny_model_dir):
    params = {"prefill_chunk_size": 32, "cache_min_tokens": 16, "max_tokens": 4}
    yaml_text = tiny_yaml(tiny_model_dir, server={"sse_keepalive_s": KEEPALIVE_S}, params=params)
    with serving(tmp_path_factory.mktemp("stream-start"), yaml_text) as s:
        yield s


class HeldMLXThread:
    """The MLX thread busy with a job of ours, as with one long prefill step of a big model,
    until ``release``; ``let_run(n)`` lets it take ``n`` loop turns (batch steps), then holds it again."""

    def __init__(self, worker) -> None:
        self.turns: queue.Queue[int | None] = queue.Queue()
        self.held = threading.Semaphore(0)
        self.done = worker.submit_steps(self._job)
        assert self.held.acquire(timeout=30), "the MLX thread never got to the job"

    def _job(self):
        while True:  # a step job runs once per loop turn, before the batch step
            self.held.release()
            turns = self.turns.get(timeout=60)
            if turns is None:
                return
            for _ in range(turns):
                yield

    def let_run(self, turns: int) -> None:
        self.turns.put(turns)
        assert self.held.acquire(timeout=30)

    def release(self) -> None:
        if not self.done.done():
            self.turns.put(None)
        self.done.result(30)


@contextlib.contextmanager
def mlx_thread_held(srv) -> Iterator[HeldMLXThread]:
    held = HeldMLXThread(srv.state.worker)
    try:
        yield held
    finally:
        held.release()


FORMATS = {
    "messages": ("/v1/messages", {"model": "tiny", "messages": LONG, "max_tokens": 4, "stream": True},
                 ["message_start", "ping"]),
    "responses": ("/v1/responses", {"model": "tiny", "input": LONG, "max_output_tokens": 4, "stream": True},
                  ["response.created", "response.in_progress"]),
    "chat": ("/v1/chat/completions", {"model": "tiny", "messages": LONG, "max_tokens": 4, "stream": True},
             ["chat.completion.chunk"]),
    "agui": ("/v1/agui", {"threadId": "t", "runId": "r", "state": {}, "tools": [], "context": [],
                          "forwardedProps": {"max_tokens": 4},
                          "messages": [{"id": "1", "role": "user", "content": LONG[0]["content"]}]},
             ["RUN_STARTED"]),
}


def kind(block: str) -> str:
    """An SSE block's event type (its JSON's ``type`` or ``object``), or the keep-alive comment."""
    if block == KEEPALIVE:
        return block
    data = json.loads(block.split("data: ", 1)[1])
    return data.get("type") or data["object"]


class Reader:
    """A streamed response's SSE blocks, read as they arrive."""

    def __init__(self, r: httpx.Response) -> None:
        self.chunks = r.iter_raw()
        self.raw = b""

    def blocks(self, want: int, within: float) -> list[str]:
        """The first ``want`` blocks, failing after ``within`` seconds."""
        deadline = time.monotonic() + within
        while self.raw.count(b"\n\n") < want:
            assert time.monotonic() < deadline, f"only {self.raw!r} in {within}s"
            self.raw += next(self.chunks)
        return self.raw.decode().split("\n\n")[:want]

    def rest(self) -> bytes:
        """Everything, to the end of the stream."""
        return self.raw + b"".join(self.chunks)


@pytest.mark.parametrize("fmt", FORMATS)
def test_headers_and_opening_event_come_before_the_first_token(srv, fmt):
    path, body, opening = FORMATS[fmt]
    with mlx_thread_held(srv), httpx.stream("POST", srv.base_url + path, json=body,
                                            timeout=httpx.Timeout(60, read=10)) as r:
        # On the old code the status line itself waited for the first token: a ReadTimeout here.
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = Reader(r).blocks(len(opening), within=10)
        assert [kind(b) for b in blocks] == opening
        if fmt == "chat":
            assert json.loads(blocks[0].removeprefix("data: "))["choices"][0]["delta"] == {"role": "assistant",
                                                                                           "content": ""}
        r.close()  # the client leaves: the queued request is cancelled


@pytest.mark.parametrize("fmt, keepalive", [("messages", "ping"), ("responses", KEEPALIVE), ("chat", KEEPALIVE)])
def test_a_silent_stream_is_kept_alive_then_answers(srv, fmt, keepalive):
    path, body, opening = FORMATS[fmt]
    with mlx_thread_held(srv) as held, httpx.stream("POST", srv.base_url + path, json=body, timeout=60) as r:
        reader = Reader(r)
        blocks = reader.blocks(len(opening) + 3, within=10)  # three keep-alives while held
        assert [kind(b) for b in blocks] == opening + [keepalive] * 3
        held.release()
        whole = reader.rest()
    frames = parse_frames(whole, named=fmt != "chat")  # still a well-formed stream, the keep-alives aside
    if fmt == "messages":
        assert frames[-1].name == "message_stop" and "content_block_delta" in [f.name for f in frames]
    elif fmt == "responses":
        assert frames[-1].name in ("response.completed", "response.incomplete")
    else:
        assert frames[-1].data == "[DONE]"


def test_a_prefill_given_up_on_is_resumed_by_the_retry(srv):
    """The client leaves in the middle of the long prompt's chunked prefill; the same request
    again gets the KV prefilled so far from the prefix cache, and answers as a fresh run
    (another cache_salt, so nothing cached) does."""
    engine = srv.state.engine
    prompt = [{"role": "user", "content": "a prompt no other test sends, about the sea and its ships " * 35}]
    body = {"model": "tiny", "messages": prompt, "max_tokens": 4, "temperature": 0}
    with mlx_thread_held(srv) as held, httpx.stream("POST", srv.base_url + "/v1/chat/completions",
                                                    json={**body, "stream": True}, timeout=60) as r:
        reader = Reader(r)  # kept: a dropped iterator closes the response
        reader.blocks(1, within=10)  # queued
        held.let_run(3)  # three prefill chunks of 32 tokens
        r.close()
        deadline = time.monotonic() + 10
        while not engine._cancelled:  # the server saw the client leave
            assert time.monotonic() < deadline
            time.sleep(0.01)
    retry = srv.post("/v1/chat/completions", body).json()
    fresh = srv.post("/v1/chat/completions", {**body, "cache_salt": "fresh"}).json()
    cached, tokens = retry["usage"]["prompt_tokens_details"]["cached_tokens"], retry["usage"]["prompt_tokens"]
    assert 0 < cached < tokens - 32, retry["usage"]  # the prefill was cut short, and resumed there
    assert fresh["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert retry["choices"][0]["message"] == fresh["choices"][0]["message"]
