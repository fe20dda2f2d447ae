"""Native VLM rows in Tandem's decode step (``DecodeBatch`` over ``VlmForward``), on tiny
random-weight VLMs of every mlx-vlm type Tandem lists (Qwen2-VL from tiny_vlm, the rest from
the zoo), through mlx-vlm's real processors, vision towers and language models.

For each type, at temperature 0: a row's tokens are mlx-vlm's own ``stream_generate``'s for
the same prompt and images; three image rows and a text row in one batch each give their
lone answer, whatever the prefill chunk cuts (and with 8-bit KV); proposals verified in the
batch (all kept, or rejected and rolled back) leave every answer as it is; a row resumed from
its first turn's KV (taken from the step) gives what a full prefill of the second turn
gives; a row taken out (in prefill, or decoding) and put back answers as if never paused;
two images in one batch change the first token's distribution; a score row about an image
reads the distribution a generation draws from.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from io import BytesIO
from typing import Any

import mlx.core as mx
import pytest
from PIL import Image

from app.config.schema import ChatParams
from app.engine.batch.vision_features import FeatureCache, prompt_row_inputs
from app.engine.kv.layers import all_trim, at_checkpoint
from app.engine.mlx_internals import vlm_stop_tokens
from app.engine.models.vlm import LoadedVlm, VlmPrompts, load_vlm
from app.engine.models.vlm_forward import VlmForward, new_vlm_decode_batch, rebase
from app.engine.prompt import MultimodalPrompt, Prompt
from app.engine.step import DecodeBatch, Drawn, RowProposal, ScoreResponse, ScoreSpec
from app.engine.step.phase import merge
from app.engine.step.rows import Feed, Row
from app.specs import load_params
from tests.fixtures.tiny_vlm import build_tiny_qwen2_vl
from tests.fixtures.zoo_vision import ZOO_VLM
from tests.vision.sample_images import striped_bytes

TOKENS = 8

# The mlx-vlm types Tandem lists: tiny_vlm's Qwen2-VL and the zoo's (tests/fixtures/zoo_vision.py).
FAMILIES = ["qwen2_vl", *ZOO_VLM]


@dataclass
class Vlm:
    loaded: LoadedVlm
    prompts: VlmPrompts
    stops: frozenset[int]

    def prompt(self, text: str, images: list[Image.Image]) -> tuple[str, Prompt]:
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        rendered = self.prompts.render([{"role": "user", "content": content}])
        return rendered, self.prompts.build(rendered, images)

    def batch(self, prefill_step_size: int = 16, checkpoints: bool = False) -> DecodeBatch:
        return new_vlm_decode_batch(self.loaded.model, self.loaded.processor, prefill_step_size=prefill_step_size,
                                    prefill_batch_size=4, completion_batch_size=4, checkpoints=checkpoints)

    def inputs(self, prompt: Prompt, done: int = 0, features: FeatureCache | None = None) -> Any:
        loaded = self.loaded
        return prompt_row_inputs(loaded.model, prompt, features, "", loaded.max_pixels, loaded.min_pixels,
                                 cached_tokens=done)

    def reference(self, text: str, images: list[Image.Image]) -> list[int]:
        """mlx-vlm's own greedy tokens for the rendered prompt and its images."""
        from mlx_vlm.generate import stream_generate

        out = []
        for r in stream_generate(self.loaded.model, self.loaded.processor, text, image=images or None,
                                 max_tokens=TOKENS, temperature=0.0):
            out.append(r.token)
            if r.token in self.stops or len(out) == TOKENS:
                break
        return out


def run(batch: DecodeBatch, prompts: list[Prompt], inputs: list[Any], *, caches: list[Any] | None = None,
        done: list[int] | None = None, proposals: Callable[[int, list[int]], tuple[int, ...]] | None = None,
        outcomes: list[Any] | None = None) -> tuple[list[list[int]], dict[int, Any]]:
    """Each row's tokens, and each row's last response (with its KV); each verify step's
    outcomes into ``outcomes``."""
    done = done or [0] * len(prompts)
    uids = batch.insert_segments([[p.tokens[d:]] for p, d in zip(prompts, done, strict=True)],
                                 max_tokens=[TOKENS] * len(prompts), inputs=inputs, caches=caches,
                                 all_tokens=[p.tokens[:d] for p, d in zip(prompts, done, strict=True)])
    return finish(batch, uids, proposals=proposals, outcomes=outcomes)


def finish(batch: DecodeBatch, uids: list[int], *, proposals: Callable[[int, list[int]], tuple[int, ...]] | None = None,
           outcomes: list[Any] | None = None) -> tuple[list[list[int]], dict[int, Any]]:
    """Steps until the rows ``uids`` finish: their tokens, and each one's last response."""
    out: dict[int, list[int]] = {u: [] for u in uids}
    last: dict[int, Any] = {}
    while len(last) < len(uids):
        if proposals is not None:
            pending = batch.pending()
            batch.propose({u: RowProposal(proposals(u, out[u])) for u in pending})
        _, responses = batch.next()
        if outcomes is not None:
            outcomes.extend(batch.outcomes.values())
        for r in responses:
            out[r.uid].append(r.token)
            if r.finish_reason is not None:
                last[r.uid] = r
    return [out[u] for u in uids], {i: last[u] for i, u in enumerate(uids)}


def image(seed: int, size: tuple[int, int] = (96, 72)) -> Image.Image:
    return Image.open(BytesIO(striped_bytes(seed, size))).convert("RGB")


# (text, images as (seed, size)): the last image is large enough for the tiling families to tile.
CASES = [("What is this?", [(1, (96, 72))]), ("Describe the picture, please.", [(2, (96, 72))]),
         ("Compare the two.", [(3, (96, 72)), (4, (224, 160))]), ("Hello there, who are you?", [])]


@pytest.fixture(scope="module", params=FAMILIES)
def vlm(request, tmp_path_factory, zoo_vlm) -> Vlm:
    name = request.param
    path = build_tiny_qwen2_vl(tmp_path_factory.mktemp(name)) if name == "qwen2_vl" else zoo_vlm(name)
    loaded = load_vlm(str(path), load_params(ChatParams()), name=name, max_pixels=448 * 448,
                      min_pixels=28 * 28, max_images=3)
    return Vlm(loaded, VlmPrompts(loaded), frozenset(vlm_stop_tokens(loaded.processor, loaded.model)))


@pytest.fixture(scope="module")
def references(vlm) -> list[tuple[Prompt, list[int]]]:
    out = []
    for text, pictures in CASES:
        images = [image(seed, size) for seed, size in pictures]
        rendered, prompt = vlm.prompt(text, images)
        out.append((prompt, vlm.reference(rendered, images)))
    return out


def test_each_rows_tokens_are_mlx_vlms_own(vlm, references):
    for prompt, expected in references:
        tokens, _ = run(vlm.batch(), [prompt], [vlm.inputs(prompt)])
        assert tokens == [expected]


@pytest.mark.parametrize("chunk", [3, 64])
def test_a_mixed_batch_gives_each_row_its_lone_answer(vlm, references, chunk):
    """Three image rows and a text row share every pass; a chunk of 3 cuts images apart."""
    prompts = [p for p, _ in references]
    tokens, _ = run(vlm.batch(chunk), prompts, [vlm.inputs(p) for p in prompts])
    assert tokens == [expected for _, expected in references]


def test_proposals_verified_in_the_batch_keep_the_answer(vlm, references):
    """Rows that speculate feed k + 1 tokens a pass (the right continuation, or a wrong one
    rolled back), beside rows that do not: every answer stays the greedy one."""
    prompts = [p for p, _ in references]
    expected = {i: e for i, (_, e) in enumerate(references)}

    def right(uid: int, so_far: list[int]) -> tuple[int, ...]:
        return tuple(expected[uid][len(so_far) + 1:len(so_far) + 4]) if uid % 2 == 0 else ()

    def wrong(uid: int, so_far: list[int]) -> tuple[int, ...]:
        return (5, 6) if uid % 2 == 1 else ()

    for proposals in (right, wrong):
        outcomes: list[Any] = []
        tokens, _ = run(vlm.batch(8), prompts, [vlm.inputs(p) for p in prompts], proposals=proposals,
                        outcomes=outcomes)
        assert tokens == [e for _, e in references]
        accepted = sum(o.accepted for o in outcomes)
        assert (accepted > 0) if proposals is right else (accepted < sum(o.proposed for o in outcomes))


def test_quantized_kv_rows_keep_their_lone_answers(vlm, references):
    """With 8-bit KV (``kv_cache_bits``: the plain KV layers quantized, windows and recurrent
    state as they are), image and text rows sharing every pass keep their lone answers."""
    forward = VlmForward(vlm.loaded.model)
    prompts = [p for p, _ in references]
    try:
        caches = [forward.quantized_cache(8, 32) for _ in prompts]
        run(vlm.batch(), prompts[:1], [vlm.inputs(prompts[0])], caches=caches[:1])
    except Exception as exc:  # noqa: BLE001 - the tiny model's head_dim is no multiple of a quantization group
        pytest.skip(f"{vlm.loaded.name}: no 8-bit KV at group 32 ({exc})")
    lone = [run(vlm.batch(), [p], [vlm.inputs(p)], caches=[forward.quantized_cache(8, 32)])[0][0] for p in prompts]
    together, _ = run(vlm.batch(3), prompts, [vlm.inputs(p) for p in prompts],
                      caches=[forward.quantized_cache(8, 32) for _ in prompts])
    assert together == lone


def test_a_row_resumed_from_its_first_turns_kv_gives_a_full_prefills_answer(vlm, references):
    """Turn one's KV, taken from the step, starts turn two (which adds an image): from the
    checkpoint where turn one's prompt ended (every cache kind: windows and recurrent
    state are restored there), and, where every layer trims, from the longest prefix turn
    two shares with turn one's prompt and answer."""
    prompt, answer = references[0]
    _, last = run(vlm.batch(checkpoints=True), [prompt], [vlm.inputs(prompt)])
    kv, held = last[0].prompt_cache, last[0].all_tokens
    turn2 = extend(vlm, answer, [image(*CASES[0][1][0]), image(5)])
    assert isinstance(turn2, MultimodalPrompt)
    starts = [(n, at_checkpoint(kv, n, states)) for n, states in kv.checkpoints if turn2.tokens[:n] == held[:n]]
    if all_trim(kv):
        n = next(i for i, (a, b) in enumerate(zip([*held, -1], [*turn2.tokens, -2], strict=False)) if a != b)
        starts.append((n, at_checkpoint(kv, n, [None] * len(kv))))
    assert starts
    full, _ = run(vlm.batch(), [turn2], [vlm.inputs(turn2)])
    features = FeatureCache(2**24)  # where the model takes image features one by one (Qwen2-VL, Qwen2.5-VL)
    for done, cache in starts:
        assert done > turn2.images[0].start + turn2.images[0].length, "the cached prefix holds the first image"
        for held_features in (None, features, features):  # without, then filling and hitting the feature cache
            resumed, _ = run(vlm.batch(), [turn2], [vlm.inputs(turn2, done, held_features)],
                             caches=[copy.deepcopy(cache)], done=[done])
            assert resumed == full


@pytest.mark.parametrize("emitted", [0, 3])
def test_a_row_taken_out_and_put_back_answers_as_if_never_paused(vlm, references, emitted):
    """An image row removed with its KV (in prefill, after a chunk; or decoding, after 3
    tokens) and re-inserted (the rest of its prompt; or the token it had drawn, ``Drawn``)
    with its inputs rebased to what its KV holds gives its uninterrupted answer."""
    prompt, expected = references[2]
    inputs = vlm.inputs(prompt)
    b = vlm.batch(prefill_step_size=5)
    (uid,) = b.insert_segments([[prompt.tokens]], max_tokens=[TOKENS], inputs=[inputs])
    out: list[int] = []
    b.next()
    while len(out) < emitted:
        out += [r.token for r in b.next()[1]]
    drawn = b.pending_of(uid)
    cache, held = b.remove([uid], return_prompt_caches=True)[uid]
    assert (drawn is not None) == bool(emitted) and 0 < len(held) <= len(prompt.tokens) + emitted
    rest = [drawn[0]] if drawn is not None else prompt.tokens[len(held):]
    again = b.insert_segments([[rest]], max_tokens=[TOKENS - len(out)], caches=[cache], all_tokens=[held],
                              inputs=[rebase(inputs, len(held))], drawn=[Drawn(drawn[1]) if drawn else None])
    resumed, _ = finish(b, again)
    assert out + resumed[0] == expected


def extend(vlm: Vlm, answer: list[int], images: list[Image.Image]) -> Prompt:
    """Turn two: turn one, its answer, and a new user message with one more image."""
    first = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": CASES[0][0]}]}
    said = vlm.loaded.tokenizer.decode(answer, skip_special_tokens=True)
    second = {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "And this one?"}]}
    rendered = vlm.prompts.render([first, {"role": "assistant", "content": said}, second])
    return vlm.prompts.build(rendered, images)


def test_two_images_give_two_answers(vlm, references):
    """The picture reaches the model, each row its own: another image in the same place, in
    the same batch, changes the distribution of the first token."""
    prompts = [references[0][0], vlm.prompt(CASES[0][0], [image(9, (64, 96))])[1]]
    batch = vlm.batch()
    uids = batch.insert_segments([[p.tokens] for p in prompts], max_tokens=[1, 1],
                                 inputs=[vlm.inputs(p) for p in prompts])
    first: dict[int, mx.array] = {}
    while len(first) < len(uids):
        for r in batch.next()[1]:
            first.setdefault(r.uid, r.logprobs)
    assert not mx.allclose(first[uids[0]], first[uids[1]], atol=1e-4).item()


def test_a_row_past_its_prompt_lets_its_embeddings_go(vlm, references):
    """A pass that starts after a row's prompt drops the row's embeddings and image features
    (a new RowInputs: another row may share the first), keeping what places its next tokens."""
    prompt = references[0][0]
    shared = vlm.inputs(prompt)
    forward = VlmForward(vlm.loaded.model)
    rows = [Row(uid=i, segments=[], tokens=list(prompt.tokens), max_tokens=1, sampler=None, processors=(),
                inputs=shared) for i in range(2)]
    cache = merge([forward.make_cache() for _ in rows])
    n = len(prompt.tokens)
    forward(mx.array([[prompt.tokens[-1]], [7]]), cache, Feed(rows, [n - 1, n], [1, 1], decode=True))
    assert rows[0].inputs is shared, "still feeding its prompt"
    assert rows[1].inputs is not None and rows[1].inputs.embeddings is None
    assert set(rows[1].inputs.extras) <= {"rope_delta", "sections"}
    assert shared.embeddings is not None


def test_score_rows_read_the_distribution_a_generation_draws_from(vlm, references):
    """A score row about an image (a decision's option read whole: its tokens after the prompt,
    then candidates for the next one) reads the very log-probabilities a generation of the
    same prompt draws its tokens from, beside a generating row in the same batch."""
    prompt, want = references[0]
    assert isinstance(prompt, MultimodalPrompt) and len(want) >= 3
    batch = vlm.batch()
    (gen,) = batch.insert_segments([[prompt.tokens]], max_tokens=[3], inputs=[vlm.inputs(prompt)])
    drawn: list[tuple[int, mx.array]] = []
    while len(drawn) < 3:
        drawn += [(r.token, r.logprobs) for r in batch.next()[1] if r.uid == gen]
    assert [t for t, _ in drawn] == want[:3]
    read = MultimodalPrompt([*prompt.tokens, *want[:2]], prompt.images, prompt.inputs)
    (row,) = batch.insert_segments([[read.tokens]], max_tokens=[0], inputs=[vlm.inputs(read)],
                                   scores=[ScoreSpec(tail=2, next_tokens=(want[2], 7))])
    (beside,) = batch.insert_segments([[prompt.tokens]], max_tokens=[2], inputs=[vlm.inputs(prompt)])
    scored = None
    while scored is None:
        scored = next((r for r in batch.next()[1] if r.uid == row), None)
    assert isinstance(scored, ScoreResponse)
    assert scored.tail == pytest.approx([drawn[0][1][want[0]].item(), drawn[1][1][want[1]].item()], abs=1e-3)
    assert scored.next == pytest.approx([drawn[2][1][want[2]].item(), drawn[2][1][7].item()], abs=1e-3)
    assert finish(batch, [beside])[0] == [want[:2]]
