"""build_proxy from a resolved models.yaml: a captioner on the registry's vision slot
(loaded at start-up), or placeholders and a reason."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from app.config.loader import ResolvedConfig, resolve
from app.config.schema import ModelsFile
from app.engine.registry import Registry
from app.engine.worker import MLXWorker
from app.pipeline.request import ImagePart, Message
from app.specs import model_spec
from app.vision.captioner import VlmCaptioner
from app.vision.wiring import build_proxy
from tests.fixtures.tiny_vlm import build_tiny_qwen2_vl
from tests.vision.sample_images import data_url, striped_bytes


@pytest.fixture(scope="module")
def worker():
    w = MLXWorker()
    w.start()
    yield w
    w.stop()


def registry_of(config: ResolvedConfig, worker: MLXWorker) -> Registry:
    """The vision entry as build_state gives it to the registry (the chat entry is not needed here)."""
    files = config.models_file
    return Registry(worker, [model_spec(e, files.idle_unload_secs) for e in files.models if e.role == "vision"])


def models_file(vision_path: Path, image_dir: Path) -> ModelsFile:
    return ModelsFile.model_validate(
        {
            "server": {"image_file_dir": str(image_dir), "caption_cache_entries": 7},
            "models": [
                {
                    "name": "chat",
                    "builtin": "smollm2-135m-instruct",
                    "capabilities": {
                        "vision_mode": "proxy",
                        "vision_proxy": {"model": "eyes", "max_tokens": 5},
                    },
                },
                {
                    "name": "eyes",
                    "role": "vision",
                    "local_path": str(vision_path),
                    "params": {"max_images_per_request": 3, "max_pixels": 112 * 112, "mem": 16},
                },
            ],
        }
    )


def test_build_proxy_loads_the_vision_model(tmp_path, worker):
    model_dir = build_tiny_qwen2_vl(tmp_path / "eyes")
    config = resolve(models_file(model_dir, tmp_path))
    registry = registry_of(config, worker)
    proxy, reason = build_proxy(config, registry)
    assert reason is None
    assert registry.loaded("eyes").vision is not None, "loaded at start-up, as a registry slot"
    assert registry.loaded("eyes").loaded.max_images == 3
    assert isinstance(proxy.captioner, VlmCaptioner) and proxy.captioner.name == "eyes"
    assert proxy.captioner.max_tokens == 5 and proxy.captioner.max_pixels == 112 * 112
    assert proxy.policy.max_images_per_request == 3
    assert proxy.policy.allowed_file_dir == tmp_path
    assert proxy.cache.max_entries == 7
    image = Message("user", (ImagePart(data_url(striped_bytes(5)), "messages[0].content[0]"),))
    result = asyncio.run(proxy.rewrite([image]))
    assert result.messages[0].text().startswith("Image 1: ")
    assert result.captions[0].as_dict()["image_index"] == 1


def test_a_vision_model_that_fails_to_load_leaves_placeholders(tmp_path, worker):
    config = resolve(models_file(tmp_path / "absent", tmp_path))
    proxy, reason = build_proxy(config, registry_of(config, worker))
    assert reason is not None and "cannot load vision model eyes" in reason
    assert proxy.captioner is None
    image = Message("user", (ImagePart(data_url(striped_bytes(5)), "messages[0].content[0]"),))
    result = asyncio.run(proxy.rewrite([image]))
    assert result.messages[0].text() == "[Image 1: not available, no vision model loaded]"
    assert reason in result.warnings[0]


def test_a_proxy_naming_an_encoder_leaves_placeholders_and_says_why(tmp_path, worker):
    mf = ModelsFile.model_validate({"models": [
        {"name": "chat", "builtin": "smollm2-135m-instruct",
         "capabilities": {"vision_mode": "proxy", "vision_proxy": {"model": "minilm"}}},
        {"name": "minilm", "role": "embedding", "builtin": "all-minilm-l6-v2"},
    ]})
    config = resolve(mf)
    proxy, reason = build_proxy(config, registry_of(config, worker))
    assert reason == "vision model 'minilm' is not a VLM (role embedding)" and proxy.captioner is None
    assert proxy.policy.max_images_per_request == 8  # the chat model's bound
