"""Embedding jobs are scheduled like chat: refused early, queued within bounds, run in
small steps between chat steps, cancelled with their client, and visible.

A real server with the tiny llama and the real all-MiniLM-L6-v2. On a 2-core CPU
MiniLM encodes some tens of tokens a second, so a few hundred sentences make a
job of minutes: every test abandons its job (the client closes its socket) and
waits for the engine to be idle again.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from tests.api.serving import assert_openai_error, serving

MODEL = "minilm"
# ~16 tokens each: the original code ran 32 of them (~500 tokens, many seconds here) per step.
SENTENCE = "The quick brown fox jumps over the lazy dog near the quiet river bank, number "


def sentences(n: int) -> list[str]:
    return [f"{SENTENCE}{i}." for i in range(n)]


@pytest.fixture(scope="module")
def srv(tmp_path_factory, tiny_model_dir, minilm_dir):
    models = [
        {"name": "tiny", "local_path": str(tiny_model_dir), "params": {"mem": 16, "temperature": 0.0}},
        # One job runs at a time and two may wait: the fourth is a 429.
        {"name": MODEL, "role": "embedding", "builtin": "all-minilm-l6-v2",
         "params": {"max_inputs": 256, "max_jobs": 1, "max_queue": 2, "max_step_ms": 100}},
    ]
    text = yaml.safe_dump({"default_model": "tiny", "server": {"shutdown_grace_s": 1}, "models": models})
    with serving(tmp_path_factory.mktemp("encoder-jobs"), text) as served:
        served.post("/v1/embeddings", {"model": MODEL, "input": "warm up"}, timeout=120)
        yield served


class Job:
    """An embeddings request on a raw socket, so the test decides when its client hangs up."""

    def __init__(self, base_url: str, n: int) -> None:
        url = urlsplit(base_url)
        body = json.dumps({"model": MODEL, "input": sentences(n)}).encode()
        self.sock = socket.create_connection((url.hostname, url.port))
        head = (f"POST /v1/embeddings HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n")
        self.sock.sendall(head.encode() + body)

    def abandon(self) -> None:
        self.sock.close()


def jobs(srv) -> dict:
    return srv.get("/health").json()["models"][MODEL]["requests"]


def metric(srv, name: str, **labels: str) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in {"model": MODEL, **labels}.items())
    for line in srv.get("/metrics").text.splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.split()[-1])
    raise AssertionError(f"{name}{{{want}}} not in /metrics")


def wait_for(check, timeout: float, what: str) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout, f"{what} within {timeout}s"
        time.sleep(0.05)
    return time.monotonic() - started


def running_job(srv, n: int = 200) -> Job:
    job = Job(srv.base_url, n)
    wait_for(lambda: jobs(srv)["running"] == 1, 10, "the job runs")
    return job


@pytest.fixture()
def idle(srv):
    """Each test starts and ends with no encoder job left."""
    wait_for(lambda: jobs(srv) == {"running": 0, "waiting": 0}, 30, "the encoder is idle")
    yield
    wait_for(lambda: jobs(srv) == {"running": 0, "waiting": 0}, 30, "the encoder is idle")


def test_an_abandoned_job_stops(srv, idle):
    cancelled = metric(srv, "tandem_encoder_jobs_total", outcome="cancelled")
    job = running_job(srv)
    time.sleep(0.5)
    job.abandon()
    took = wait_for(lambda: jobs(srv)["running"] == 0, 5, "the abandoned job stops")
    batches = metric(srv, "tandem_encoder_batches_total")
    time.sleep(1.0)
    assert metric(srv, "tandem_encoder_batches_total") == batches, "batches ran after the job was dropped"
    assert metric(srv, "tandem_encoder_jobs_total", outcome="cancelled") == cancelled + 1
    assert took < 5


def test_too_many_inputs_is_an_instant_400_while_a_job_runs(srv, idle):
    job = running_job(srv)
    try:
        started = time.monotonic()
        r = srv.post("/v1/embeddings", {"model": MODEL, "input": ["x"] * 300}, timeout=30)
        assert time.monotonic() - started < 1.0
        err = assert_openai_error(r, 400)
        assert err["param"] == "input" and "256" in err["message"]
    finally:
        job.abandon()


def test_beyond_max_queue_is_a_429_with_retry_after(srv, idle):
    job = running_job(srv)
    statuses: list[httpx.Response | None] = [None] * 4

    def send(i: int) -> None:
        try:
            statuses[i] = srv.post("/v1/embeddings", {"model": MODEL, "input": sentences(20)}, timeout=3)
        except httpx.TimeoutException:  # queued: it gives up, which cancels it
            pass

    try:
        threads = [threading.Thread(target=send, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
            time.sleep(0.1)
        for t in threads:
            t.join()
    finally:
        job.abandon()
    refused = [r for r in statuses if r is not None]
    # One runs, two wait: the other two get 429 at once.
    assert len(refused) == 2, [r.status_code for r in refused]
    for r in refused:
        assert_openai_error(r, 429)
        assert r.headers["retry-after"] == "2"


def test_a_chat_stream_keeps_getting_tokens_during_a_job(srv, idle):
    # What one input costs now (a shared CPU's speed varies by the minute): a step is cut to
    # ~100 ms, so at least one input; the original code ran 32 inputs per step.
    one = []
    for i in range(3):
        started = time.monotonic()
        srv.post("/v1/embeddings", {"model": MODEL, "input": sentences(1)[0] + str(i)}, timeout=60)
        one.append(time.monotonic() - started)
    bound = max(1.0, 8 * sorted(one)[1])
    job = running_job(srv)
    try:
        stamps = []
        started = time.monotonic()
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 12, "stream": True,
                "stream_options": {"include_usage": True}}
        usage = None
        with httpx.stream("POST", srv.base_url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk["choices"]:
                        stamps.append(time.monotonic())
                    usage = chunk.get("usage") or usage
        # (A reader that falls behind gets the tokens pending as one chunk: 12 tokens, fewer chunks.)
        assert usage is not None and usage["completion_tokens"] == 12 and len(stamps) >= 3
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        assert stamps[0] - started < bound and max(gaps) < bound, (bound, stamps[0] - started, gaps)
        assert jobs(srv)["running"] == 1  # the job was running all along
    finally:
        job.abandon()


def test_health_and_metrics_show_the_job(srv, idle):
    job = running_job(srv)
    try:
        waiting = Job(srv.base_url, 3)
        wait_for(lambda: jobs(srv) == {"running": 1, "waiting": 1}, 5, "/health shows both jobs")
        assert metric(srv, "tandem_encoder_jobs_running") == 1
        assert metric(srv, "tandem_encoder_jobs_waiting") == 1
        assert metric(srv, "tandem_encoder_batches_total") > 0
        waiting.abandon()
    finally:
        job.abandon()
