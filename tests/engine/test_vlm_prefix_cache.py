"""The native VLM's prefix cache on the tiny random Qwen2-VL, through mlx-vlm's real
processor, vision tower and BatchGenerator: a turn that repeats the conversation so far
starts from its KV, images included, and gives what a full prefill gives (temperature 0).

Each pair of engines shares one loaded model: one with the prefix cache, one without
(``prompt_cache: off``), both without the vision-feature cache (but in the last test),
so a skipped vision tower is the prefix cache's doing. The tower's runs are counted with a spy around the
real tower (it still runs).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from io import BytesIO
from typing import Any

import pytest
from PIL import Image

from app.config.schema import ChatParams
from app.engine.batch.engine import TextEngine
from app.engine.models.vlm import LoadedVlm, load_vlm
from app.engine.prompt import cache_key_tokens
from app.engine.types import GREEDY, GenerationRequest, TokenDelta
from app.engine.worker import MLXWorker
from app.specs import engine_params, load_params
from tests.engine.engines import run, vlm_engine
from tests.fixtures.tiny_vlm import build_tiny_qwen2_vl
from tests.vision.sample_images import striped_bytes


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
        lambda: load_vlm(str(model_dir), load_params(ChatParams()), name="tiny-vlm", max_pixels=448 * 448,
                         min_pixels=28 * 28, max_images=3)
    ).result()


@pytest.fixture()
def tower_calls(loaded, monkeypatch) -> list[int]:
    calls: list[int] = []
    tower = type(loaded.model.vision_tower)
    real = tower.__call__

    def counting(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(tower, "__call__", counting)
    return calls


def make_engine(worker, loaded, feature_cache_bytes: int = 0, **params: Any) -> TextEngine:
    # No disk tier unless asked for: each test starts from an empty cache.
    settings: dict[str, Any] = {"mem": 16, "max_num_seqs": 2, "prefill_chunk_size": 32, "cache_min_tokens": 8,
                                "prompt_cache_disk_mb": 0, **params}
    return vlm_engine(worker, loaded, engine_params(ChatParams(**settings)), feature_cache_bytes)


@pytest.fixture()
def engines(worker, loaded) -> tuple[TextEngine, TextEngine]:
    """(with the prefix cache, without it)"""
    return make_engine(worker, loaded), make_engine(worker, loaded, prompt_cache="off")


def image(seed: int, size: tuple[int, int] = (96, 72)) -> Image.Image:
    return Image.open(BytesIO(striped_bytes(seed, size))).convert("RGB")


def user(text: str, n_images: int = 0) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": text}]}


def request(engine: TextEngine, messages: list[dict[str, Any]], images, *, max_tokens: int = 8,
            **kw: Any) -> GenerationRequest:
    """A request as the pipeline makes one: the VLM's prompt builder renders and builds it."""
    prompt = engine.prompts.build(engine.prompts.render(messages), list(images))
    return GenerationRequest(prompt, max_tokens=max_tokens, **kw)


def generate(engine: TextEngine, req: GenerationRequest) -> tuple[str, TokenDelta]:
    return asyncio.run(run(engine, req))


def two_turns(engine: TextEngine, first_images, second_text: str = "And the colours?", second_images=(),
              **kw: Any) -> tuple[str, TokenDelta, GenerationRequest]:
    """Turn one about ``first_images``, then turn two repeating it (and adding ``second_images``)."""
    turn1 = [user("What is this?", len(first_images))]
    answer, _ = generate(engine, request(engine, turn1, first_images, **kw))
    turn2 = [*turn1, {"role": "assistant", "content": answer}, user(second_text, len(second_images))]
    req = request(engine, turn2, [*first_images, *second_images], **kw)
    text, last = generate(engine, req)
    return text, last, req


def test_turn_two_reuses_turn_ones_kv_images_included(engines, tower_calls):
    cached, uncached = engines
    photo = image(1)
    text, last, req = two_turns(cached, [photo])
    assert len(tower_calls) == 1, "turn two took the image's KV from the prefix cache: no tower"
    first = req.prompt.images[0]
    assert last.cached_tokens > first.start + first.length, "cached_tokens counts the image's tokens"
    assert last.cached_tokens < last.prompt_tokens
    stats = cached.stats()
    assert stats.prompt_cache_hits == 1 and stats.prompt_cache_tokens_saved == last.cached_tokens
    assert stats.prompt_cache_tiers["memory"].hits == 1 and stats.prompt_cache_bytes > 0
    # Without the cache: the same answer at temperature 0, every token prefilled.
    text_u, last_u, _ = two_turns(uncached, [photo])
    assert text_u == text and last_u.cached_tokens == 0 and last_u.prompt_tokens == last.prompt_tokens
    assert len(tower_calls) == 3


def test_a_new_image_after_the_cached_prefix(engines, tower_calls):
    cached, uncached = engines
    text, last, req = two_turns(cached, [image(1)], "And this one?", [image(2, (60, 120))])
    assert len(tower_calls) == 2, "only the new image went through the tower"
    first, second = req.prompt.images
    assert first.start + first.length < last.cached_tokens <= second.start
    text_u, last_u, _ = two_turns(uncached, [image(1)], "And this one?", [image(2, (60, 120))])
    assert text_u == text and last_u.cached_tokens == 0


def test_a_different_picture_in_the_same_place_is_never_confused(engines):
    """The key is the pixels: another picture where the cached one was (as a reused URL
    would bring) shares only the text before it."""
    cached, uncached = engines
    question = [user("What is this?", 1)]
    generate(cached, request(cached, question, [image(1)]))
    again, again_last = generate(cached, request(cached, question, [image(1)]))
    assert again_last.cached_tokens == again_last.prompt_tokens - 1  # all but the last token
    other = request(cached, question, [image(3)])
    text, last = generate(cached, other)
    assert 0 < last.cached_tokens <= other.prompt.images[0].start
    assert text == generate(uncached, request(uncached, question, [image(3)]))[0]
    assert again == generate(uncached, request(uncached, question, [image(1)]))[0]


def test_key_tokens_stand_for_the_pixels(engines):
    cached, _ = engines
    a = request(cached, [user("What is this?", 1)], [image(1)]).prompt
    b = request(cached, [user("What is this?", 1)], [image(2)]).prompt
    same = request(cached, [user("What is this?", 1)], [image(1).copy()]).prompt
    ka, kb = cache_key_tokens(a), cache_key_tokens(b)
    run_a = a.images[0]
    assert a.tokens == b.tokens, "the placeholders alone cannot tell two pictures apart"
    assert ka[:run_a.start] == kb[:run_a.start] and ka[run_a.start] != kb[run_a.start]
    assert cache_key_tokens(same) == ka
    image_ids = ka[run_a.start:run_a.start + run_a.length]
    assert all(-(2**31) <= t < 0 for t in image_ids) and len(set(image_ids)) == len(image_ids)
    assert ka[:run_a.start] == a.tokens[:run_a.start] and ka[run_a.start + run_a.length:] == \
        a.tokens[run_a.start + run_a.length:]


def test_scopes_never_share(engines):
    cached, _ = engines
    question = [user("What is this?", 1)]
    generate(cached, request(cached, question, [image(4)], cache_namespace="key-a"))
    _, other = generate(cached, request(cached, question, [image(4)], cache_namespace="key-b"))
    assert other.cached_tokens == 0, "another API key (or cache_salt) never gets this one's prefix"
    _, same = generate(cached, request(cached, question, [image(4)], cache_namespace="key-a"))
    assert same.cached_tokens > 0


def test_a_cancelled_turn_leaves_its_kv_for_the_retry(engines, tower_calls):
    cached, _ = engines
    req = request(cached, [user("Go on", 1)], [image(6)], max_tokens=400)

    async def cancel_after_two_tokens():
        stream = cached.stream(req)
        await stream.__anext__()
        await stream.__anext__()
        await stream.aclose()
        for _ in range(200):
            if cached.in_flight == 0:
                break
            await asyncio.sleep(0.01)

    asyncio.run(cancel_after_two_tokens())
    assert cached.admission.reserved == 0 and cached.stats().prompt_cache_bytes > 0
    retry = request(cached, [user("Go on", 1)], [image(6)], max_tokens=4)
    _, last = generate(cached, retry)
    assert last.cached_tokens == last.prompt_tokens - 1 and len(tower_calls) == 1


def test_a_flood_of_distinct_images_stays_within_the_budget(worker, loaded):
    """Conversations about ever new pictures: the memory tier keeps within its cap (LRU
    evictions, counted) and, beside the running rows' reservations, within the KV budget."""
    engine = make_engine(worker, loaded, prompt_cache_mem=1)
    cap = engine.params.prompt_cache_bytes
    per_conversation = 0
    for seed in range(64):
        req = request(engine, [user("What is this?", 1)], [image(100 + seed, (224, 224))], max_tokens=4)
        _, last = generate(engine, req)
        assert last.cached_tokens <= req.prompt.images[0].start, "only the text before a new picture"
        per_conversation = max(per_conversation, (last.prompt_tokens + 4) * engine.bytes_per_token)
        stats = engine.stats()
        assert stats.prompt_cache_bytes <= cap
        budget = engine.admission.budget_tokens * engine.bytes_per_token
        assert stats.prompt_cache_bytes + stats.kv_reserved_tokens * engine.bytes_per_token <= budget
    assert 64 * per_conversation > 2 * cap, f"the flood is more than the cap holds ({per_conversation} B each)"
    memory = engine.stats().prompt_cache_tiers["memory"]
    assert memory.evictions > 0 and memory.entries < 64 and memory.bytes <= cap


def test_the_disk_tier_keeps_a_conversation_for_another_engine(worker, loaded, engines, tmp_path, tower_calls):
    """A conversation written to disk by one engine (an earlier load) is turn two's prefix
    in another whose memory tier is empty: images included, the same answer."""
    _, uncached = engines
    first = make_engine(worker, loaded, prompt_cache_disk_mb=64, prompt_cache_disk_dir=str(tmp_path))
    turn1 = [user("What is this?", 1)]
    answer, _ = generate(first, request(first, turn1, [image(7)]))
    assert first.finish_writes(30)
    assert first.stats().prompt_cache_tiers["disk"].writes == 1
    later = make_engine(worker, loaded, prompt_cache_disk_mb=64, prompt_cache_disk_dir=str(tmp_path))
    turn2 = [*turn1, {"role": "assistant", "content": answer}, user("And the colours?")]
    req = request(later, turn2, [image(7)])
    text, last = generate(later, req)
    assert later.stats().prompt_cache_tiers["disk"].hits == 1 and len(tower_calls) == 1
    image_run = req.prompt.images[0]
    assert last.cached_tokens > image_run.start + image_run.length
    assert text == generate(uncached, request(uncached, turn2, [image(7)]))[0]


def test_sampling_seeds_penalties_logprobs_and_stops_hold_from_cached_kv(engines):
    """Turn two from the cache is turn two prefilled whole, for a seeded sampled request with
    a repetition penalty (its processors see the whole prompt) and logprobs, and a stop
    string cuts it the same way."""
    cached, uncached = engines
    sampling = replace(GREEDY, temperature=0.9, seed=11, repetition_penalty=1.3)

    def turn_two(engine: TextEngine, **kw: Any) -> tuple[str, TokenDelta, list]:
        turn1 = [user("What is this?", 1)]
        answer, _ = generate(engine, request(engine, turn1, [image(8)]))
        turn2 = [*turn1, {"role": "assistant", "content": answer}, user("And the colours?")]
        req = request(engine, turn2, [image(8)], max_tokens=12, sampling=sampling, logprobs=2, **kw)

        async def collect():
            return [d async for d in engine.stream(req)]

        got = asyncio.run(collect())
        return "".join(d.text for d in got), got[-1], [lp for d in got for lp in d.logprobs]

    text, last, logprobs = turn_two(cached)
    text_u, last_u, logprobs_u = turn_two(uncached)
    assert last.cached_tokens > 0 and last_u.cached_tokens == 0
    assert text == text_u and [lp.token for lp in logprobs] == [lp.token for lp in logprobs_u]
    assert [lp.logprob for lp in logprobs] == pytest.approx([lp.logprob for lp in logprobs_u], abs=1e-4)
    stop = text[len(text) // 2:][:2]
    assert stop.strip(), "the seeded answer has text to stop at"
    cut, cut_last, _ = turn_two(cached, stop=[stop])
    assert cut == text[:text.index(stop)] and cut_last.finish_reason == "stop"


def test_both_caches_together(worker, loaded, engines, tower_calls):
    """The prefix cache covers a repeated conversation; the feature cache an image the
    prefix does not reach (another system prompt before it): neither runs the tower again,
    and the answers are a cold engine's."""
    _, uncached = engines
    both = make_engine(worker, loaded, feature_cache_bytes=8 * 2**20)
    text, last, _ = two_turns(both, [image(9)])
    assert len(tower_calls) == 1 and last.cached_tokens > 0
    other = [{"role": "system", "content": "You describe pictures."}, user("What is this?", 1)]
    answer, fresh = generate(both, request(both, other, [image(9)]))
    assert len(tower_calls) == 1, "the feature cache had the image"
    features = both.stats().vision_feature_cache
    assert features is not None and (features.hits, features.misses) == (1, 1)
    assert fresh.cached_tokens < request(both, other, [image(9)]).prompt.images[0].start
    assert two_turns(uncached, [image(9)])[0] == text
    assert generate(uncached, request(uncached, other, [image(9)]))[0] == answer
