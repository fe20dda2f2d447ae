"""VlmCaptioner on a tiny random Qwen2-VL served by the registry: a ``role: vision``
entry is an ordinary slot (the chat engine, serving a VLM), and a caption is a generation in its batch."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from app.config.schema import VisionParams
from app.engine.batch.engine import TextEngine
from app.engine.params import ModelSource, ModelSpec, VisionSpec
from app.engine.registry import Registry
from app.engine.types import GenerationRecord, GenerationRequest
from app.engine.worker import MLXWorker
from app.errors import ConfigError, ModelLoadError
from app.pipeline.request import ImagePart, Message, TextPart
from app.specs import load_params, vision_engine_params
from app.vision.cache import CaptionCache
from app.vision.captioner import CAPTION_REQUEST_ID, Captioner, VlmCaptioner, image_then_text, render_prompt
from app.vision.images import ImagePolicy, load_image
from app.vision.proxy import FAILED, VisionProxy
from tests.engine.engines import run
from tests.fixtures.tiny_vlm import build_tiny_qwen2_vl
from tests.vision.sample_images import data_url, image_bytes, striped_bytes

MAX_PIXELS = 112 * 112


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"), seed=0)


@pytest.fixture(scope="module")
def worker():
    w = MLXWorker()
    w.start()
    yield w
    w.stop()


def spec(path: Path, name: str = "tiny-vl", role: str = "vision", idle: float | None = None) -> ModelSpec:
    params = VisionParams(mem=16, max_num_seqs=4, prefill_chunk_size=64)
    return ModelSpec(name=name, role=role, source=ModelSource(name, local_path=str(path)), aliases=(), preload=False,
                     pin=False, max_queue=params.max_queue, queue_timeout_s=params.queue_timeout_s,
                     load=load_params(params), engine=vision_engine_params(params),
                     vision=VisionSpec(max_pixels=MAX_PIXELS, min_pixels=28 * 28, max_images=1, feature_cache_bytes=0),
                     idle_unload_s=idle)


def serve(worker: MLXWorker, *specs: ModelSpec) -> tuple[Registry, list[GenerationRecord]]:
    registry = Registry(worker, list(specs))
    records: list[GenerationRecord] = []
    registry.add_listener(records.append)
    return registry, records


@pytest.fixture(scope="module")
def served(worker, model_dir):
    registry, records = serve(worker, spec(model_dir))
    assert registry.load_now("tiny-vl", required=False) is None
    return registry, records


@pytest.fixture(scope="module")
def captioner(served) -> VlmCaptioner:
    return VlmCaptioner(served[0], "tiny-vl", max_tokens=8, max_pixels=MAX_PIXELS)


def loaded(raw: bytes):
    return load_image(data_url(raw), ImagePolicy(), param="messages[0].content[0].image_url")


def test_fixture_ids_match_its_tokenizer(model_dir):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    config = json.loads((model_dir / "config.json").read_text())
    assert config["vocab_size"] == tokenizer.get_vocab_size(with_added_tokens=True)
    assert config["image_token_id"] == tokenizer.token_to_id("<|image_pad|>")
    assert config["vision_start_token_id"] == tokenizer.token_to_id("<|vision_start|>")
    assert config["vision_config"]["hidden_size"] == config["hidden_size"]


def test_a_vision_entry_is_an_ordinary_slot(served):
    """Loaded by the registry as the chat engine serving a VLM, counted in its budget (weights, the worst-case
    images' peak, its KV), shown in its snapshot, and served by no API."""
    registry, _ = served
    engine = registry.loaded("tiny-vl")
    assert isinstance(engine, TextEngine) and engine.vision is not None
    row = registry.snapshot()["models"]["tiny-vl"]
    assert row["role"] == "vision" and row["state"] == "loaded" and row["memory_mb"]["weights"] > 0
    assert registry.used_bytes >= engine.loaded.weights_bytes + 16 * 2**20
    with pytest.raises(Exception, match="does not exist"):
        asyncio.run(registry.acquire_chat("tiny-vl"))


def test_is_a_captioner(captioner):
    assert isinstance(captioner, Captioner)


def test_images_reach_the_model(captioner, served):
    _, records = served
    a, b = loaded(striped_bytes(1)), loaded(striped_bytes(2))
    red = loaded(image_bytes((255, 0, 0), (80, 60)))
    before = len(records)

    async def describe_all():
        return [await captioner.describe(x, "What is it?") for x in (a, b, red, a)]

    cap_a, cap_b, cap_red, cap_a2 = asyncio.run(describe_all())
    assert cap_a == cap_a2, "temperature 0: same image, same caption"
    assert len({cap_a, cap_b, cap_red}) == 3, "different images must give different captions"
    captions = [r for r in records[before:] if r.request_id == CAPTION_REQUEST_ID]
    assert len(captions) == 4 and all(r.completion_tokens <= 8 for r in captions), "generations of the engine"


def test_a_caption_is_the_engines_own_generation(captioner, served):
    """The caption equals a temperature-0 request built by the VLM's prompt builder, and a
    chat stream decoding beside it in the batch does not change it."""
    registry, _ = served
    engine = registry.loaded("tiny-vl")
    picture = loaded(striped_bytes(7))
    prompts = engine.prompts
    direct = GenerationRequest(prompts.build(prompts.render([image_then_text(captioner.prompt("What is it?"))]),
                                             [picture.image]), max_tokens=8)
    chat_prompt = prompts.build(prompts.render([image_then_text("Go on")]), [loaded(striped_bytes(2)).image])

    async def scenario():
        alone = await captioner.describe(picture, "What is it?")
        chat = asyncio.create_task(run(engine, GenerationRequest(chat_prompt, max_tokens=40)))
        beside = await captioner.describe(picture, "What is it?")
        await chat
        return alone, (await run(engine, direct))[0], beside

    alone, direct_text, beside = asyncio.run(scenario())
    assert alone == direct_text.strip() == beside


def test_proxy_with_the_real_captioner(captioner):
    proxy = VisionProxy(captioner, CaptionCache(), ImagePolicy())
    picture = ImagePart(data_url(striped_bytes(4)), "messages[0].content[1]")
    messages = [Message("user", (TextPart("Describe"), picture))]
    first = asyncio.run(proxy.rewrite(messages))
    again = asyncio.run(proxy.rewrite(messages))
    assert first.messages[0].text().startswith("Describe\n\nImage 1: ")
    assert first.messages == again.messages
    assert [c.cached for c in first.captions + again.captions] == [False, True]


def test_prompt_uses_the_template_and_the_user_text():
    assert render_prompt("Q: {user_text}", "none", "  hi ", 100) == "Q: hi"
    assert render_prompt("Q: {user_text}", "none", None, 100) == "none"
    assert render_prompt("Q: {user_text}", "none", "abcdef", 3) == "Q: abc..."


def test_bad_prompt_template_is_a_config_error(served):
    with pytest.raises(ConfigError, match="user_text"):
        VlmCaptioner(served[0], "tiny-vl", prompt_template="Describe {image}")


def test_a_vision_model_that_cannot_load_fails_the_caption_not_the_request(worker, tmp_path):
    """Loaded on demand: the load's error is the caption's, and the proxy puts a placeholder."""
    registry, _ = serve(worker, spec(tmp_path / "absent", name="gone"))
    captioner = VlmCaptioner(registry, "gone", max_tokens=4)
    with pytest.raises(ModelLoadError, match="could not be loaded"):
        asyncio.run(captioner.describe(loaded(image_bytes()), None))
    proxy = VisionProxy(captioner, CaptionCache(), ImagePolicy())
    image = Message("user", (ImagePart(data_url(striped_bytes(5)), "messages[0].content[0]"),))
    result = asyncio.run(proxy.rewrite([image]))
    assert result.messages[0].text() == FAILED.format(n=1) and "could not be described" in result.warnings[0]


def test_missing_model_is_a_load_error(worker, tmp_path):
    registry, _ = serve(worker, spec(tmp_path / "absent"))
    assert "is not a directory" in (registry.load_now("tiny-vl", required=False) or "")


def _broken_copy(model_dir: Path, tmp_path: Path, edit) -> Path:
    copy = Path(shutil.copytree(model_dir, tmp_path / "copy"))
    edit(copy)
    return copy


def _load_error(worker: MLXWorker, path: Path) -> str:
    registry, _ = serve(worker, spec(path))
    return registry.load_now("tiny-vl", required=False) or ""


def test_missing_chat_template_is_a_config_error(worker, model_dir, tmp_path):
    broken = _broken_copy(model_dir, tmp_path, lambda p: (p / "chat_template.json").unlink())
    assert "no chat template" in _load_error(worker, broken)


def test_wrong_image_token_id_is_a_config_error(worker, model_dir, tmp_path):
    def edit(path: Path) -> None:
        config = json.loads((path / "config.json").read_text())
        config["image_token_id"] = 7
        (path / "config.json").write_text(json.dumps(config))

    assert "image_token_id" in _load_error(worker, _broken_copy(model_dir, tmp_path, edit))


def test_chat_template_without_image_slot_is_a_config_error(worker, model_dir, tmp_path):
    text_only = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
        "{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
    )

    def edit(path: Path) -> None:
        (path / "chat_template.json").write_text(json.dumps({"chat_template": text_only}))

    assert "drops the image token" in _load_error(worker, _broken_copy(model_dir, tmp_path, edit))


def test_idle_vision_model_unloads_and_reloads_through_the_registry(worker, model_dir):
    """idle_unload_secs: the registry gives its memory back when idle; the next image reloads it."""
    registry, _ = serve(worker, spec(model_dir, name="idle-vl", idle=0.2))
    assert registry.load_now("idle-vl", required=False) is None
    captioner = VlmCaptioner(registry, "idle-vl", max_tokens=6, max_pixels=MAX_PIXELS)
    image = loaded(striped_bytes(4))

    async def scenario():
        registry.start()
        try:
            first = await captioner.describe(image, None)
            used = registry.used_bytes
            for _ in range(100):
                if registry.loaded("idle-vl") is None and registry.used_bytes == 0:  # unloaded, not unloading
                    break
                await asyncio.sleep(0.05)
            unloaded, freed = registry.loaded("idle-vl") is None, registry.used_bytes
            again = await captioner.describe(image, None)
            return first, used, unloaded, freed, again
        finally:
            await registry.stop()

    first, used, unloaded, freed, again = asyncio.run(scenario())
    assert unloaded and used > 0 and freed == 0
    assert registry.loaded("idle-vl") is not None and again == first


def test_a_native_chat_model_captions_with_its_own_copy(worker, model_dir):
    """Proxy mode on a native VLM chat model: one loaded copy serves both roles, and the
    caption is a request to its engine."""
    registry, records = serve(worker, spec(model_dir, name="qwen", role="chat"))
    captioner = VlmCaptioner(registry, "qwen", max_tokens=8, max_pixels=MAX_PIXELS)
    caption = asyncio.run(captioner.describe(loaded(striped_bytes(7)), "What is it?"))
    assert caption and registry.loaded("qwen").vision is not None
    assert [r.request_id for r in records] == [CAPTION_REQUEST_ID]
