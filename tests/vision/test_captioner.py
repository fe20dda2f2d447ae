"""MlxVlmCaptioner on a tiny random Qwen2-VL, through mlx-vlm's real load/generate."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from app.errors import ConfigError, VisionUnavailableError
from app.vision.cache import CaptionCache
from app.vision.captioner import Captioner, MlxVlmCaptioner, render_prompt
from app.vision.images import ImagePolicy, load_image
from app.pipeline.request import ImagePart, Message, TextPart
from app.vision.proxy import VisionProxy
from tests.fixtures.tiny_vlm import build_tiny_qwen2_vl
from tests.vision.sample_images import data_url, image_bytes, striped_bytes


class MlxThread:
    """The engine's MLX-owner thread, as far as the captioner can tell; records callers."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx")
        self.thread_ids: set[int] = set()

    def submit(self, fn) -> Future:
        def run():
            self.thread_ids.add(threading.get_ident())
            return fn()

        return self._pool.submit(run)

    def shutdown(self) -> None:
        import mlx.core as mx

        # MLX streams are per thread; one left alive aborts the process at exit
        # ("terminate called without an active exception").
        self._pool.submit(mx.clear_streams).result()
        self._pool.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"), seed=0)


@pytest.fixture(scope="module")
def mlx_thread():
    thread = MlxThread()
    yield thread
    thread.shutdown()


@pytest.fixture(scope="module")
def captioner(model_dir, mlx_thread) -> MlxVlmCaptioner:
    captioner = MlxVlmCaptioner(model_dir, mlx_thread, name="tiny-vl", max_tokens=8)
    captioner.load()
    return captioner


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


def test_is_a_captioner(captioner):
    assert isinstance(captioner, Captioner)
    assert captioner.loaded


def test_images_reach_the_model(captioner, mlx_thread):
    a, b = loaded(striped_bytes(1)), loaded(striped_bytes(2))
    red = loaded(image_bytes((255, 0, 0), (80, 60)))

    async def run():
        return [await captioner.describe(x, "What is it?") for x in (a, b, red, a)]

    cap_a, cap_b, cap_red, cap_a2 = asyncio.run(run())
    assert cap_a == cap_a2, "temperature 0: same image, same caption"
    assert len({cap_a, cap_b, cap_red}) == 3, "different images must give different captions"
    assert mlx_thread.thread_ids == {next(iter(mlx_thread.thread_ids))}, (
        "all MLX work on one thread"
    )
    assert threading.get_ident() not in mlx_thread.thread_ids


def test_proxy_with_the_real_captioner(captioner):
    proxy = VisionProxy(captioner, CaptionCache(), ImagePolicy())
    messages = [Message("user", (TextPart("Describe"), ImagePart(data_url(striped_bytes(4)), "messages[0].content[1]")))]
    first = asyncio.run(proxy.rewrite(messages))
    again = asyncio.run(proxy.rewrite(messages))
    assert first.messages[0].text().startswith("Describe\n\nImage 1: ")
    assert first.messages == again.messages
    assert [c.cached for c in first.captions + again.captions] == [False, True]


def test_prompt_uses_the_template_and_the_user_text():
    assert render_prompt("Q: {user_text}", "none", "  hi ", 100) == "Q: hi"
    assert render_prompt("Q: {user_text}", "none", None, 100) == "none"
    assert render_prompt("Q: {user_text}", "none", "abcdef", 3) == "Q: abc..."


def test_bad_prompt_template_is_a_config_error(mlx_thread):
    with pytest.raises(ConfigError, match="user_text"):
        MlxVlmCaptioner("/nowhere", mlx_thread, prompt_template="Describe {image}")


def test_describe_before_load_is_unavailable(model_dir, mlx_thread):
    captioner = MlxVlmCaptioner(model_dir, mlx_thread)
    with pytest.raises(VisionUnavailableError):
        asyncio.run(captioner.describe(loaded(image_bytes()), None))


def test_missing_model_is_a_config_error(tmp_path, mlx_thread):
    captioner = MlxVlmCaptioner(tmp_path / "absent", mlx_thread)
    with pytest.raises(ConfigError, match="cannot load vision model"):
        captioner.load()


def _broken_copy(model_dir: Path, tmp_path: Path, edit) -> Path:
    copy = Path(shutil.copytree(model_dir, tmp_path / "copy"))
    edit(copy)
    return copy


def test_missing_chat_template_is_a_config_error(model_dir, tmp_path, mlx_thread):
    broken = _broken_copy(model_dir, tmp_path, lambda p: (p / "chat_template.json").unlink())
    with pytest.raises(ConfigError, match="no chat template"):
        MlxVlmCaptioner(broken, mlx_thread).load()


def test_wrong_image_token_id_is_a_config_error(model_dir, tmp_path, mlx_thread):
    def edit(path: Path) -> None:
        config = json.loads((path / "config.json").read_text())
        config["image_token_id"] = 7
        (path / "config.json").write_text(json.dumps(config))

    broken = _broken_copy(model_dir, tmp_path, edit)
    with pytest.raises(ConfigError, match="image_token_id"):
        MlxVlmCaptioner(broken, mlx_thread).load()


def test_chat_template_without_image_slot_is_a_config_error(model_dir, tmp_path, mlx_thread):
    text_only = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% for c in m['content'] %}{% if c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
        "{% endfor %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
    )

    def edit(path: Path) -> None:
        (path / "chat_template.json").write_text(json.dumps({"chat_template": text_only}))

    broken = _broken_copy(model_dir, tmp_path, edit)
    with pytest.raises(ConfigError, match="drops the image token"):
        MlxVlmCaptioner(broken, mlx_thread).load()


def test_idle_vision_model_unloads_and_reloads_on_the_engine_thread(model_dir):
    """idle_unload_secs: memory is given back when idle; the next image reloads it."""
    from app.engine.worker import MLXWorker

    worker = MLXWorker()
    worker.start()
    try:
        captioner = MlxVlmCaptioner(model_dir, worker, name="tiny-vl", max_tokens=6, idle_unload_s=0.2)
        captioner.load()
        image = loaded(striped_bytes(4))

        async def scenario():
            first = await captioner.describe(image, None)
            for _ in range(100):
                if not captioner.loaded:
                    break
                await asyncio.sleep(0.05)
            unloaded = not captioner.loaded
            again = await captioner.describe(image, None)
            return first, unloaded, again

        first, unloaded, again = asyncio.run(scenario())
        assert unloaded and captioner.loaded
        assert again == first
    finally:
        worker.stop()
