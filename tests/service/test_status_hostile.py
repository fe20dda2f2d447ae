"""`tandem ps` against a /health that is not Tandem's: whatever answers on the port.

It read the whole body with only a per-read timeout (a server trickling one byte a
second held it forever; one sending gigabytes filled memory), printed a traceback
for a JSON body of the wrong shape, and printed the server's texts as they came,
ANSI escapes included (a name that clears the screen or retitles the terminal).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from app.service import status as st
from tests.service.test_status import tandem

Answer = Callable[[BaseHTTPRequestHandler], None]


@contextmanager
def fake_health(answer: Answer) -> Iterator[str]:
    """A server whose GET /health is ``answer``; yields its base URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            try:
                answer(self)
            except OSError:  # the client gave up: what these tests want
                pass

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def json_answer(body: object) -> Answer:
    def answer(h: BaseHTTPRequestHandler) -> None:
        raw = json.dumps(body).encode()
        h.send_response(200)
        h.send_header("content-type", "application/json")
        h.send_header("content-length", str(len(raw)))
        h.end_headers()
        h.wfile.write(raw)
    return answer


def trickle(h: BaseHTTPRequestHandler) -> None:
    h.send_response(200)
    h.send_header("content-length", "100000")
    h.end_headers()
    for _ in range(100):
        h.wfile.write(b" ")
        h.wfile.flush()
        time.sleep(0.2)  # each read is quick; the whole never ends


def flood(h: BaseHTTPRequestHandler) -> None:
    h.send_response(200)
    h.end_headers()
    chunk = b"[" * 65536
    for _ in range(64):  # 4 MB
        h.wfile.write(chunk)


def test_a_trickling_server_is_given_up_on_within_the_timeout():
    with fake_health(trickle) as url:
        started = time.monotonic()
        health = st.fetch_health(url, timeout=1.0)
        assert time.monotonic() - started < 2.0
    assert not health.reachable and "within 1 s" in (health.error or "")


def test_an_endless_body_is_cut_at_the_bound():
    with fake_health(flood) as url:
        health = st.fetch_health(url, timeout=10.0)
    assert health.body is None and "more than 1 MB" in (health.error or "")


WRONG_SHAPES = [
    {"models": {"x": 5}},
    {"models": {"x": {"memory_mb": "lots", "requests": [1], "idle_s": "long", "pinned": "yes"}}},
    {"models": {"x": {"state": "loaded", "memory_mb": {"weights": "a", "kv_budget": True}}}, "memory": "full"},
    {"models": {"x": {"state": "loaded"}}, "memory": {"used_mb": "a", "mlx": 3}},
    {"model": "m", "engine": "broken", "vision": ["proxy"]},
    {"status": "ok", "models": [1, 2]},
]


@pytest.mark.parametrize("body", WRONG_SHAPES, ids=range(len(WRONG_SHAPES)))
def test_a_body_of_the_wrong_shape_prints_no_traceback(body):
    with fake_health(json_answer(body)) as url:
        r = tandem("ps", "--url", url)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        for describe in (st.fetch_health(url).describe(),):  # `tandem service status`'s line
            assert describe.startswith("ok")


def test_a_body_that_is_not_json_is_one_line():
    def answer(h: BaseHTTPRequestHandler) -> None:
        h.send_response(200)
        h.end_headers()
        h.wfile.write(b"[" * 100000)  # json.loads recurses past Python's limit on this

    with fake_health(answer) as url:
        r = tandem("ps", "--url", url)
    assert r.returncode == 1 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_the_servers_texts_reach_the_terminal_without_escapes():
    evil = "\x1b]0;owned\x07\x1b[2J\x1b[31mred\x1b[0m\rback\x08"
    body = {"status": evil, "models": {evil: {"role": evil, "state": "failed", "error": evil}},
            "memory": {"used_mb": 1, "limit_mb": 2}}
    with fake_health(json_answer(body)) as url:
        r = tandem("ps", "--url", url)
        unhealthy = st.Health(url, 503, {"engine": {"error": evil}}).describe()
    assert r.returncode == 0, r.stderr
    for text in (r.stdout, unhealthy):
        assert not any(c in text for c in "\x1b\x07\x08\r"), repr(text)
    assert "red" in r.stdout and "owned" not in r.stdout


def test_printable_keeps_text_and_cuts_the_rest():
    assert st.printable("café ☕ 12 MB") == "café ☕ 12 MB"
    assert st.printable("a\nb\tc\x9bd") == "abcd"
    assert len(st.printable("x" * 10_000)) == 200


def test_a_silent_port_is_not_reachable_in_time():
    with socket.socket() as listener:  # accepts, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        started = time.monotonic()
        health = st.fetch_health(f"http://127.0.0.1:{listener.getsockname()[1]}", timeout=1.0)
        assert time.monotonic() - started < 2.0 and not health.reachable
