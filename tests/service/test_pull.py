"""`tandem pull`: progress and resume against a fake hub on loopback, clear refusals offline,
`--isq` through mlx-lm's convert, `--add` keeping models.yaml's comments. Every run is a real
`python -m app pull` process with its own Hugging Face cache."""

from __future__ import annotations

import hashlib
import inspect
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from app.engine.models import hub as fetcher
from tests.conftest import REPO, free_port
from tests.service.fake_hub import COMMIT, FakeHub

REPO_ID = "tandem-test/tiny-llama"


def pull_env(tmp_path: Path, endpoint: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    return {**env, "HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"), "TANDEM_CACHE_DIR": str(tmp_path / "tc"),
            "HF_HUB_DISABLE_TELEMETRY": "1", **extra}


def run_pull(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "app", "pull", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture()
def hub(tiny_model_dir):
    fake = FakeHub()
    fake.add_repo(REPO_ID, tiny_model_dir)
    server, url = fake.serve()
    yield fake, url
    server.shutdown()


def blob_of(tmp_path: Path, name: str, hub: FakeHub) -> Path:
    return tmp_path / "hf" / "hub" / f"models--{REPO_ID.replace('/', '--')}" / "blobs" / hub.repos[REPO_ID][name].etag


def test_the_patterns_are_what_mlx_lm_mlx_vlm_and_mlx_embeddings_fetch():
    from mlx_embeddings.utils import get_model_path as encoder_model_path
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS
    from mlx_vlm.utils import get_model_path

    assert fetcher.CHAT_PATTERNS == DEFAULT_ALLOW_PATTERNS
    source = inspect.getsource(get_model_path)
    assert all(f'"{p}"' in source for p in fetcher.VISION_PATTERNS)
    source = inspect.getsource(encoder_model_path)
    assert all(f'"{p}"' in source for p in fetcher.ENCODER_PATTERNS)


def test_pull_shows_progress_and_fills_the_cache_mlx_lm_reads(tmp_path, hub):
    fake, url = hub
    env = pull_env(tmp_path, url)
    r = run_pull(env, REPO_ID)
    assert r.returncode == 0, r.stderr
    weights = fake.repos[REPO_ID]["model.safetensors"]
    assert f"pulling {REPO_ID} (" in r.stderr
    # One bar for the whole model: bytes done / total [elapsed<ETA, speed].
    assert re.search(r"100%\|.*\| (\S+)/\1 \[\d\d:\d\d<00:00, +[\d.]+[kMG]?B/s\]", r.stderr), r.stderr
    snapshot = Path(r.stdout.strip().rsplit(": ", 1)[-1])
    assert snapshot == tmp_path / "hf" / "hub" / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / COMMIT
    assert hashlib.sha256((snapshot / "model.safetensors").read_bytes()).hexdigest() == weights.sha256

    # What the server does later, offline: mlx-lm finds the snapshot in the cache as it is.
    check = ("from mlx_lm.utils import hf_repo_to_path; from app.engine.models.hub import cached_snapshot; "
             f"print(hf_repo_to_path({REPO_ID!r})); print(cached_snapshot({REPO_ID!r}, 'chat'))")
    found = subprocess.run([sys.executable, "-c", check], cwd=REPO, env={**env, "HF_HUB_OFFLINE": "1"},
                           capture_output=True, text=True, timeout=120)
    assert found.stdout.split() == [str(snapshot)] * 2, found.stderr

    # A second pull finds everything there and fetches no file again.
    fetched = len([r for r in fake.requests if r[0] == "GET" and "/resolve/" in r[1]])
    again = run_pull(env, REPO_ID)
    assert again.returncode == 0 and "already downloaded" in again.stderr
    assert len([r for r in fake.requests if r[0] == "GET" and "/resolve/" in r[1]]) == fetched


def test_an_interrupted_pull_resumes_with_a_range_request(tmp_path, hub):
    fake, url = hub
    fake.rate = 2 * 2**20  # 12 MiB of weights take ~6 s
    env = pull_env(tmp_path, url)
    partial = blob_of(tmp_path, "model.safetensors", fake).with_suffix(".incomplete")
    proc = subprocess.Popen([sys.executable, "-m", "app", "pull", REPO_ID], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not (partial.is_file() and partial.stat().st_size > 2 * 2**20):
            assert proc.poll() is None and time.monotonic() < deadline, "the download did not get going"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # an interruption: nothing gets to clean up
        proc.wait()
    done_before = partial.stat().st_size

    fake.rate = None
    r = run_pull(env, REPO_ID)
    assert r.returncode == 0, r.stderr
    assert "resuming at" in r.stderr
    ranges = [rng for method, path, rng in fake.requests if method == "GET" and path.endswith("model.safetensors")]
    assert ranges[0] is None and ranges[-1] is not None
    assert int(ranges[-1].removeprefix("bytes=").rstrip("-")) >= done_before
    weights = fake.repos[REPO_ID]["model.safetensors"]
    assert hashlib.sha256(blob_of(tmp_path, "model.safetensors", fake).read_bytes()).hexdigest() == weights.sha256


@pytest.mark.parametrize("how", ["HF_HUB_OFFLINE", "no route", "DNS"])
def test_offline_is_one_clear_line_and_exit_1(tmp_path, how):
    endpoint = {"no route": f"http://127.0.0.1:{free_port()}", "DNS": "http://hub.tandem-test.invalid"}.get(
        how, "https://huggingface.co")
    env = pull_env(tmp_path, endpoint, **({"HF_HUB_OFFLINE": "1"} if how == "HF_HUB_OFFLINE" else {}))
    r = run_pull(env, REPO_ID, timeout=60)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("tandem: ")
    if how == "HF_HUB_OFFLINE":
        assert "offline mode is on (HF_HUB_OFFLINE=1)" in r.stderr
    else:
        assert f"cannot reach the Hugging Face hub at {endpoint}" in r.stderr and "are you offline" in r.stderr


def test_unknown_names_and_repos_are_refused_with_exit_2(tmp_path, hub):
    _, url = hub
    env = pull_env(tmp_path, url)
    r = run_pull(env, "no-such-entry")
    assert r.returncode == 2 and "neither an entry" in r.stderr and "Traceback" not in r.stderr
    r = run_pull(env, "tandem-test/missing")
    assert r.returncode == 2 and "no such model" in r.stderr and "Traceback" not in r.stderr


def test_isq_converts_with_mlx_lm_and_add_keeps_the_comments(tmp_path, hub):
    _, url = hub
    env = pull_env(tmp_path, url)
    models = tmp_path / "models.yaml"
    shutil.copy(REPO / "models.yaml", models)
    before = models.read_text()
    r = run_pull(env, REPO_ID, "--isq", "q4", "--add", "--models-file", str(models))
    assert r.returncode == 0, r.stderr
    assert "q4: written" in r.stderr and "converted to" in r.stderr
    out = tmp_path / "tc" / "models" / "tandem-test--tiny-llama-q4"
    import json

    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 4
    after = models.read_text()
    assert after.startswith(before)  # every line and comment as it was, the entry appended
    added = after[len(before):]
    assert "tandem pull --isq q4" in added and "- name: tiny-llama-q4" in added and f"local_path: {out}" in added

    from app.config.loader import load_models_file

    entry = load_models_file(models).find("tiny-llama-q4")
    assert entry is not None and entry.local_path == str(out) and entry.role == "chat"


def test_add_appends_an_hf_id_entry_once_and_models_sees_it_downloaded(tmp_path, hub):
    _, url = hub
    env = pull_env(tmp_path, url, TANDEM_URL=f"http://127.0.0.1:{free_port()}")
    models = tmp_path / "models.yaml"
    models.write_text("models:\n  - name: demo   # mine\n    builtin: smollm2-135m-instruct\n")
    r = run_pull(env, REPO_ID, "--add", "--models-file", str(models))
    assert r.returncode == 0 and f"added tiny-llama to {models}" in r.stdout, r.stderr
    assert models.read_text().startswith("models:\n  - name: demo   # mine\n")
    again = run_pull(env, REPO_ID, "--add", "--models-file", str(models))
    assert again.returncode == 0 and "already has an entry named tiny-llama: not added" in again.stdout
    assert models.read_text().count("- name: tiny-llama") == 1

    import json

    listed = subprocess.run([sys.executable, "-m", "app", "models", "--models-file", str(models), "--json"],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    rows = {m["name"]: m for m in json.loads(listed.stdout)["models"]}
    assert rows["tiny-llama"]["source"] == {"hf_id": REPO_ID} and rows["tiny-llama"]["downloaded"] is True
    assert rows["tiny-llama"]["loaded"] is None  # no server answers


# ---- a hostile or compromised mirror ------------------------------------------------------------

SHA1_LIKE = "a" * 40


def escape_absolute(fake: FakeHub, tmp_path: Path) -> None:
    (tmp_path / "outside").mkdir()
    fake.etags = {name: str(tmp_path / "outside" / f"escaped-{i}") for i, name in enumerate(fake.repos[REPO_ID])}


def escape_upward(fake: FakeHub, tmp_path: Path) -> None:
    fake.etags = {"tokenizer.json": "../../../../escaped"}  # from blobs/ up to tmp_path


def not_a_hash(fake: FakeHub, tmp_path: Path) -> None:
    fake.etags = {"model.safetensors": "not-a-hash", "config.json": "W/not-a-hash"}


def lfs_without_sha256(fake: FakeHub, tmp_path: Path) -> None:
    fake.etags = {"model.safetensors": SHA1_LIKE}


def no_blob_id(fake: FakeHub, tmp_path: Path) -> None:
    fake.etags = {"config.json": ""}


def commit_upward(fake: FakeHub, tmp_path: Path) -> None:
    fake.commit = "../../../../escaped"  # snapshots/<commit>, trees/<commit>.json


def name_upward(fake: FakeHub, tmp_path: Path) -> None:
    fake.add_file(REPO_ID, "../../../../escaped.json", b"{}")  # matches *.json


def name_absolute(fake: FakeHub, tmp_path: Path) -> None:
    fake.add_file(REPO_ID, str(tmp_path / "escaped.json"), b"{}")


def listing_malformed(fake: FakeHub, tmp_path: Path) -> None:
    fake.info_patch = {"siblings": [{"rfilename": 5, "size": 1}, {"size": 2}]}


def wrong_hash(fake: FakeHub, tmp_path: Path) -> None:
    fake.etags = {"model.safetensors": hashlib.sha256(b"other weights").hexdigest()}


HOSTILE = [escape_absolute, escape_upward, not_a_hash, lfs_without_sha256, no_blob_id, commit_upward, name_upward,
           name_absolute, listing_malformed, wrong_hash]


@pytest.mark.parametrize("hostile", HOSTILE, ids=lambda f: f.__name__)
def test_a_hostile_hub_is_refused_and_nothing_lands_outside_the_cache(tmp_path, hub, hostile):
    fake, url = hub
    hostile(fake, tmp_path)
    r = run_pull(pull_env(tmp_path, url), REPO_ID)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.strip().splitlines()
    assert "Traceback" not in r.stderr and [x for x in lines if x.startswith("tandem: ")] == lines[-1:], r.stderr
    if hostile is wrong_hash:  # well formed, so fetched, and then found out
        assert "arrived corrupted" in lines[-1]
    else:  # refused before anything is fetched
        assert len(lines) == 1 and "refusing" in lines[-1], r.stderr
    assert [str(p) for p in tmp_path.rglob("*escaped*")] == []
    cache = tmp_path / "hf" / "hub" / f"models--{REPO_ID.replace('/', '--')}"
    assert not (cache / "snapshots").exists()  # no snapshot: nothing for the loader to find
    if (tmp_path / "outside").exists():
        assert list((tmp_path / "outside").iterdir()) == []
    # Every blob kept is one whose hash was checked: its name is its sha256 / git blob id.
    for blob in (cache / "blobs").glob("*") if (cache / "blobs").exists() else []:
        data = blob.read_bytes()
        assert blob.name in (hashlib.sha256(data).hexdigest(),
                             hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()), blob


@pytest.mark.parametrize("repo_id", ["../..", "owner/..", "owner/../../x", "./x", "owner/na--me", "owner/x..y",
                                     "owner/name\nsecond line", "owner/name?x=1", "owner/name#frag", "own er/name",
                                     "owner/" + "x" * 200, "owner/ná.me", "owner/name.git", "owner\\name/x"])
def test_hostile_repo_ids_are_one_line_and_exit_2(tmp_path, hub, repo_id):
    fake, url = hub
    r = run_pull(pull_env(tmp_path, url), repo_id)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert r.stderr.startswith("tandem: ")
    assert not [req for req in fake.requests if "/resolve/" in req[1]]


@pytest.mark.parametrize("revision", ["../../../../escaped", "/abs", "main\nx"])
def test_hostile_revisions_are_refused(tmp_path, hub, revision):
    _, url = hub
    r = run_pull(pull_env(tmp_path, url), REPO_ID, "--revision", revision)
    assert r.returncode == 2 and "is not a revision" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert [str(p) for p in tmp_path.rglob("*escaped*")] == []
