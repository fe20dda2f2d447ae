"""Faults: a dead engine thread gives 503s and an unhealthy /health, never a hang; a model
that cannot load stops start-up with a message, not a traceback."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.api.serving import assert_openai_error, serving, tiny_yaml

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture()
def srv(tmp_path, tiny_model_dir):
    with serving(tmp_path, tiny_yaml(tiny_model_dir)) as served:
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

    from app.engine.types import GenerationRequest, SamplingParams
    from app.errors import EngineError

    engine = srv.state.engine
    tokens = engine.tokenizer.encode("Hello")

    async def generate(**sampling):
        async for delta in engine.stream(GenerationRequest(tokens, max_tokens=2, sampling=SamplingParams(**sampling))):
            if delta.finish_reason:
                return delta.completion_tokens

    with pytest.raises(EngineError, match="top_k"):
        asyncio.run(generate(temperature=1.0, top_k=10**12))  # straight to the engine, past the API's bound
    assert asyncio.run(generate(temperature=1.0)) == 2
    assert asyncio.run(generate(temperature=0.0)) == 2
    assert srv.get("/health").json()["status"] == "ok"
