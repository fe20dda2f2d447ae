"""Faults: a dead engine thread gives 503s and an unhealthy /health, never a hang (and, by
default, a drained exit with status 70 for the service manager to restart); a model that
cannot load stops start-up with a message, not a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import httpx
import pytest

from tests.api.serving import assert_openai_error, serving, tiny_yaml
from tests.conftest import REPO, free_port

HI = [{"role": "user", "content": "Hi"}]
FAULT_INJECTOR = REPO / "tests" / "fixtures" / "engine_fault"


@pytest.fixture()
def srv(tmp_path, tiny_model_dir):
    # `stay`: the process outlives its engine, so what clients see meanwhile can be checked.
    with serving(tmp_path, tiny_yaml(tiny_model_dir, {"on_engine_death": "stay"})) as served:
        yield served


def test_dead_engine_thread_means_503_not_a_hang(srv):
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions", timeout=30,
                      json={"model": "tiny", "messages": HI, "max_tokens": 1500, "stream": True}) as stream:
        lines = (line for line in stream.iter_lines() if line)
        assert '"role":"assistant"' in next(lines)

        # A bug in any code on the MLX thread outside a per-request guard ends its loop:
        # a step callback that raises is exactly that.
        def broken_step() -> bool:
            raise RuntimeError("injected fault")

        srv.state.worker.add_stepper(broken_step, lambda exc: None)
        # The running stream ends with one error event, promptly.
        tail = list(lines)
        error = json.loads(tail[-1].removeprefix("data: "))["error"]
        assert error["code"] == "engine_unavailable" and "injected fault" in error["message"]
        assert "[DONE]" not in "".join(tail)

    health = srv.get("/health")
    assert health.status_code == 503
    assert health.json()["status"] == "unhealthy" and "injected fault" in health.json()["engine"]["error"]
    started = time.monotonic()
    for stream in (False, True):
        r = srv.post("/v1/chat/completions", {"model": "tiny", "messages": HI, "stream": stream})
        assert_openai_error(r, 503, "engine_unavailable")
        assert int(r.headers["retry-after"]) > 0
    assert_openai_error(srv.post("/v1/completions", {"model": "tiny", "prompt": "Hi"}), 503, "engine_unavailable")
    # UIs poll the model list to tell whether a server works: it says it does not.
    assert_openai_error(srv.get("/v1/models"), 503, "engine_unavailable")
    assert time.monotonic() - started < 5
    assert "tandem_engine_up 0" in srv.get("/metrics").text


def test_a_model_that_cannot_load_stops_start_up_cleanly(tmp_path, capsys):
    from app.cli import main

    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "llama"}')
    models = tmp_path / "models.yaml"
    models.write_text(f"models:\n  - name: broken\n    local_path: {broken}\n")
    threads = set(threading.enumerate())
    assert main(["serve", "--models-file", str(models), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tandem: model 'broken': cannot load") and "Traceback" not in err
    # Nothing left behind: the MLX thread started for the load has stopped.
    assert not [t for t in set(threading.enumerate()) - threads if t.is_alive()]


def test_top_k_beyond_the_vocabulary_disturbs_no_one(srv):
    """mlx-lm refuses such a top_k mid-batch, which would fail every running request;
    it is read as what it means, no top-k at all."""
    with httpx.stream("POST", srv.base_url + "/v1/chat/completions", timeout=30,
                      json={"model": "tiny", "messages": HI, "max_tokens": 300, "stream": True}) as neighbour:
        lines = (line for line in neighbour.iter_lines() if line)
        next(lines)
        for top_k in (10**12, 49152):
            r = srv.post("/v1/chat/completions", {"model": "tiny", "messages": HI, "max_tokens": 2,
                                                  "temperature": 1.0, "top_k": top_k})
            assert r.status_code == 200, r.text
        events = list(lines)
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)


def test_a_sampler_failing_mid_batch_leaves_the_engine_sampling(srv):
    """A sampler that raises while mx.compile traces it fails its batch; the engine recovers,
    unseeded sampling included (the global PRNG key the tracer left behind is replaced)."""
    import asyncio

    from app.engine.prompt import TokenPrompt
    from app.engine.types import GREEDY, GenerationRequest
    from app.errors import EngineError

    engine = srv.state.engine
    tokens = engine.tokenizer.encode("Hello")

    async def generate(**sampling):
        async for delta in engine.stream(GenerationRequest(TokenPrompt(tokens), max_tokens=2,
                                                           sampling=replace(GREEDY, **sampling))):
            if delta.finish_reason:
                return delta.completion_tokens

    with pytest.raises(EngineError, match="top_k"):
        asyncio.run(generate(temperature=1.0, top_k=10**12))  # straight to the engine, past the API's bound
    assert asyncio.run(generate(temperature=1.0)) == 2
    assert asyncio.run(generate(temperature=0.0)) == 2
    assert srv.get("/health").json()["status"] == "ok"


def _serve_process(models, port: int, log) -> subprocess.Popen:
    """`python -m app serve` with the fault injector loaded (SIGUSR1 kills its MLX thread)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAULT_INJECTOR), str(REPO)])}
    return subprocess.Popen(
        [sys.executable, "-m", "app", "serve", "--models-file", str(models), "--port", str(port),
         "--log-level", "warning"],
        cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_healthy(client: httpx.Client, proc: subprocess.Popen, log_path) -> None:
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, log_path.read_text()
        assert time.monotonic() < deadline, "server did not start"
        try:
            if client.get("/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)


def test_engine_death_drains_then_exits_70_and_a_restart_serves_the_same_client(tmp_path, tiny_model_dir):
    """The default `on_engine_death: exit`: the running stream gets its error event, the process
    exits 70 (so launchd / systemd restart it), and the same process started again (what the
    service manager does) serves the next request of the same client, unchanged."""
    models = tmp_path / "models.yaml"
    models.write_text(tiny_yaml(tiny_model_dir))
    port, log_path = free_port(), tmp_path / "server.log"
    procs: list[subprocess.Popen] = []
    try:
        with open(log_path, "wb") as log, httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            procs.append(_serve_process(models, port, log))
            _wait_healthy(client, procs[0], log_path)
            body = {"model": "tiny", "messages": HI, "max_tokens": 1500, "stream": True}
            with client.stream("POST", "/v1/chat/completions", json=body) as stream:
                lines = (line for line in stream.iter_lines() if line)
                assert '"role":"assistant"' in next(lines)
                os.kill(procs[0].pid, signal.SIGUSR1)
                tail = list(lines)
            error = json.loads(tail[-1].removeprefix("data: "))["error"]
            assert error["code"] == "engine_unavailable" and "engine thread died" in error["message"]
            assert procs[0].wait(timeout=30) == 70
            assert "exiting with status 70" in log_path.read_text()

            procs.append(_serve_process(models, port, log))  # what Restart=on-failure / KeepAlive do
            _wait_healthy(client, procs[1], log_path)
            r = client.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 2})
            assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
