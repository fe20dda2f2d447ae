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

from app.config.schema import ChatParams
from app.engine.batch.engine import TextEngine
from app.engine.mlx_internals import reset_vlm_stopping, vlm_prompt_inputs
from app.engine.models.vlm import LoadedVlm, load_vlm
from app.engine.prompt import MultimodalPrompt, TokenPrompt, completion_room, pixel_digest
from app.engine.types import GREEDY, GenerationRecord, GenerationRequest, SamplingParams, TokenDelta
from app.engine.worker import MLXWorker
from app.errors import ContextLengthError, EngineError, ImageError, InvalidRequestError
from app.specs import engine_params, load_params
from app.vision.images import ImagePolicy
from tests.engine.engines import run, vlm_engine
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
    params = engine_params(ChatParams(mem=16, max_num_seqs=4, prefill_chunk_size=32))
    eng = vlm_engine(worker, load(worker, model_dir), params)
    records: list[GenerationRecord] = []
    eng.add_listener(records.append)
    eng.records = records  # type: ignore[attr-defined]
    return eng


def image(seed: int, size: tuple[int, int] = (96, 72)) -> Image.Image:
    return Image.open(BytesIO(striped_bytes(seed, size))).convert("RGB")


def render(engine: TextEngine, text: str, n_images: int = 0) -> str:
    content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": text}]
    return engine.prompts.render([{"role": "user", "content": content}])


def request(engine: TextEngine, text: str, images=(), max_tokens: int = 8, **kw) -> GenerationRequest:
    """A request as the pipeline makes one: the VLM's prompt builder renders and builds it."""
    prompt = engine.prompts.build(render(engine, text, len(images)), list(images))
    return GenerationRequest(prompt, max_tokens=max_tokens, **kw)


def generate(engine: TextEngine, req: GenerationRequest):
    return asyncio.run(run(engine, req))


def test_images_reach_the_model(engine):
    a, _ = generate(engine, request(engine, "What is this?", [image(1)]))
    b, _ = generate(engine, request(engine, "What is this?", [image(2)]))
    req = request(engine, "What is this?", [image(1)])
    a2, last = generate(engine, req)
    assert a != b, "different images must give different outputs"
    assert a == a2, "temperature 0: the same image gives the same output"
    text_only = len(request(engine, "What is this?").prompt.tokens)
    assert last.prompt_tokens > text_only + 1, "the processor expanded the placeholder into the image's tokens"
    assert engine.records[-1].prompt_tokens == last.prompt_tokens
    # The prompt's tokens are exact at prepare time: what the engine ran, image run included.
    assert last.prompt_tokens == len(req.prompt.tokens)


def test_a_multimodal_prompt_knows_its_images(engine):
    """Each image: its run of placeholder tokens (the processor's real length), and a hash
    of its decoded pixels that names the picture, not the request."""
    token_id = engine.loaded.image_token_id
    req = request(engine, "Compare", [image(1), image(2, (60, 120))])
    prompt = req.prompt
    assert isinstance(prompt, MultimodalPrompt) and len(prompt.images) == 2
    first, second = prompt.images
    assert first.start + first.length < second.start
    for span in prompt.images:
        assert span.length > 1 and set(prompt.tokens[span.start:span.start + span.length]) == {token_id}
        assert prompt.tokens[span.start - 1] != token_id and prompt.tokens[span.start + span.length] != token_id
    assert prompt.tokens.count(token_id) == first.length + second.length
    assert first.length != second.length, "the run's length follows the image's size"
    again = request(engine, "Something else", [image(1)]).prompt
    assert again.images[0].digest == first.digest != second.digest
    assert first.digest == pixel_digest(image(1))
    assert isinstance(request(engine, "No picture").prompt, TokenPrompt)


def test_text_only_request(engine):
    req = request(engine, "Hello there, how are you?")
    text, last = generate(engine, req)
    assert last.finish_reason == "length" and last.completion_tokens == 8 and text
    # The same prompt tokenized as text models are (the tokenizer alone) gives the same output.
    ids = engine.tokenizer.encode(render(engine, "Hello there, how are you?"), add_special_tokens=False)
    assert req.prompt == TokenPrompt(ids)
    # The tokenizer alone (any thread) tokenizes as mlx-vlm's prepare_inputs does without images.
    loaded = engine.loaded
    processed = engine.worker.submit(lambda: vlm_prompt_inputs(
        loaded.model, loaded.processor, render(engine, "Hello there, how are you?"), [])["input_ids"][0].tolist())
    assert processed.result() == ids
    assert generate(engine, GenerationRequest(TokenPrompt(ids), max_tokens=8))[0] == text
    assert last.prompt_tokens == len(ids)


def test_placeholders_come_from_the_template(engine):
    token = engine.loaded.image_token
    content = [{"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "text", "text": "with"},
               {"type": "image"}]
    prompt = engine.prompts.render([{"role": "user", "content": content}])
    assert token == "<|image_pad|>" and prompt.count(token) == 2
    assert prompt.index("Compare") < prompt.index(token) < prompt.index("with") < prompt.rindex(token)
    with pytest.raises(InvalidRequestError, match="user messages only"):
        engine.prompts.render([{"role": "assistant", "content": [{"type": "image"}]}])


def test_one_placeholder_per_image(engine):
    """mlx-vlm's processor would drop a surplus image (or placeholder) in silence: the
    builder refuses the mismatch, naming it."""
    with pytest.raises(InvalidRequestError, match="1 image placeholder\\(s\\) for 2"):
        engine.prompts.build(render(engine, "What is this?", 1), [image(1), image(2)])
    with pytest.raises(InvalidRequestError, match="2 image placeholder\\(s\\) for 1"):
        engine.prompts.build(render(engine, "What is this?", 2), [image(1)])


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
    # Its image's run of tokens without the grid the vision tower needs to encode it.
    inputs = {k: v for k, v in good.prompt.inputs.items() if k != "image_grid_thw"}
    bad = GenerationRequest(MultimodalPrompt(good.prompt.tokens, good.prompt.images, inputs), max_tokens=8)
    alone = generate(engine, good)[0]

    async def both():
        return await asyncio.gather(run(engine, good), run(engine, bad), return_exceptions=True)

    ok, failed = asyncio.run(both())
    assert isinstance(failed, EngineError) and "could not start generation" in failed.message
    assert ok[0] == alone
    assert engine.worker.alive and engine.admission.reserved == 0


def test_context_is_the_real_prompt_length(worker, model_dir):
    """The completion budget is computed once, from the prompt's exact tokens (its image runs
    expanded): it fills the context to the token; the engine refuses what goes beyond."""
    loaded = load(worker, model_dir, max_model_len=64)
    eng = vlm_engine(worker, loaded, engine_params(ChatParams(mem=16, max_num_seqs=2)))
    one = request(eng, "Hi", [image(1)])
    room = completion_room(len(one.prompt.tokens), eng.max_model_len, eng.stats().kv_max_sequence_tokens)
    _, last = generate(eng, GenerationRequest(one.prompt, max_tokens=min(1000, room)))
    assert last.finish_reason == "length" and last.prompt_tokens + last.completion_tokens == 64
    with pytest.raises(ContextLengthError, match="images expanded"):
        generate(eng, GenerationRequest(one.prompt, max_tokens=room + 1))
    big = request(eng, "Hi", [image(1, (448, 448)), image(2, (448, 448))])
    with pytest.raises(ContextLengthError, match="maximum context length is 64 tokens"):
        completion_room(len(big.prompt.tokens), eng.max_model_len, eng.stats().kv_max_sequence_tokens)


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


def test_a_conversation_from_typed_messages(engine):
    """The pipeline's path: typed messages -> template_message -> the VLM's prompt builder -> the engine."""
    from app.pipeline.prompting import template_message
    from app.pipeline.request import ImagePart, Message, TextPart
    from app.vision.native import load_native_images, native_image_parts

    policy = ImagePolicy(max_images_per_request=MAX_IMAGES)
    messages = [
        Message.of("system", "You describe pictures."),
        Message("user", (ImagePart(data_url(striped_bytes(1)), "messages[1].content[0]"), TextPart("What is it?"))),
        Message.of("assistant", "A pattern."),
        Message("user", (TextPart("And this one?"), ImagePart(data_url(striped_bytes(2)), "messages[3].content[1]"))),
    ]
    parts = native_image_parts(messages, policy)
    images = asyncio.run(load_native_images(parts, policy, max_pixels=engine.loaded.max_pixels))
    prompt = engine.prompts.render([template_message(m, images=True) for m in messages])
    assert prompt.count("<|image_pad|>") == 2 and "A pattern." in prompt and "You describe pictures." in prompt
    assert prompt.index("What is it?") < prompt.index("And this one?") < prompt.rindex("<|image_pad|>")
    _, last = generate(engine, GenerationRequest(engine.prompts.build(prompt, images), max_tokens=6))
    assert last.completion_tokens == 6 or last.finish_reason == "stop"


def own_generate(worker, model_dir, req: GenerationRequest, text: str) -> list[tuple[int, mx.array]]:
    """mlx-vlm's own single-sequence ``stream_generate`` at temperature 0 on ``text`` and the
    request's images, on a copy of its own (it keeps M-RoPE state in the model): each token
    and the distribution it came from."""
    from mlx_vlm import stream_generate

    copy = load(worker, model_dir)
    images = [span.image for span in req.prompt.images]

    def steps():
        reset_vlm_stopping(copy.processor, copy.model)
        return [(r.token, r.logprobs) for r in stream_generate(
            copy.model, copy.processor, text, image=images, max_tokens=req.max_tokens,
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
    reference = own_generate(worker, model_dir, greedy, render(engine, "What is this?", 1))
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


async def deltas(engine: TextEngine, req: GenerationRequest) -> list[TokenDelta]:
    return [d async for d in engine.stream(req)]
