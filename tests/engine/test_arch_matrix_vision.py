"""What Tandem serves today for each vision-language architecture: issue 29's list for native VLMs.

Every tiny random VLM of the zoo (tests/fixtures/zoo_vision.py) is first checked through
mlx-vlm alone (it loads, and two images give two answers), then served natively by the
real server (``vision_mode: native``, the openai SDK as the client), one at a time: it
loads, answers about an image, tells two images apart, keeps each image row's answer in a
shared batch, and reuses turn 1, image included, in turn 2. What fails on today's engine
is ``xfail(strict=True)`` with what fails and why (``GAPS``), as in test_arch_matrix.py.

Images are 224 x 168 and ``max_pixels`` lets them through whole, so Idefics3, SmolVLM and
LFM2-VL split them into tiles and Pixtral into rows; ``lfm2_vl_small`` serves LFM2-VL with
images small enough to stay one tile.
"""

from __future__ import annotations

import contextlib
import io
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import yaml
from openai import OpenAI

from tests.api.serving import Served, serving
from tests.fixtures.zoo_vision import ZOO_VLM
from tests.vision.sample_images import data_url, striped_bytes

MAX_TOKENS = 8
SLACK = 4
# Rounds of requests sent together in the batch test.
ROUNDS = 4
SIZE = (224, 168)
# What each served entry is: the zoo's model, and the largest image (pixels) it takes.
SERVED: dict[str, tuple[str, int]] = {
    **{name: (name, SIZE[0] * SIZE[1]) for name in ZOO_VLM},
    "lfm2_vl_small": ("lfm2_vl", 160 * 120),
}


def image(seed: int) -> str:
    return data_url(striped_bytes(seed, SIZE))


# ---- what fails today, and why (issue 29) ------------------------------------------------

# Gaps of every test on one model, and of one test by model: none since one engine serves
# every VLM's rows in Tandem's decode step (issue 29).
MODEL_GAPS: dict[str, str] = {}
GAPS: dict[str, dict[str, str]] = {}


def cases(test: str) -> list[Any]:
    marked = []
    for name in SERVED:
        reason = MODEL_GAPS.get(name) or GAPS.get(test, {}).get(name)
        marks = [pytest.mark.xfail(strict=True, reason=f"issue 29: {reason}")] if reason else []
        marked.append(pytest.param(name, marks=marks, id=name))
    return marked


def matrix(test: str, fixture: str = "vlm"):
    return pytest.mark.parametrize(fixture, cases(test), indirect=True, scope="module")


# ---- one server per model ------------------------------------------------------------------


class VlmServer:
    """A zoo VLM served natively as ``vlm`` by the real server."""

    def __init__(self, served: Served) -> None:
        self.served = served

    @contextlib.contextmanager
    def client(self) -> Iterator[OpenAI]:
        with OpenAI(base_url=self.served.base_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
            yield c

    def ask(self, *images: str, text: str = "What is in the picture?", history: list[dict[str, Any]] = (),
            **kw: Any) -> Any:
        with self.client() as c:
            return c.chat.completions.create(model="vlm", messages=[*history, user(text, *images)],
                                             **{"max_tokens": MAX_TOKENS, "temperature": 0, **kw})


def user(text: str, *images: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "text", "text": text},
                                        *({"type": "image_url", "image_url": {"url": u}} for u in images)]}


def vlm_yaml(path: str, max_pixels: int, cache_dir: Any, **params: Any) -> str:
    entry = {"name": "vlm", "local_path": path, "capabilities": {"vision_mode": "native"},
             "params": {"mem": 16, "max_tokens": MAX_TOKENS, "temperature": 0.0, "max_num_seqs": 4,
                        "cache_min_tokens": 8, "max_images_per_request": 2, "max_pixels": max_pixels,
                        "prompt_cache_disk_mb": 64, "prompt_cache_disk_dir": str(cache_dir), **params}}
    return yaml.safe_dump({"server": {"shutdown_grace_s": 1}, "models": [entry]})


@pytest.fixture(scope="module")
def vlm(request, tmp_path_factory, zoo_vlm) -> Iterator[VlmServer]:
    model, max_pixels = SERVED[request.param]
    tmp = tmp_path_factory.mktemp(f"vlm-{request.param}")
    with serving(tmp, vlm_yaml(str(zoo_vlm(model)), max_pixels, tmp / "prompt-cache")) as served:
        yield VlmServer(served)


@pytest.fixture(scope="module")
def vlm_kv8(request, tmp_path_factory, zoo_vlm) -> Iterator[VlmServer]:
    model, max_pixels = SERVED[request.param]
    tmp = tmp_path_factory.mktemp(f"vlm8-{request.param}")
    with serving(tmp, vlm_yaml(str(zoo_vlm(model)), max_pixels, tmp / "prompt-cache", kv_cache_bits=8)) as served:
        yield VlmServer(served)


def answer(r: Any) -> str:
    return r.choices[0].message.content or ""


# ---- the zoo itself, through mlx-vlm alone -------------------------------------------------


@pytest.mark.parametrize("name", list(ZOO_VLM))
def test_mlx_vlm_generate_tells_two_images_apart(zoo_vlm, name):
    """The directory loads in mlx-vlm, its processor places the image, and the tower's
    features reach the language model: two images give two answers."""
    from mlx_vlm import generate, load
    from mlx_vlm.prompt_utils import apply_chat_template
    from PIL import Image

    model, processor = load(str(zoo_vlm(name)))
    prompt = apply_chat_template(processor, model.config, "What is in the picture?", num_images=1)
    texts = [generate(model, processor, prompt, image=[Image.open(io.BytesIO(striped_bytes(seed, SIZE)))],
                      max_tokens=MAX_TOKENS, temperature=0.0, verbose=False).text for seed in (1, 2)]
    assert texts[0] != texts[1]


# ---- the matrix ------------------------------------------------------------------------------


@matrix("loads")
def test_loads(vlm):
    r = vlm.ask()  # text only
    assert r.usage.completion_tokens > 0


@matrix("image")
def test_an_image_answer(vlm):
    with_image, text_only = vlm.ask(image(1)), vlm.ask()
    assert with_image.usage.completion_tokens > 0
    assert with_image.usage.prompt_tokens > text_only.usage.prompt_tokens  # the image's tokens count


@matrix("two_images")
def test_two_images_give_different_answers(vlm):
    assert answer(vlm.ask(image(1))) != answer(vlm.ask(image(2)))


@matrix("batch")
def test_image_rows_in_one_batch_keep_their_lone_answers(vlm):
    """Three image requests sent at once answer as each does alone. They meet in the batch
    whenever they overlap; they are prefilled in one step only when they reach the engine
    together, which a barrier makes likely and ``ROUNDS`` rounds make all but certain."""
    urls = [image(seed) for seed in (3, 4, 5)]
    alone = [answer(vlm.ask(u, extra_body={"cache_salt": "alone"})) for u in urls]
    for round_ in range(ROUNDS):
        start = threading.Barrier(len(urls))

        def together(url: str, salt: str = f"together-{round_}", start: threading.Barrier = start) -> str:
            start.wait()
            return answer(vlm.ask(url, extra_body={"cache_salt": salt}))

        with ThreadPoolExecutor(len(urls)) as pool:
            assert list(pool.map(together, urls)) == alone, f"round {round_}"


@matrix("turn_2")
def test_turn_2_reuses_turn_1_with_the_image(vlm):
    """Turn 2 of a conversation about an image starts from turn 1: its prompt, image included."""
    _turn_2(vlm)


def _turn_2(vlm: VlmServer) -> None:
    url = image(6)
    one = vlm.ask(url)
    history = [user("What is in the picture?", url), {"role": "assistant", "content": answer(one)}]
    two = vlm.ask(text="And the colours?", history=history)
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert cached >= one.usage.prompt_tokens - SLACK, f"turn 2 reused {cached} of turn 1's {one.usage.prompt_tokens}"
    cold = vlm.ask(text="And the colours?", history=history, extra_body={"cache_salt": "cold"})
    assert answer(two) == answer(cold)


@matrix("stream")
def test_streamed_equals_non_streamed(vlm):
    url = image(7)
    whole = answer(vlm.ask(url))
    with vlm.client() as c:
        stream = c.chat.completions.create(model="vlm", messages=[user("What is in the picture?", url)],
                                           max_tokens=MAX_TOKENS, temperature=0, stream=True)
        streamed = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert streamed == whole


def speculated(vlm: VlmServer) -> dict[str, int]:
    """The prediction drafter's counts so far (/health): tokens proposed and accepted."""
    health = vlm.served.get("/health").json()
    return health["engine"]["speculation"].get("prediction", {"proposed": 0, "accepted": 0})


@matrix("prediction")
def test_an_exact_prediction_of_an_image_answer_keeps_it_and_is_verified(vlm):
    """The answer as the model wrote it, as the prediction: the same answer, and the verify
    steps check it (and accept some of it where its text tokenizes back to the tokens: a
    random model's answer often holds pieces of characters, which do not)."""
    for seed in range(8, 16):
        url = image(seed)
        plain = vlm.ask(url, logprobs=True, max_tokens=16, extra_body={"cache_salt": "plain"})
        text = "".join(bytes(e.bytes).decode("utf-8", errors="replace") for e in plain.choices[0].logprobs.content)
        if "\ufffd" not in text:
            break
    before = speculated(vlm)
    predicted = vlm.ask(url, max_tokens=16, prediction={"type": "content", "content": text},
                        extra_body={"cache_salt": "predicted"})
    after = speculated(vlm)
    assert answer(predicted) == answer(plain)
    assert after["proposed"] > before["proposed"], "the engine verified none of the prediction"
    if "\ufffd" not in text:
        assert after["accepted"] > before["accepted"]


@matrix("kv_bits", "vlm_kv8")
def test_kv_cache_bits_8(vlm_kv8):
    """Quantized KV serves images, tells two apart, and turn 2 reuses turn 1."""
    assert answer(vlm_kv8.ask(image(1))) != answer(vlm_kv8.ask(image(2)))
    _turn_2(vlm_kv8)


@matrix("n")
def test_n_choices_with_an_image(vlm):
    url = image(9)
    one = vlm.ask(url, extra_body={"cache_salt": "one"})
    three = vlm.ask(url, n=3, extra_body={"cache_salt": "three"})
    assert {c.message.content for c in three.choices} == {answer(one)}  # greedy: one answer thrice
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens


@matrix("json_schema")
def test_json_schema_about_an_image(vlm):
    r = vlm.ask(image(10), response_format={"type": "json_schema", "json_schema": {
        "name": "colour", "schema": {"enum": ["red", "blue"]}, "strict": True}})
    assert answer(r).strip('"') in ("red", "blue")


@matrix("logprobs")
def test_logprobs_about_an_image(vlm):
    r = vlm.ask(image(11), logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens > 0
    for entry in content:  # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].token == entry.token


@pytest.mark.parametrize("name", cases("restart"))
def test_turn_2_with_the_image_reuses_turn_1_after_a_restart(name, tmp_path, zoo_vlm):
    """The disk tier keeps turn 1, image included, across a restart."""
    model, max_pixels = SERVED[name]
    text = vlm_yaml(str(zoo_vlm(model)), max_pixels, tmp_path / "prompt-cache")
    url = image(12)
    for run in ("one", "two"):
        (tmp_path / run).mkdir()
    with serving(tmp_path / "one", text) as served:
        one = VlmServer(served).ask(url)
        assert served.state.registry.loaded_chat("vlm").finish_writes(30)
    history = [user("What is in the picture?", url), {"role": "assistant", "content": answer(one)}]
    with serving(tmp_path / "two", text) as served:
        server = VlmServer(served)
        two = server.ask(text="And the colours?", history=history)
        cold = server.ask(text="And the colours?", history=history, extra_body={"cache_salt": "cold"})
        hits = served.get("/health").json()["engine"]["prompt_cache_tiers"]["disk"]["hits"]
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert cached >= one.usage.prompt_tokens - SLACK and hits >= 1, f"turn 2 reused {cached}"
    assert answer(two) == answer(cold)
