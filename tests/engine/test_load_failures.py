"""A model that fails to load (issue 30): remembered with its reason, tried again on the retry
schedule or at once by an admin load, and forgotten once it loads. Before, every request of a
burst loaded it again (8 attempts and 8 error logs for 8 requests)."""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path

import pytest

from app.config.loader import load_models_file
from app.engine.registry import LOAD_RETRY_S, Registry
from app.engine.worker import MLXWorker
from app.errors import ModelLoadError
from app.specs import model_spec


@pytest.fixture()
def worker():
    w = MLXWorker()
    w.start()
    yield w
    w.stop()


def registry(worker: MLXWorker, tmp_path: Path, path: Path, **kw) -> Registry:
    (tmp_path / "models.yaml").write_text(f"models:\n  - name: late\n    local_path: {path}\n    params: {{mem: 16}}\n")
    return Registry(worker, [model_spec(e, None) for e in load_models_file(tmp_path / "models.yaml").models], **kw)


def tries(caplog: pytest.LogCaptureFixture) -> int:
    return sum("late: load failed" in r.getMessage() for r in caplog.records)


def test_the_schedule_backs_off_and_is_documented() -> None:
    assert list(LOAD_RETRY_S) == sorted(LOAD_RETRY_S) and LOAD_RETRY_S[0] >= 5 and LOAD_RETRY_S[-1] >= 60
    limits = (Path(__file__).resolve().parents[2] / "docs/reference/limits.md").read_text()
    assert ", ".join(f"{s:g} s" for s in LOAD_RETRY_S) in limits


def test_a_failed_load_waits_for_its_retry_time(worker, tmp_path, tiny_model_dir, caplog):
    path = tmp_path / "late-model"
    reg = registry(worker, tmp_path, path, load_retry_s=(0.5, 3600.0))

    async def burst(n: int) -> list[ModelLoadError]:
        got = await asyncio.gather(*(reg.acquire_chat("late") for _ in range(n)), return_exceptions=True)
        assert all(isinstance(e, ModelLoadError) for e in got), got
        return got  # type: ignore[return-value]

    async def scenario() -> None:
        first = await burst(8)
        assert tries(caplog) == 1  # the burst waited for one load, and the failure was remembered
        errors = await burst(8)
        assert tries(caplog) == 1
        for err in first + errors:
            assert "is not a directory" in err.message and "next try in" in err.message
            assert err.status_code == 503 and 1 <= int(err.headers["Retry-After"]) <= 1
        await asyncio.sleep(0.6)
        await burst(4)  # the retry time has come: one more load, for the first of them
        assert tries(caplog) == 2
        assert reg.snapshot()["models"]["late"]["state"] == "failed"
        shutil.copytree(tiny_model_dir, path)  # the files arrive, but the second retry time is an hour away:
        await burst(2)  # requests still get the remembered failure,
        assert tries(caplog) == 2
        assert await reg.load("late") == "late"  # and an admin load tries at once
        assert reg.loaded_chat("late") is not None
        lease = await reg.acquire_chat("late")
        lease.release()
        await reg.unload("late")
        shutil.rmtree(path)
        await burst(1)  # a failure after a success starts the schedule again: the first step
        assert tries(caplog) == 3 and "(1 in a row; next try in 0.5s" in caplog.records[-1].getMessage()

    with caplog.at_level(logging.ERROR, logger="tandem.registry"):
        asyncio.run(scenario())
