"""The vision-feature cache on the tiny random Qwen2-VL, through mlx-vlm's real processor,
vision tower and BatchGenerator: an image seen before skips the tower, and nothing else
changes (temperature 0 gives the uncached run's tokens).

The tower's runs are counted with a spy around the real tower (it still runs), so
"skipped" means the tower was not called at all.
"""

from __future__ import annotations

import asyncio
from io import BytesIO

import pytest
from PIL import Image

from app.config.schema import ChatParams
from app.engine.batch.engine import TextEngine
from app.engine.batch.vision_features import FeatureCache
from app.engine.models.vlm import LoadedVlm, load_vlm
from app.engine.types import GenerationRequest
from app.engine.worker import MLXWorker
from app.specs import engine_params, load_params
from app.vision.images import ImagePolicy, decode_image
from tests.engine.engines import run, vlm_engine
from tests.fixtures.tiny_vlm import build_tiny_qwen2_vl
from tests.vision.sample_images import striped_bytes

MAX_PIXELS = 448 * 448


@pytest.fixture(scope="module")
def worker():
    w = MLXWorker()
    w.start()
    yield w
    w.stop()


@pytest.fixture(scope="module")
def loaded(worker, tmp_path_factory) -> LoadedVlm:
    model_dir = build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"), seed=0)
    return worker.submit(
        lambda: load_vlm(str(model_dir), load_params(ChatParams()), name="tiny-vlm", max_pixels=MAX_PIXELS,
                         min_pixels=28 * 28, max_images=2)
    ).result()


@pytest.fixture()
def tower_calls(loaded, monkeypatch) -> list[int]:
    """The vision tower's calls (a spy: the real tower still runs), one entry per call."""
    calls: list[int] = []
    tower = type(loaded.model.vision_tower)
    real = tower.__call__

    def counting(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(tower, "__call__", counting)
    return calls


def make_engine(worker, loaded, cache_mb: float) -> TextEngine:
    # The feature cache alone: with the prefix cache on, an image that repeats a cached
    # prefix comes with its KV and never asks for features (test_vlm_prefix_cache has both).
    params = engine_params(ChatParams(mem=16, max_num_seqs=2, prefill_chunk_size=32, prompt_cache="off"))
    return vlm_engine(worker, loaded, params, int(cache_mb * 2**20))


def decoded(raw: bytes) -> Image.Image:
    """An image as the pipeline decodes it."""
    return decode_image(raw, ImagePolicy(), param="image", max_pixels=MAX_PIXELS).image


def webp_lossless(raw: bytes) -> bytes:
    buf = BytesIO()
    Image.open(BytesIO(raw)).save(buf, format="WEBP", lossless=True)
    return buf.getvalue()


def request(engine: TextEngine, text: str, images, **kw) -> GenerationRequest:
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    prompt = engine.prompts.build(engine.prompts.render([{"role": "user", "content": content}]), list(images))
    return GenerationRequest(prompt, max_tokens=6, **kw)


def generate(engine: TextEngine, req: GenerationRequest) -> str:
    return asyncio.run(run(engine, req))[0]


def test_a_seen_image_skips_the_tower_and_changes_nothing(worker, loaded, tower_calls):
    cached, uncached = make_engine(worker, loaded, 8), make_engine(worker, loaded, 0)
    photo = decoded(striped_bytes(3))
    first = generate(cached, request(cached, "What is this?", [photo]))
    assert len(tower_calls) == 1
    # Other text around the same picture: the tower does not run again.
    second = generate(cached, request(cached, "Describe the colours.", [photo]))
    assert len(tower_calls) == 1
    stats = cached.stats().vision_feature_cache
    assert stats is not None and (stats.hits, stats.misses, stats.entries) == (1, 1, 1)
    assert stats.tokens == request(cached, "x", [photo]).prompt.images[0].length
    assert cached.stats().vision_encoded_images == 1
    # The same requests without the cache: the same tokens at temperature 0.
    assert generate(uncached, request(uncached, "What is this?", [photo])) == first
    assert generate(uncached, request(uncached, "Describe the colours.", [photo])) == second
    assert len(tower_calls) == 3 and uncached.stats().vision_feature_cache is None


def test_two_images_one_cached_one_new(worker, loaded, tower_calls):
    """A hit and a miss in one prompt: only the new image is encoded, in its place."""
    cached, uncached = make_engine(worker, loaded, 8), make_engine(worker, loaded, 0)
    a, b = decoded(striped_bytes(5)), decoded(striped_bytes(6, (60, 120)))
    generate(cached, request(cached, "One", [b]))
    calls = len(tower_calls)
    both = generate(cached, request(cached, "Compare them", [a, b]))
    assert len(tower_calls) == calls + 1
    assert generate(uncached, request(uncached, "Compare them", [a, b])) == both


def test_one_image_twice_in_a_prompt_is_encoded_once(worker, loaded, tower_calls):
    cached, uncached = make_engine(worker, loaded, 8), make_engine(worker, loaded, 0)
    photo = decoded(striped_bytes(12))
    twice = generate(cached, request(cached, "Same?", [photo, photo]))
    assert len(tower_calls) == 1
    assert generate(uncached, request(uncached, "Same?", [photo, photo])) == twice


def test_the_same_pixels_in_png_and_lossless_webp_hit(worker, loaded, tower_calls):
    engine = make_engine(worker, loaded, 8)
    png = striped_bytes(7)
    generate(engine, request(engine, "What is this?", [decoded(png)]))
    generate(engine, request(engine, "What is this?", [decoded(webp_lossless(png))]))
    assert len(tower_calls) == 1
    stats = engine.stats().vision_feature_cache
    assert stats is not None and stats.hits == 1


def test_different_pixels_never_share_features(worker, loaded, tower_calls):
    """Same size, same placeholder run, different pixels: two keys, two encodes."""
    engine = make_engine(worker, loaded, 8)
    a, b = decoded(striped_bytes(8)), decoded(striped_bytes(9))
    ra, rb = request(engine, "What?", [a]), request(engine, "What?", [b])
    assert ra.prompt.tokens == rb.prompt.tokens  # the placeholders alone cannot tell them apart
    out_a, out_b = generate(engine, ra), generate(engine, rb)
    assert len(tower_calls) == 2 and out_a != out_b


def test_features_never_cross_scopes(worker, loaded, tower_calls):
    engine = make_engine(worker, loaded, 8)
    photo = decoded(striped_bytes(10))
    generate(engine, request(engine, "What?", [photo], cache_namespace="key-a"))
    generate(engine, request(engine, "What?", [photo], cache_namespace="key-b"))
    assert len(tower_calls) == 2
    generate(engine, request(engine, "What?", [photo], cache_namespace="key-a"))
    assert len(tower_calls) == 2


def test_a_flood_of_distinct_images_stays_within_the_cap(worker, loaded):
    # The processor caps the fixture's images at 16 tokens of 64 float32: 4 KB each.
    engine = make_engine(worker, loaded, 5 * 4096 / 2**20)
    cap = engine.vision.features.max_bytes  # type: ignore[union-attr]
    for seed in range(12):
        generate(engine, GenerationRequest(request(engine, "Hi", [decoded(striped_bytes(20 + seed, (448, 448)))])
                                           .prompt, max_tokens=1))
        stats = engine.stats().vision_feature_cache
        assert stats is not None and stats.bytes <= cap
    assert stats.evictions == 7 and stats.entries == 5 and stats.misses == 12


def test_the_lru_counts_and_evicts_in_bytes():
    import mlx.core as mx

    cache = FeatureCache(max_bytes=3 * 4 * 16)  # three entries of 4 float32 rows of 4
    for key in "abc":
        cache.put(key, mx.zeros((4, 4)))
    assert cache.get("a") is not None  # now the most recent
    cache.put("d", mx.zeros((4, 4)))
    assert cache.get("b") is None and cache.get("a") is not None
    cache.put("huge", mx.zeros((64, 4)))  # larger than the cap: not kept, nothing evicted for it
    s = cache.stats()
    assert (s.entries, s.bytes, s.evictions, s.hits, s.misses) == (3, 192, 1, 2, 1)
