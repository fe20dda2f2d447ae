"""The MLX-owner thread: one-off jobs, step jobs interleaved with the batch, failures."""

from __future__ import annotations

import threading

import pytest

from app.engine.worker import MLXWorker
from app.errors import EngineDeadError


@pytest.fixture()
def worker():
    w = MLXWorker()
    w.start()
    yield w
    w.stop()


def test_jobs_run_on_the_one_thread(worker):
    names = {worker.submit(lambda: threading.current_thread().name).result() for _ in range(5)}
    assert names == {"tandem-mlx"}


def test_a_failing_job_fails_only_its_future(worker):
    with pytest.raises(ZeroDivisionError):
        worker.submit(lambda: 1 / 0).result()
    assert worker.submit(lambda: 42).result() == 42 and worker.alive


def test_step_jobs_interleave_with_the_batch(worker):
    """A long job (a caption) advances one step per turn, between batch steps."""
    log: list[str] = []
    batch_steps = iter(range(40))

    def stepper() -> bool:
        if next(batch_steps, None) is None:
            return False
        log.append("text")
        return True

    def caption():
        for _ in range(10):
            log.append("vlm")
            yield
        return "a caption"

    worker.add_stepper(stepper, lambda exc: None)
    assert worker.submit_steps(caption).result(timeout=10) == "a caption"
    first, last = log.index("vlm"), len(log) - 1 - log[::-1].index("vlm")
    assert log[first:last + 1].count("text") >= 9  # text kept moving while the caption ran


def test_step_job_errors_reach_the_caller(worker):
    def broken():
        yield
        raise ValueError("bad image")

    with pytest.raises(ValueError, match="bad image"):
        worker.submit_steps(broken).result(timeout=10)
    assert worker.submit(lambda: "still here").result() == "still here"


def test_a_stopped_worker_refuses_work():
    w = MLXWorker()
    w.start()
    w.stop()
    with pytest.raises(EngineDeadError):
        w.submit(lambda: 1).result(timeout=5)
    with pytest.raises(EngineDeadError):
        w.submit_steps(lambda: iter(())).result(timeout=5)
