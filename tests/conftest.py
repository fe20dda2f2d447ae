"""Shared fixtures: real models only (the embedded demo model, seeded tiny models)."""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def prompt_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The prefix cache's disk tier writes under a session directory, never the user's cache."""
    path = tmp_path_factory.mktemp("prompt-cache")
    old = os.environ.get("TANDEM_PROMPT_CACHE_DIR")
    os.environ["TANDEM_PROMPT_CACHE_DIR"] = str(path)
    yield path
    if old is None:
        os.environ.pop("TANDEM_PROMPT_CACHE_DIR", None)
    else:
        os.environ["TANDEM_PROMPT_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct, converted once into the user cache."""
    from app.engine.models.demo_model import ensure_demo_model

    return ensure_demo_model(progress=False)


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """The embedded all-MiniLM-L6-v2 embedding model, unpacked once into the user cache."""
    from app.engine.models.builtin_models import ensure_minilm

    return ensure_minilm(progress=False)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path) -> Path:
    """A seeded random-init llama (hidden 64, 2 layers) with the demo tokenizer."""
    from tests.fixtures.tiny_llama import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), demo_model_dir)


@pytest.fixture(scope="session")
def tiny_ministral(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path):
    """Builds scripted tiny Ministral 3 Reasoning models (tests/fixtures/tiny_ministral.py):
    ``tiny_ministral(script) -> Path``, one directory per distinct script."""
    from tests.fixtures.tiny_ministral import build_tiny_ministral

    built: dict[str, Path] = {}

    def make(script: str | dict[str, str]) -> Path:
        key = json.dumps(script, sort_keys=True)
        if key not in built:
            out = tmp_path_factory.mktemp("tiny-ministral")
            built[key] = build_tiny_ministral(out, script, base=demo_model_dir).path
        return built[key]

    return make


@pytest.fixture(scope="session")
def zoo_model(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path):
    """Builds the zoo's tiny random text models (tests/fixtures/zoo.py), each once a session:
    ``zoo_model("qwen3_5") -> Path``, a directory mlx_lm.load reads."""
    from tests.fixtures.zoo import build_zoo_model

    built: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in built:
            built[name] = build_zoo_model(name, tmp_path_factory.mktemp(f"zoo-{name}"), demo_model_dir)
        return built[name]

    return make


@pytest.fixture(scope="session")
def zoo_vlm(tmp_path_factory: pytest.TempPathFactory):
    """Builds the zoo's tiny random vision-language models (tests/fixtures/zoo_vision.py), each
    once a session: ``zoo_vlm("mistral3") -> Path``, a directory mlx_vlm.load reads."""
    from tests.fixtures.zoo_vision import build_zoo_vlm

    built: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in built:
            built[name] = build_zoo_vlm(name, tmp_path_factory.mktemp(f"zoo-vlm-{name}"))
        return built[name]

    return make


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    """A real uvicorn server on a free loopback port, in a background thread."""

    def __init__(self, app) -> None:
        import uvicorn

        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", backlog=2048)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def resolved_config(yaml_text: str, tmp_path: Path, **overrides):
    from app.config.loader import load_models_file, resolve

    path = tmp_path / "models.yaml"
    path.write_text(yaml_text)
    return resolve(load_models_file(path), source=str(path), overrides=overrides)


DEMO_YAML = """
models:
  - name: demo
    builtin: smollm2-135m-instruct
    params:
      {mem: 64, max_num_seqs: 8, prefill_chunk_size: 256, max_model_len: 2048, temperature: 0.0, max_tokens: 32,
       cache_min_tokens: 16}
    capabilities:
      # Thinking on, so the reasoning path runs end to end (SmolLM2 ignores the switch).
      reasoning_parser: generic
      vision_mode: proxy
      vision_proxy: {model: vlm, max_tokens: 8}
  - name: vlm
    role: vision
    local_path: {vlm_path}
"""


@pytest.fixture(scope="session")
def demo_state(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path):
    """The demo model served with a missing vision model: text keeps working."""
    from app.main import build_state

    tmp = tmp_path_factory.mktemp("demo-config")
    config = resolved_config(DEMO_YAML.replace("{vlm_path}", str(tmp / "missing-vlm")), tmp)
    state = build_state(config)
    yield state
    state.worker.stop()


@pytest.fixture(scope="session")
def demo_server(demo_state) -> Iterator[LiveServer]:
    from app.main import create_app

    with LiveServer(create_app(demo_state)) as server:
        yield server


@pytest.fixture()
def client(demo_server: LiveServer):
    from openai import OpenAI

    with OpenAI(base_url=demo_server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c
