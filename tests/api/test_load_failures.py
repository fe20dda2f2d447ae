"""A model that cannot load, over HTTP (issue 30): a burst of requests costs one load and one
error line, each gets a 503 with the reason and Retry-After at once, the other model keeps
serving, and an admin load tries again at once."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from tests.api.serving import assert_openai_error, serving

HI = [{"role": "user", "content": "Hi"}]


def test_a_burst_for_a_broken_model_costs_one_load(tmp_path: Path, tiny_model_dir: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    models = {"server": {"shutdown_grace_s": 1}, "models": [
        {"name": "tiny", "local_path": str(tiny_model_dir), "params": {"mem": 16, "max_tokens": 1}},
        {"name": "broken", "local_path": str(tmp_path / "no-such-model"), "params": {"mem": 16}}]}
    with caplog.at_level(logging.INFO), serving(tmp_path, yaml.safe_dump(models)) as s:
        def ask(_: int):
            return s.post("/v1/chat/completions", {"model": "broken", "messages": HI})

        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(8)))
        answers += [ask(0) for _ in range(8)]  # and eight more, one after the other
        for r in answers:
            err = assert_openai_error(r, 503, "model_unavailable")
            assert "is not a directory" in err["message"] and "next try in" in err["message"], err
            assert 1 <= int(r.headers["retry-after"]) <= 10
        failed = [rec for rec in caplog.records if "broken: load failed" in rec.getMessage()]
        assert len(failed) == 1, [rec.getMessage() for rec in failed]  # was one per request: 16
        health = s.get("/health").json()["models"]["broken"]
        assert health["state"] == "failed" and "is not a directory" in health["error"]
        assert s.post("/v1/chat/completions", {"model": "tiny", "messages": HI}).status_code == 200
        # The admin load does not wait for the retry time.
        assert_openai_error(s.post("/v1/admin/models/load", {"model": "broken"}), 503, "model_unavailable")
        assert sum("broken: load failed" in rec.getMessage() for rec in caplog.records) == 2
