"""`tandem ps` and `tandem models`: tables and JSON, from a recorded /health in the model registry's
shape (tests/fixtures/health/registry.json) and from real servers, through the real CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from app.service import status as st
from tests.api.serving import serving, tiny_yaml
from tests.conftest import REPO, free_port
from tests.fixtures.tiny_vlm import build_tiny_qwen2_vl

REGISTRY = json.loads((REPO / "tests" / "fixtures" / "health" / "registry.json").read_text())


def tandem(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


# ---- from a recorded /health in the registry's shape -------------------------------------------

def test_ps_lists_the_models_in_memory_with_their_memory_requests_and_idle_time():
    report = st.ps_report(st.Health("http://127.0.0.1:8000", 200, REGISTRY))
    assert [m["name"] for m in report["models"]] == ["smollm2-135m-instruct", "qwen2-vl-2b",
                                                     "ministral-3-3b-reasoning"]  # not the unloaded one
    assert report["models"][0] == {
        "name": "smollm2-135m-instruct", "role": "chat", "state": "loaded", "pinned": True, "idle_s": 12.5,
        "memory_mb": {"weights": 101.2, "kv_budget": 512.0, "kv_used": 3.4},
        "requests": {"running": 1, "waiting": 0}, "error": None}
    assert report["memory"]["used_mb"] == 812
    lines = st.ps_table(report).splitlines()
    assert lines[0].split() == ["NAME", "ROLE", "STATE", "WEIGHTS", "KV", "USED", "/", "BUDGET", "RUNNING",
                                "WAITING", "IDLE"]
    assert lines[1].split() == ["smollm2-135m-instruct", "(pinned)", "chat", "loaded", "101", "MB", "3.4", "MB",
                                "/", "512", "MB", "1", "0", "12s"]
    assert lines[2].split() == ["qwen2-vl-2b", "vision", "loaded", "1.2", "GB", "0.0", "MB", "/", "512", "MB",
                                "0", "2", "67m"]
    assert lines[3].split()[:3] == ["ministral-3-3b-reasoning", "chat", "failed"]
    assert "ministral-3-3b-reasoning: out of memory" in lines[4]
    assert lines[5] == "memory: 812 MB used of 16.0 GB (MLX active 640 MB, peak 700 MB)"


def test_models_shows_every_entry_with_downloaded_and_loaded():
    entries = [st.Entry("smollm2-135m-instruct", "chat", {"builtin": "smollm2-135m-instruct"}),
               st.Entry("qwen2-vl-2b", "vision", {"hf_id": "mlx-community/Qwen2-VL-2B-Instruct-4bit"}),
               st.Entry("ministral-3-3b-reasoning", "chat", {"hf_id": "mlx-community/Ministral-3-3B"}),
               st.Entry("mine", "chat", {"local_path": "~/models/mine"})]
    on_disk = {"smollm2-135m-instruct": True, "qwen2-vl-2b": True, "ministral-3-3b-reasoning": False, "mine": False}
    report = st.models_report(entries, "smollm2-135m-instruct", st.Health("http://h:1", 200, REGISTRY),
                              lambda e: on_disk[e.name])
    assert [(m["name"], m["downloaded"], m["loaded"], m["state"]) for m in report["models"]] == [
        ("smollm2-135m-instruct", True, True, "loaded"), ("qwen2-vl-2b", True, True, "loaded"),
        ("ministral-3-3b-reasoning", False, False, "failed"), ("mine", False, False, "unloaded")]
    rows = [line.split() for line in st.models_table(report).splitlines()]
    assert rows[1] == ["smollm2-135m-instruct", "*", "chat", "yes", "yes", "builtin:", "smollm2-135m-instruct"]
    assert rows[3] == ["ministral-3-3b-reasoning", "chat", "no", "failed", "mlx-community/Ministral-3-3B"]
    assert rows[4] == ["mine", "chat", "no", "no", "local_path:", "~/models/mine"]

    unknown = st.models_report(entries, None, st.Health("http://h:1", error="connection refused"),
                               lambda e: on_disk[e.name])
    assert {m["loaded"] for m in unknown["models"]} == {None} and unknown["server"] == "unreachable"
    table = st.models_table(unknown)
    assert "loaded: unknown, no server at http://h:1 (connection refused)" in table
    assert all(line.split()[3] == "?" for line in table.splitlines()[1:5])


# ---- through the CLI, against real servers -----------------------------------------------------

def test_models_works_with_no_server_and_finds_what_is_on_disk(tmp_path, tiny_model_dir):
    models = tmp_path / "models.yaml"
    models.write_text(yaml.safe_dump({"server": {"port": free_port()}, "models": [
        {"name": "tiny", "local_path": str(tiny_model_dir)},
        {"name": "gone", "local_path": str(tmp_path / "nothing-here")},
        {"name": "hub", "hf_id": "tandem-test/never-pulled"}]}))
    env = {"HF_HOME": str(tmp_path / "hf"), "TANDEM_URL": ""}
    r = tandem("models", "--models-file", str(models), "--json", env=env)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["server"] == "unreachable"
    assert [(m["name"], m["downloaded"], m["loaded"]) for m in report["models"]] == [
        ("tiny", True, None), ("gone", False, None), ("hub", False, None)]
    table = tandem("models", "--models-file", str(models), env=env)
    assert table.returncode == 0 and "loaded: unknown, no server at http://127.0.0.1:" in table.stdout


def test_ps_with_no_server_says_so_in_one_line(tmp_path):
    r = tandem("ps", "--url", f"http://127.0.0.1:{free_port()}")
    assert r.returncode == 1 and r.stderr.startswith("tandem: no Tandem server at") and "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def chat_and_vision_server(tmp_path_factory, tiny_model_dir):
    """Today's server with two models: the tiny chat model, and a tiny Qwen2-VL captioning for it."""
    tmp = tmp_path_factory.mktemp("ps-today")
    vlm = build_tiny_qwen2_vl(tmp / "vlm")
    text = tiny_yaml(tiny_model_dir, vision={}).replace(
        str(tiny_model_dir.parent / "no-such-vlm"), str(vlm))
    with serving(tmp, text) as served:
        assert served.state.vision.available, served.state.vision.reason
        yield served, tmp / "models.yaml"


def test_ps_and_models_with_a_proxy_vision_model(chat_and_vision_server):
    served, models = chat_and_vision_server
    ps = json.loads(tandem("ps", "--json", env={"TANDEM_URL": served.base_url + "/v1"}).stdout)
    assert ps["url"] == served.base_url and ps["status"] == "ok"
    assert [(m["name"], m["role"], m["state"]) for m in ps["models"]] == [("tiny", "chat", "loaded"),
                                                                          ("vlm", "vision", "loaded")]
    assert ps["models"][0]["requests"] == {"running": 0, "waiting": 0}
    table = tandem("ps", "--url", served.base_url).stdout.splitlines()
    rows = [line.split()[:3] for line in table[1:] if line.strip() and not line.startswith("memory")]
    assert rows == [["tiny", "chat", "loaded"], ["vlm", "vision", "loaded"]]
    assert any(line.startswith("memory") for line in table), table  # the budget, under the models

    report = json.loads(tandem("models", "--models-file", str(models), "--url", served.base_url, "--json").stdout)
    assert [(m["name"], m["role"], m["downloaded"], m["loaded"]) for m in report["models"]] == [
        ("tiny", "chat", True, True), ("vlm", "vision", True, True)]


def test_ps_against_a_registry_serving_two_chat_models(tmp_path, tiny_model_dir):
    """Two chat entries, both served: each with its own weights, KV budget and requests."""
    text = yaml.safe_dump({"server": {"shutdown_grace_s": 1}, "models": [
        {"name": "tiny", "local_path": str(tiny_model_dir), "params": {"mem": 16}},
        {"name": "tiny-b", "local_path": str(tiny_model_dir), "params": {"mem": 32}}]})
    with serving(tmp_path, text) as served:
        for name in ("tiny", "tiny-b"):  # loads each (on demand, under the registry)
            assert served.post("/v1/completions", {"model": name, "prompt": "Hi", "max_tokens": 1}).status_code == 200
        ps = json.loads(tandem("ps", "--json", "--url", served.base_url).stdout)
        assert {m["name"] for m in ps["models"]} == {"tiny", "tiny-b"}
        for m in ps["models"]:
            assert m["state"] == "loaded" and m["memory_mb"]["weights"] > 0 and m["idle_s"] is not None
        assert sorted(m["memory_mb"]["kv_budget"] for m in ps["models"]) == [16, 32]
        assert ps["memory"]["used_mb"] > 0
        listed = {m["id"]: m for m in served.get("/v1/models").json()["data"]}
        assert listed["tiny"]["loaded"] is True and listed["tiny-b"]["loaded"] is True
        models_file = tmp_path / "models.yaml"
        report = json.loads(tandem("models", "--models-file", str(models_file), "--url", served.base_url,
                                   "--json").stdout)
        assert [(m["name"], m["loaded"]) for m in report["models"]] == [("tiny", True), ("tiny-b", True)]

