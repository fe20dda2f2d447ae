"""The native VLM engine on the tiny random Qwen2-VL, through mlx-vlm's real load,
processor, vision tower and BatchGenerator.

The fixture model is random, so its words mean nothing; what it proves is that
an image reaches the model: two different images must give different outputs,
and the same image the same output (temperature 0).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from io import BytesIO

import mlx.core as mx
import pytest
from PIL import Image

from app.config.mapping import engine_params, load_params
from app.config.schema import ChatParams
from app.engine.mlx_internals import reset_vlm_stopping
from app.engine.types import GREEDY, GenerationRecord, GenerationRequest, SamplingParams, TokenDelta
from app.engine.vlm import LoadedVlm, VlmEngine, load_vlm, render_vlm_prompt
from app.engine.worker import MLXWorker
from app.errors import ContextLengthError, ImageError, InvalidRequestError
from app.vision.captioner import MlxVlmCaptioner
from app.vision.images import ImagePolicy, load_image
from tests.engine.engines import run
from tests.fixtures.tiny_vlm import build_tiny_qwen2_vl
from tests.vision.sample_images import data_url, striped_bytes

MAX_IMAGES = 2


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_qwen2_vl(tmp_path_factory.mktemp("tiny-qwen2-vl"), seed=0)


@pytest.fixture(scope="module")
def worker():
    w = MLXWorker()
    w.start()
    yield w
    w.stop()


def load(worker: MLXWorker, model_dir, **params) -> LoadedVlm:
    return worker.submit(
        lambda: load_vlm(str(model_dir), load_params(ChatParams(**params)), name="tiny-vlm", max_pixels=448 * 448,
                         min_pixels=28 * 28, max_images=MAX_IMAGES)
    ).result()


@pytest.fixture(scope="module")
def engine(worker, model_dir):
    eng = VlmEngine(worker, load(worker, model_dir), engine_params(ChatParams(mem=16, max_num_seqs=4, prefill_chunk_size=32)))
    records: list[GenerationRecord] = []
    eng.add_listener(records.append)
    eng.records = records  # type: ignore[attr-defined]
    return eng


def image(seed: int, size: tuple[int, int] = (96, 72)) -> Image.Image:
    return Image.open(BytesIO(striped_bytes(seed, size))).convert("RGB")


def request(engine: VlmEngine, text: str, images=(), max_tokens: int = 8, **kw) -> GenerationRequest:
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    prompt = render_vlm_prompt(engine.loaded, [{"role": "user", "content": content}])
    return GenerationRequest([], max_tokens=max_tokens, prompt_text=prompt, images=tuple(images), **kw)


def generate(engine: VlmEngine, req: GenerationRequest):
    return asyncio.run(run(engine, req))


def test_images_reach_the_model(engine):
    a, _ = generate(engine, request(engine, "What is this?", [image(1)]))
    b, _ = generate(engine, request(engine, "What is this?", [image(2)]))
    a2, last = generate(engine, request(engine, "What is this?", [image(1)]))
    assert a != b, "different images must give different outputs"
    assert a == a2, "temperature 0: the same image gives the same output"
    text_only = len(engine.tokenizer.encode(request(engine, "What is this?").prompt_text))
    assert last.prompt_tokens > text_only + 1, "the processor expanded the placeholder into the image's tokens"
    assert engine.records[-1].prompt_tokens == last.prompt_tokens


def test_text_only_request(engine):
    req = request(engine, "Hello there, how are you?")
    text, last = generate(engine, req)
    assert last.finish_reason == "length" and last.completion_tokens == 8 and text
    # The same prompt as token ids (the pipeline's text path) gives the same output.
    ids = engine.tokenizer.encode(req.prompt_text, add_special_tokens=False)
    assert generate(engine, GenerationRequest(ids, max_tokens=8))[0] == text
    assert last.prompt_tokens == len(ids)


def test_placeholders_come_from_the_template(engine):
    token = engine.loaded.image_token
    content = [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "with"},
               {"type": "image"}]
    prompt = render_vlm_prompt(engine.loaded, [{"role": "user", "content": content}])
    assert token == "<|image_pad|>" and prompt.count(token) == 2
    assert prompt.index("Compare") < prompt.index(token) < prompt.index("with") < prompt.rindex(token)
    with pytest.raises(InvalidRequestError, match="user messages only"):
        render_vlm_prompt(engine.loaded, [{"role": "assistant", "content": [{"type": "image"}]}])


def test_two_images_in_order(engine):
    one_two, _ = generate(engine, request(engine, "Compare", [image(1), image(2)]))
    two_one, _ = generate(engine, request(engine, "Compare", [image(2), image(1)]))
    assert one_two != two_one


def test_too_many_images_is_refused(engine):
    with pytest.raises(ImageError) as info:
        generate(engine, request(engine, "Compare", [image(i) for i in range(MAX_IMAGES + 1)]))
    assert info.value.code == "too_many_images" and info.value.status_code == 400
    assert f"at most {MAX_IMAGES}" in info.value.message


def test_batched_equals_alone(engine):
    reqs = [
        request(engine, "What is this?", [image(1)]),
        request(engine, "Describe it.", [image(2, (60, 120))]),
        request(engine, "Hello there, how are you?"),
        request(engine, "Compare", [image(3), image(4)]),
        request(engine, "What is this?", [image(1)]),
    ]
    alone = [generate(engine, r)[0] for r in reqs]

    async def together():
        return await asyncio.gather(*(run(engine, r) for r in reqs))

    assert [t for t, _ in asyncio.run(together())] == alone
    assert alone[0] == alone[4]


def test_seeded_sampling_is_reproducible(engine):
    def sampled(seed: int) -> str:
        s = replace(GREEDY, temperature=1.0, seed=seed)
        return generate(engine, request(engine, "What?", [image(3)], max_tokens=12, sampling=s))[0]

    assert sampled(7) == sampled(7)
    assert len({sampled(seed) for seed in (1, 2, 3, 4)}) > 1


def test_stop_string_cuts_before_it(engine):
    full, _ = generate(engine, request(engine, "What is this?", [image(5)], max_tokens=12))
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    if not stop.strip():
        pytest.skip("random model produced whitespace")
    text, last = generate(engine, request(engine, "What is this?", [image(5)], max_tokens=12, stop=(stop,)))
    assert last.finish_reason == "stop" and text == full[: full.find(stop)]


def test_cancel_frees_the_slot(engine):
    async def scenario():
        stream = engine.stream(request(engine, "Go on", [image(6)], max_tokens=400))
        await stream.__anext__()
        await stream.aclose()
        for _ in range(200):
            if engine.in_flight == 0:
                break
            await asyncio.sleep(0.01)

    asyncio.run(scenario())
    assert engine.in_flight == 0
    assert engine.admission.reserved == 0 and engine.admission.running == 0
    assert engine.records[-1].outcome == "cancelled" and engine.records[-1].completion_tokens < 400


def test_a_bad_request_fails_alone(engine):
    good = request(engine, "What is this?", [image(1)])
    # One placeholder, two images (mlx-vlm's processor would drop the second in silence).
    bad = GenerationRequest([], max_tokens=8, prompt_text=good.prompt_text, images=(image(1), image(2)))
    alone = generate(engine, good)[0]

    async def both():
        return await asyncio.gather(run(engine, good), run(engine, bad), return_exceptions=True)

    ok, failed = asyncio.run(both())
    assert isinstance(failed, InvalidRequestError) and "1 image placeholder(s) for 2" in failed.message
    assert ok[0] == alone
    assert engine.worker.alive and engine.admission.reserved == 0


def test_context_is_the_real_prompt_length(worker, model_dir):
    loaded = load(worker, model_dir, max_model_len=64)
    eng = VlmEngine(worker, loaded, engine_params(ChatParams(mem=16, max_num_seqs=2)))
    one = request(eng, "Hi", [image(1)], max_tokens=1000)
    _, last = generate(eng, one)
    assert last.finish_reason == "length" and last.prompt_tokens + last.completion_tokens == 64
    with pytest.raises(ContextLengthError, match="images expanded"):
        generate(eng, request(eng, "Hi", [image(1, (448, 448)), image(2, (448, 448))]))


def test_worst_case_profile_is_logged(worker, model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="tandem.engine"):
        loaded = load(worker, model_dir)
    p = loaded.profile
    assert loaded.profile_peak_bytes == p.peak_bytes > 0 and loaded.weights_bytes > 0
    assert p.images == MAX_IMAGES and p.image_size == (448, 448)
    # The processor caps the fixture's images at 112x112 px: 16 tokens each.
    assert p.prompt_tokens >= MAX_IMAGES * 16
    line = next(r.getMessage() for r in caplog.records if "worst case" in r.getMessage())
    assert f"{p.peak_bytes / 2**20:.1f} MB" in line and f"{MAX_IMAGES} image(s) at 448x448" in line


def test_shared_copy_captions_through_the_engine(engine):
    """Proxy mode on the native model's own copy: a caption is a request to its engine."""
    captioner = MlxVlmCaptioner.from_engine(engine, name="tiny-vlm", max_tokens=8)
    captioner.load()  # nothing to load
    assert captioner.loaded and captioner.max_pixels == engine.loaded.max_pixels
    picture = load_image(data_url(striped_bytes(7)), ImagePolicy(), param="messages[0].content[0]")
    prompt = captioner.prompt("What is it?")

    async def scenario():
        alone = await captioner.describe(picture, "What is it?")
        direct = (await run(engine, request(engine, prompt, [picture.image], max_tokens=8)))[0]
        # A chat stream decoding beside it does not change the caption.
        chat = asyncio.create_task(run(engine, request(engine, "Go on", [image(2)], max_tokens=40)))
        beside = await captioner.describe(picture, "What is it?")
        await chat
        return alone, direct, beside

    before = len(engine.records)
    alone, direct, beside = asyncio.run(scenario())
    assert alone == direct.strip() == beside
    captions = [r for r in engine.records[before:] if r.request_id == "caption"]
    assert len(captions) == 2, "captions ran on the engine's copy"


def test_a_conversation_from_typed_messages(engine):
    """The pipeline's path: typed messages -> vlm_messages -> render_vlm_prompt -> the engine."""
    from app.pipeline.request import ImagePart, Message, TextPart
    from app.vision.native import load_native_images, native_image_parts, vlm_messages

    policy = ImagePolicy(max_images_per_request=MAX_IMAGES)
    messages = [
        Message.of("system", "You describe pictures."),
        Message("user", (ImagePart(data_url(striped_bytes(1)), "messages[1].content[0]"), TextPart("What is it?"))),
        Message.of("assistant", "A pattern."),
        Message("user", (TextPart("And this one?"), ImagePart(data_url(striped_bytes(2)), "messages[3].content[1]"))),
    ]
    parts = native_image_parts(messages, policy)
    images = asyncio.run(load_native_images(parts, policy, max_pixels=engine.loaded.max_pixels))
    prompt = render_vlm_prompt(engine.loaded, vlm_messages(messages))
    assert prompt.count("<|image_pad|>") == 2 and "A pattern." in prompt and "You describe pictures." in prompt
    assert prompt.index("What is it?") < prompt.index("And this one?") < prompt.rindex("<|image_pad|>")
    _, last = generate(engine, GenerationRequest([], max_tokens=6, prompt_text=prompt, images=tuple(images)))
    assert last.completion_tokens == 6 or last.finish_reason == "stop"


def own_generate(worker, model_dir, req: GenerationRequest) -> list[tuple[int, mx.array]]:
    """mlx-vlm's own single-sequence ``stream_generate`` at temperature 0, on a copy of
    its own (it keeps M-RoPE state in the model): each token and the distribution it came from."""
    from mlx_vlm import stream_generate

    copy = load(worker, model_dir)

    def steps():
        reset_vlm_stopping(copy.processor, copy.model)
        return [(r.token, r.logprobs) for r in stream_generate(
            copy.model, copy.processor, req.prompt_text, image=list(req.images), max_tokens=req.max_tokens,
            temperature=0.0)][:req.max_tokens]

    return worker.submit(steps).result()


def test_logprobs_are_mlx_vlms_own(engine, worker, model_dir):
    """Batched with other rows (one sampled, one without logprobs), a greedy request's
    logprobs equal what mlx-vlm's single-sequence generate computes for each token."""
    greedy = request(engine, "What is this?", [image(1)], max_tokens=6, logprobs=3)
    sampled = request(engine, "Describe it.", [image(2)], max_tokens=6, logprobs=3,
                      sampling=replace(GREEDY, temperature=1.0, seed=5))
    plain = request(engine, "What is this?", [image(1)], max_tokens=6)

    async def together():
        return await asyncio.gather(*(deltas(engine, r) for r in (greedy, sampled, plain)))

    got, _, without = asyncio.run(together())
    assert all(not d.logprobs for d in without)
    lps = [lp for d in got for lp in d.logprobs]
    reference = own_generate(worker, model_dir, greedy)
    assert len(lps) == got[-1].completion_tokens == len(reference) == 6
    for lp, (token, dist) in zip(lps, reference, strict=True):
        top = mx.argsort(-dist)[:3].tolist()
        assert lp.token == token == top[0]
        assert lp.logprob == pytest.approx(dist[token].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == top
        assert [v for _, v in lp.top] == pytest.approx([dist[t].item() for t in top], abs=1e-4)


def test_sampled_logprobs_are_the_distribution_drawn_from(engine):
    """Per-request sampling leaves mlx-vlm's batch only the drawn token (0 there, -inf
    elsewhere); logprobs come from before that, where temperature is not yet applied."""
    def logprobs(sampling: SamplingParams):
        got = asyncio.run(deltas(engine, request(engine, "What?", [image(3)], max_tokens=8, logprobs=4,
                                                 sampling=sampling)))
        return [lp for d in got for lp in d.logprobs]

    hot = logprobs(replace(GREEDY, temperature=1.0, seed=11))
    assert hot == logprobs(replace(GREEDY, temperature=1.0, seed=11))
    for lp in hot:
        assert -30 < lp.logprob < 0 and all(-30 < v < 0 for _, v in lp.top)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert lp.logprob <= lp.top[0][1] and dict(lp.top).get(lp.token, lp.logprob) == lp.logprob
    # The first token is drawn from the prompt alone: the same distribution greedy sees.
    assert hot[0].top == logprobs(replace(GREEDY, temperature=0.0))[0].top


async def deltas(engine: VlmEngine, req: GenerationRequest) -> list[TokenDelta]:
    return [d async for d in engine.stream(req)]
