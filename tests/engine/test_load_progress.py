"""A load's progress as the loaders report it: the hub's download in bytes (resumed downloads
start where they stopped), and the text loader's weights in bytes read, slice by slice."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from app.engine.models import hub
from app.engine.models.progress import LoadProgress, LoadStep
from tests.service.fake_hub import COMMIT, FakeHub

REPO_ID = "tandem-test/tiny-llama"


def recorder() -> tuple[LoadProgress, list[LoadStep]]:
    steps: list[LoadStep] = []
    return LoadProgress(steps.append), steps


def test_a_download_reports_its_bytes_from_where_it_resumes(tmp_path: Path, tiny_model_dir: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    # The fake hub on loopback (the suite runs offline otherwise), into a cache of this test's own.
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    fake = FakeHub()
    fake.add_repo(REPO_ID, tiny_model_dir)
    server, url = fake.serve()
    try:
        repo = fake.repos[REPO_ID]
        files = [hub.HubFile(name, f"{url}/{REPO_ID}/resolve/{COMMIT}/{name}", len(f.data),
                             f.sha256 if f.lfs else f.git_oid) for name, f in sorted(repo.items())]
        total = sum(f.size for f in files)
        weights = next(f for f in files if f.name == "model.safetensors")
        # An earlier download stopped a third of the way into the weights.
        blobs = hub.cache_folder(REPO_ID) / "blobs"
        blobs.mkdir(parents=True)
        kept = weights.size // 3
        (blobs / f"{weights.etag}.incomplete").write_bytes(repo["model.safetensors"].data[:kept])
        progress, steps = recorder()
        hub.fetch(REPO_ID, files, stream=io.StringIO(), progress=progress)
    finally:
        server.shutdown()
    assert {s.phase for s in steps} == {"downloading"} and all(s.total == total for s in steps)
    assert steps[0].done == 0 and steps[1].done == kept  # what the earlier download left
    done = [s.done for s in steps]
    assert done == sorted(done) and done[-1] == total and steps[-1].fraction == 1.0


def test_the_text_loader_reports_weights_read_slice_by_slice(demo_model_dir: Path) -> None:
    from app.engine.models.loader import LOAD_SLICE_BYTES, load_text_model_steps
    from app.engine.params import LoadParams, ModelSource

    params = LoadParams(dtype=None, quantization=None, quantization_group_size=64, max_model_len=None,
                        kv_cache_bits=None, distributed="tensor")

    progress, steps = recorder()
    loading = load_text_model_steps(ModelSource("demo", local_path=str(demo_model_dir)), params, progress)
    yields = 0
    while True:
        try:
            next(loading)
            yields += 1
        except StopIteration as done:
            loaded = done.value
            break
    weights = [s for s in steps if s.phase == "loading weights"]
    assert weights[0].done == 0 and weights[-1].done == weights[-1].total == loaded.weights_bytes
    # One step per slice read, in between the loader gives the MLX thread back.
    assert len(weights) - 1 == -(-loaded.weights_bytes // LOAD_SLICE_BYTES) and yields >= len(weights) - 1
    assert [s.phase for s in steps][-1] == "starting engine"


def test_a_gguf_conversion_reports_its_stages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from app.engine.models.demo_model import demo_gguf_path
    from app.engine.models.loader import model_source
    from app.engine.params import ModelSource

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))  # converted here, not into the user's cache
    progress, steps = recorder()
    path = model_source(ModelSource("g", weight_file=str(demo_gguf_path())), progress=progress)
    assert Path(path) == tmp_path / "converted" / "g" and (Path(path) / "config.json").is_file()
    assert [s.phase for s in steps][0] == "converting GGUF (reading)" and steps[-1].phase == "converting GGUF (done)"
    assert {s.phase for s in steps} >= {"converting GGUF (weights)", "converting GGUF (saving)"}
    fractions = [s.fraction for s in steps]
    assert fractions == sorted(fractions) and fractions[-1] == 1.0  # type: ignore[type-var]
