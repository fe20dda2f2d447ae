"""Graceful shutdown of a real `python -m app serve` process on SIGTERM and SIGINT.

On the signal the server stops accepting connections at once, lets running
streams finish within ``server.shutdown_grace_s``, ends what is left with one
error event (never a cut connection), and exits 0.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.api.serving import tiny_yaml
from tests.conftest import REPO, free_port


def start(tmp_path: Path, model_dir: Path, grace: float, procs: list,
          text: str | None = None) -> tuple[subprocess.Popen, str]:
    models = tmp_path / "models.yaml"
    models.write_text(text or tiny_yaml(model_dir, {"shutdown_grace_s": grace}))
    port = free_port()
    log = open(tmp_path / "server.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "serve", "--models-file", str(models), "--port", str(port),
         "--log-level", "warning"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    procs.append(proc)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, (tmp_path / "server.log").read_text()
        assert time.monotonic() < deadline, "server did not start"
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.TransportError:
            time.sleep(0.1)


def stream_then_signal(proc: subprocess.Popen, base: str, sig: int, max_tokens: int) -> tuple[list[dict | str], bool]:
    """Start a stream, send ``sig`` once tokens flow, read the stream to its end.

    Returns the stream's events and whether a new connection was refused meanwhile."""
    events: list[dict | str] = []
    refused = False
    with httpx.stream("POST", base + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
            if len(events) == 2:
                os.kill(proc.pid, sig)
                time.sleep(0.3)  # uvicorn notices the signal within 0.1 s
                try:
                    httpx.get(base + "/health", timeout=2)
                except httpx.ConnectError:
                    refused = True
    return events, refused


@pytest.fixture()
def server_process(tmp_path, tiny_model_dir):
    """Starts `python -m app serve` with a given grace period; kills what is left at the end."""
    procs: list[subprocess.Popen] = []
    yield lambda grace, text=None: start(tmp_path, tiny_model_dir, grace, procs, text)
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_sigint_lets_a_running_stream_finish_then_exits_0(server_process):
    proc, base = server_process(30)
    events, refused = stream_then_signal(proc, base, signal.SIGINT, max_tokens=120)
    assert refused, "the listener was still accepting after the signal"
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert proc.wait(timeout=30) == 0


def test_sigterm_ends_a_stream_past_the_grace_period_with_an_error_event(server_process):
    proc, base = server_process(0.5)
    started = time.monotonic()
    events, refused = stream_then_signal(proc, base, signal.SIGTERM, max_tokens=1900)
    assert refused
    error = events[-1]["error"]
    assert error["type"] == "service_unavailable" and "shutting down" in error["message"]
    assert all("choices" in e for e in events[:-1])
    assert proc.wait(timeout=30) == 0
    assert time.monotonic() - started < 15  # not the 1900 tokens, not uvicorn's own timeout


def test_a_long_engine_step_does_not_hold_the_shutdown(tmp_path, tiny_model_dir):
    """A prefill chunk on a slow machine can take a minute; the MLX thread cannot be
    interrupted inside it. Past the grace period the streams end with their error event
    anyway, and the server stops, instead of waiting for the step."""
    import threading

    from tests.api.serving import serving
    from tests.api.serving import tiny_yaml as yaml_for
    from tests.api.sse_frames import stream_chunks

    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 1900, "stream": True}
    release = threading.Event()
    with serving(tmp_path, yaml_for(tiny_model_dir, {"shutdown_grace_s": 0.5})) as srv:
        chunks = stream_chunks(srv.base_url, "/v1/completions", body, timeout=60)
        raw = [next(chunks)]  # the stream runs

        def long_step() -> bool:  # the MLX thread is stuck in one step until released
            release.wait(60)
            return False

        srv.state.worker.add_stepper(long_step, lambda exc: None)
        time.sleep(0.5)  # the thread is inside it
        srv.server.should_exit = True
        started = time.monotonic()
        raw += chunks
        ended = time.monotonic() - started
        release.set()
    last = json.loads(b"".join(raw).decode().strip().split("\n\n")[-1].removeprefix("data: "))
    assert "shutting down" in last["error"]["message"], last
    assert ended < 10, f"the stream waited {ended:.1f}s for the step"


def test_sigterm_ends_an_embedding_job_with_a_503(server_process, tiny_model_dir):
    """An embedding job past the grace period ends like a chat request: a 503 in OpenAI's
    shape saying why, and the process exits 0 without running the job out."""
    import threading

    import yaml

    models = [{"name": "tiny", "local_path": str(tiny_model_dir), "params": {"mem": 16}},
              {"name": "minilm", "role": "embedding", "builtin": "all-minilm-l6-v2"}]
    proc, base = server_process(0.5, yaml.safe_dump({"server": {"shutdown_grace_s": 0.5}, "models": models}))
    inputs = [f"The quick brown fox jumps over the lazy dog, number {i}." for i in range(400)]
    answer: list[httpx.Response] = []
    job = threading.Thread(target=lambda: answer.append(httpx.post(
        base + "/v1/embeddings", json={"model": "minilm", "input": inputs}, timeout=120)))
    job.start()
    deadline = time.monotonic() + 60
    while httpx.get(base + "/health", timeout=5).json()["models"]["minilm"]["requests"]["running"] != 1:
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.1)
    started = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    job.join(timeout=60)
    assert answer and answer[0].status_code == 503, answer and answer[0].text
    error = answer[0].json()["error"]
    assert error["type"] == "service_unavailable" and "shutting down" in error["message"], error
    assert proc.wait(timeout=30) == 0
    assert time.monotonic() - started < 15


def test_every_model_drains_at_once_and_the_drain_runs_once(tmp_path, tiny_model_dir, caplog):
    """Five models, each with a stream running, while the MLX thread is stuck in a long step:
    past the grace period every model's streams end together (not each model's wait in turn),
    and the drain, which both the signal handler and the app's shutdown ask for, runs once."""
    import threading

    import yaml

    from tests.api.serving import serving
    from tests.api.sse_frames import stream_chunks

    names = [f"m{i}" for i in range(5)]
    params = {"mem": 16, "max_tokens": 1900, "temperature": 0.0}
    text = yaml.safe_dump({"server": {"shutdown_grace_s": 0.5},
                           "models": [{"name": n, "local_path": str(tiny_model_dir), "params": params}
                                      for n in names]})
    release = threading.Event()
    with serving(tmp_path, text) as srv:
        streams = [stream_chunks(srv.base_url, "/v1/completions", {"model": n, "prompt": "Once upon a time",
                                                                     "max_tokens": 1900, "stream": True}, timeout=60)
                   for n in names]
        for chunks in streams:
            next(chunks)  # each one runs

        def long_step() -> bool:  # the MLX thread is stuck in one step until released
            release.wait(60)
            return False

        srv.state.worker.add_stepper(long_step, lambda exc: None)
        time.sleep(0.5)  # the thread is inside it
        with caplog.at_level("WARNING", logger="tandem"):
            srv.server.should_exit = True
            started = time.monotonic()
            tails = [b"".join(chunks) for chunks in streams]
            ended = time.monotonic() - started
            release.set()
    for tail in tails:
        assert b"shutting down" in tail
    # Grace (0.5 s) plus one wait for the MLX thread (2 s), not five of them.
    assert ended < 5, f"the streams ended after {ended:.1f}s"
    assert sum("requests still running" in r.message for r in caplog.records) == 1
