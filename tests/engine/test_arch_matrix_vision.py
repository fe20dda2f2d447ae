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

_RUNS = ("refused at load: the worst-case input fails with 'the processor of vlm made {} image token run(s) for "
         "2 image(s)': the engine takes an image's placeholders for one run, and {}")
MODEL_GAPS: dict[str, str] = {
    "mistral3": _RUNS.format(8, "Pixtral ends each row of an image with [IMG_BREAK] and the image with [IMG_END]"),
    "idefics3": _RUNS.format(10, "Idefics3 splits an image into tiles (<row_i_col_j>) and a <global-img>"),
    "smolvlm": _RUNS.format(10, "SmolVLM splits an image into tiles (<row_i_col_j>) and a <global-img>"),
    "lfm2_vl": _RUNS.format(20, "LFM2-VL splits an image past its patch budget into tiles and a thumbnail"),
    "gemma3": ("refused at load: 'the chat template of vlm wrote 0 image placeholder(s) for 2 image(s)': Gemma 3's "
               "template writes <start_of_image> and its processor expands it into <image_soft_token>s, while the "
               "engine counts the expanded token in the rendered text"),
}
GAPS: dict[str, dict[str, str]] = {
    "batch": {"qwen3_vl": "image rows prefilled in one step change each other's answers (one row of three, in 5 "
                          "of 6 runs of a round; rows that join the batch at different steps keep theirs; "
                          "the cause is not diagnosed here, Qwen2.5-VL's rows keep theirs)"},
    "turn_2": {name: "turn 2 reuses 0 tokens: the native VLM engine's prefix cache serves Qwen2-VL and Qwen2.5-VL only"
               for name in ("qwen3_vl", "lfm2_vl_small")},
}


def cases(test: str) -> list[Any]:
    marked = []
    for name in SERVED:
        reason = MODEL_GAPS.get(name) or GAPS.get(test, {}).get(name)
        marks = [pytest.mark.xfail(strict=True, reason=f"issue 29: {reason}")] if reason else []
        marked.append(pytest.param(name, marks=marks, id=name))
    return marked


def matrix(test: str):
    return pytest.mark.parametrize("vlm", cases(test), indirect=True, scope="module")


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


@pytest.fixture(scope="module")
def vlm(request, tmp_path_factory, zoo_vlm) -> Iterator[VlmServer]:
    model, max_pixels = SERVED[request.param]
    entry = {"name": "vlm", "local_path": str(zoo_vlm(model)), "capabilities": {"vision_mode": "native"},
             "params": {"mem": 16, "max_tokens": MAX_TOKENS, "temperature": 0.0, "max_num_seqs": 4,
                        "cache_min_tokens": 8, "max_images_per_request": 2, "max_pixels": max_pixels}}
    text = yaml.safe_dump({"server": {"shutdown_grace_s": 1}, "models": [entry]})
    with serving(tmp_path_factory.mktemp(f"vlm-{request.param}"), text) as served:
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
    url = image(6)
    one = vlm.ask(url)
    history = [user("What is in the picture?", url), {"role": "assistant", "content": answer(one)}]
    two = vlm.ask(text="And the colours?", history=history)
    cached = two.usage.prompt_tokens_details.cached_tokens
    assert cached >= one.usage.prompt_tokens - SLACK, f"turn 2 reused {cached} of turn 1's {one.usage.prompt_tokens}"
    cold = vlm.ask(text="And the colours?", history=history, extra_body={"cache_salt": "cold"})
    assert answer(two) == answer(cold)
