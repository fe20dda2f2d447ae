"""A real ``tandem serve`` loading an ``hf_id`` model from a hub, hostile or not.

The server fetches a hub model only through ``app.engine.models.hub`` (every name and hash checked),
never through mlx-lm's own ``snapshot_download``, which writes wherever a mirror's ETag points.
A hostile mirror in ``HF_ENDPOINT`` then costs that model's load (503 ``model_unavailable`` in
OpenAI's shape), never a file outside the cache, and the server keeps serving its other models.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.api.serving import assert_openai_error
from tests.conftest import REPO, free_port
from tests.service.fake_hub import COMMIT, FakeHub

REPO_ID = "tandem-test/tiny-llama"


@pytest.fixture()
def hub(tiny_model_dir) -> Iterator[FakeHub]:
    fake = FakeHub()
    fake.add_repo(REPO_ID, tiny_model_dir)
    server, url = fake.serve()
    fake.url = url  # type: ignore[attr-defined]
    yield fake
    server.shutdown()


@pytest.fixture()
def serve(tmp_path, tiny_model_dir) -> Iterator:
    """Start ``python -m app serve`` on the tiny local model (the default) plus ``hubbed``, an
    ``hf_id`` entry, with its Hugging Face and Tandem caches under ``tmp_path``."""
    procs: list[subprocess.Popen] = []

    def start(endpoint: str) -> str:
        models = tmp_path / "models.yaml"
        params = {"mem": 16, "max_tokens": 2, "temperature": 0.0}
        models.write_text(yaml.safe_dump({"server": {"shutdown_grace_s": 1}, "models": [
            {"name": "tiny", "local_path": str(tiny_model_dir), "params": params},
            {"name": "hubbed", "hf_id": REPO_ID, "params": params}]}))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
        env |= {"HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"), "TANDEM_CACHE_DIR": str(tmp_path / "tc"),
                "HF_HUB_DISABLE_TELEMETRY": "1"}
        port = free_port()
        log = open(tmp_path / "server.log", "wb")
        proc = subprocess.Popen([sys.executable, "-m", "app", "serve", "--models-file", str(models), "--port",
                                 str(port), "--log-level", "info"], cwd=REPO, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        procs.append(proc)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline, "server did not start"
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    return base
            except httpx.TransportError:
                time.sleep(0.1)

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=30)


def chat(base: str, model: str) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", timeout=120,
                      json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def test_the_server_downloads_a_hub_model_through_the_checked_fetcher(tmp_path, hub, serve):
    base = serve(hub.url)
    r = chat(base, "hubbed")
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
    snapshot = tmp_path / "hf" / "hub" / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT
    assert (snapshot / "config.json").is_file() and (snapshot / "model.safetensors").is_file()
    # The fetcher's way: one listing with the hashes, then GETs; huggingface_hub's own download
    # asks each file's metadata with HEAD first.
    assert [req for req in hub.requests if req[0] == "HEAD"] == []
    assert any(path.startswith(f"/api/models/{REPO_ID}") for _, path, _ in hub.requests)
    log = (tmp_path / "server.log").read_text()
    assert f"downloading {REPO_ID}" in log and "pulling" in log, log


def escape_absolute(fake: FakeHub, tmp_path: Path) -> None:
    (tmp_path / "outside").mkdir()
    fake.etags = {name: str(tmp_path / "outside" / f"escaped-{i}") for i, name in enumerate(fake.repos[REPO_ID])}


def escape_upward(fake: FakeHub, tmp_path: Path) -> None:
    fake.etags = {"tokenizer.json": "../../../../escaped"}  # from blobs/ up to tmp_path


def name_upward(fake: FakeHub, tmp_path: Path) -> None:
    fake.add_file(REPO_ID, "../../../../escaped.json", b"{}")  # matches *.json


@pytest.mark.parametrize("hostile", [escape_absolute, escape_upward, name_upward], ids=lambda f: f.__name__)
def test_a_hostile_hub_fails_the_model_not_the_server_and_writes_nothing_outside(tmp_path, hub, serve, hostile):
    hostile(hub, tmp_path)
    base = serve(hub.url)
    answers = [chat(base, "hubbed") for _ in range(2)]  # the second gets the remembered failure
    outside = [str(p) for p in tmp_path.rglob("*") if not p.is_dir()
               and p.parts[len(tmp_path.parts)] not in ("hf", "tc", "models.yaml", "server.log")]
    assert outside == []
    for r in answers:
        err = assert_openai_error(r, 503, "model_unavailable")
        assert "refusing" in err["message"], err
    assert httpx.get(base + "/health", timeout=5).status_code == 200
    assert chat(base, "tiny").status_code == 200  # the other model still serves
    assert "Traceback" not in (tmp_path / "server.log").read_text()
