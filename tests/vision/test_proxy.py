"""VisionProxy.rewrite with a fake Captioner at the protocol seam.

Messages are written as a client sends them (OpenAI dicts) and parsed into the
pipeline's typed messages the way /v1/chat/completions does."""

from __future__ import annotations

import asyncio
import copy
import logging

import pytest

from app.api.openai.protocol import ChatMessage
from app.errors import EngineError, ImageError
from app.pipeline.request import Message
from app.vision.cache import CaptionCache
from app.vision.captioner import Captioner
from app.vision.images import ImagePolicy, LoadedImage
from app.vision.proxy import VisionProxy
from tests.vision.sample_images import data_url, image_bytes

RED = data_url(image_bytes((255, 0, 0)))
GREEN = data_url(image_bytes((0, 255, 0)))
BLUE = data_url(image_bytes((0, 0, 255)))
BROKEN = "data:image/png;base64,AAAA"


class FakeCaptioner:
    """Names the colour of the image's first pixel; records every call."""

    name = "fake-vlm"

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[str, str | None]] = []
        self.scopes: list[str] = []
        self.fail = fail
        self.running = 0
        self.max_running = 0

    def prompt(self, user_text: str | None) -> str:
        return f"Describe. The user asked: {user_text}"

    async def describe(self, image: LoadedImage, user_text: str | None, *, scope: str = "") -> str:
        self.calls.append((image.sha256, user_text))
        self.scopes.append(scope)
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        await asyncio.sleep(0.01)
        self.running -= 1
        if self.fail:
            raise EngineError("model fell over")
        r, g, b = image.image.getpixel((0, 0))
        return {(255, 0, 0): "red square", (0, 255, 0): "green square"}.get(
            (r, g, b), "blue square"
        )


def user(*parts: dict | str) -> dict:
    content = [{"type": "text", "text": p} if isinstance(p, str) else p for p in parts]
    return {"role": "user", "content": content}


def img(url: str, bare: bool = False) -> dict:
    return {"type": "image_url", "image_url": url if bare else {"url": url, "detail": "auto"}}


def make(captioner=None, **policy) -> VisionProxy:
    return VisionProxy(
        captioner, CaptionCache(), ImagePolicy(**policy), unavailable_reason="out of memory"
    )


def typed(messages: list[dict]) -> list[Message]:
    return [ChatMessage.model_validate(m).to_message(i) for i, m in enumerate(messages)]


def rewrite(proxy: VisionProxy, messages: list[dict], scope: str = ""):
    return asyncio.run(proxy.rewrite(typed(messages), scope=scope))


def text_of(message: Message) -> str:
    """The content of a rewritten message: one text part, no images left."""
    assert not message.images() and len(message.content) == 1
    return message.text()


def test_fake_is_a_captioner():
    assert isinstance(FakeCaptioner(), Captioner)


def test_messages_without_images_pass_through():
    messages = [{"role": "system", "content": "Be brief."}, user("hi", "there")]
    result = rewrite(make(FakeCaptioner()), messages)
    assert result.messages == typed(messages)
    assert result.captions == [] and result.warnings == []


@pytest.mark.parametrize(
    "parts,expected",
    [
        (("What is this?", img(RED)), "What is this?\n\nImage 1: red square"),
        ((img(RED),), "Image 1: red square"),
        (("  ", img(RED)), "Image 1: red square"),
        (
            ("Compare", img(RED), "with", img(GREEN)),
            "Compare\nwith\n\nImage 1: red square\nImage 2: green square",
        ),
    ],
    ids=["text+image", "image only", "blank text", "two images"],
)
def test_combining_rules(parts, expected):
    (message,) = rewrite(make(FakeCaptioner()), [user(*parts)]).messages
    assert message.role == "user" and text_of(message) == expected


def test_numbering_runs_across_messages_and_roles_are_kept():
    messages = [
        {"role": "system", "content": "You are helpful."},
        user("First", img(RED)),
        {"role": "assistant", "content": "A red square."},
        user("And these?", img(GREEN), img(BLUE, bare=True)),
        {"role": "tool", "tool_call_id": "call_1", "content": [img(RED)]},
    ]
    original = copy.deepcopy(messages)
    result = rewrite(make(FakeCaptioner()), messages)
    assert messages == original, "the caller's messages must not be modified"
    assert result.messages[0] == typed(messages)[0] and result.messages[2] == typed(messages)[2]
    assert text_of(result.messages[1]) == "First\n\nImage 1: red square"
    assert text_of(result.messages[3]) == "And these?\n\nImage 2: green square\nImage 3: blue square"
    tool = result.messages[4]
    assert (tool.role, tool.tool_call_id, text_of(tool)) == ("tool", "call_1", "Image 4: red square")
    assert [(c.message_index, c.image_index) for c in result.captions] == [
        (1, 1),
        (3, 2),
        (3, 3),
        (4, 4),
    ]


def test_earlier_images_are_cache_hits_in_a_later_turn(caplog):
    fake = FakeCaptioner()
    proxy = make(fake)
    turn1 = [user("What is this?", img(RED))]
    rewrite(proxy, turn1)
    turn2 = turn1 + [{"role": "assistant", "content": "Red."}, user("And this?", img(GREEN))]
    with caplog.at_level(logging.INFO, logger="tandem.vision"):
        result = rewrite(proxy, turn2)
    assert len(fake.calls) == 2, "the red image must not be captioned again"
    assert [(c.image_index, c.cached) for c in result.captions] == [(1, True), (2, False)]
    assert text_of(result.messages[0]) == "What is this?\n\nImage 1: red square"
    assert proxy.cache.hits == 1
    assert any("cache hit" in r.getMessage() for r in caplog.records)


def test_same_image_twice_in_one_request_is_captioned_once():
    fake = FakeCaptioner()
    result = rewrite(make(fake), [user("Same?", img(RED), img(RED))])
    assert len(fake.calls) == 1
    assert [c.cached for c in result.captions] == [False, True]


def test_captions_are_kept_per_scope(monkeypatch):
    """Another key (or cache_salt) sending the same picture is captioned again, in its own
    scope, and decoded again: a hit took 0.006 ms where a caption takes 29, which told the
    second key that someone had sent that image (issue 30)."""
    import app.vision.proxy as proxy_mod

    decodes = []
    real = proxy_mod.decode_image_async

    async def counting(*a, **k):
        decodes.append(1)
        return await real(*a, **k)

    monkeypatch.setattr(proxy_mod, "decode_image_async", counting)
    fake = FakeCaptioner()
    proxy = make(fake)
    asked = [user("What is this?", img(RED))]
    alice = rewrite(proxy, asked, scope="alice")
    bob = rewrite(proxy, asked, scope="bob")
    again = rewrite(proxy, asked, scope="bob")
    assert [r.captions[0].cached for r in (alice, bob, again)] == [False, False, True]
    assert fake.scopes == ["alice", "bob"] and len(decodes) == 2
    assert alice.messages == bob.messages == again.messages


def test_captions_are_keyed_by_pixels_not_bytes():
    """The same picture as PNG, as lossless WebP, or from a file: one caption; two
    different pictures at one URL (a file rewritten between turns): two captions."""
    from io import BytesIO

    from PIL import Image

    from tests.vision.sample_images import striped_bytes

    png = striped_bytes(4)
    buf = BytesIO()
    Image.open(BytesIO(png)).save(buf, format="WEBP", lossless=True)
    webp = data_url(buf.getvalue(), "image/webp")
    assert buf.getvalue() != png
    fake = FakeCaptioner()
    proxy = make(fake)
    rewrite(proxy, [user("What is this?", img(data_url(png)))])
    result = rewrite(proxy, [user("What is this?", img(webp))])
    assert len(fake.calls) == 1 and [c.cached for c in result.captions] == [True]


def test_one_url_with_new_pixels_is_captioned_again(tmp_path):
    fake = FakeCaptioner()
    proxy = make(fake, allowed_file_dir=tmp_path)
    path = tmp_path / "shot.png"
    url = path.as_uri()
    path.write_bytes(image_bytes((255, 0, 0)))
    first = rewrite(proxy, [user("What is this?", img(url))])
    path.write_bytes(image_bytes((0, 255, 0)))
    second = rewrite(proxy, [user("What is this?", img(url))])
    assert len(fake.calls) == 2
    assert text_of(first.messages[0]).endswith("red square") and text_of(second.messages[0]).endswith("green square")


def test_concurrent_requests_caption_serially_and_once_per_image():
    fake = FakeCaptioner()
    proxy = make(fake)

    async def both():
        return await asyncio.gather(
            proxy.rewrite(typed([user(img(RED), img(GREEN))])),
            proxy.rewrite(typed([user(img(RED), img(BLUE))])),
        )

    asyncio.run(both())
    assert fake.max_running == 1
    assert sorted(sha for sha, _ in fake.calls) == sorted(set(sha for sha, _ in fake.calls))
    assert len(fake.calls) == 3


def test_unavailable_vision_gives_placeholders_and_a_warning():
    messages = [user("Look", img(RED)), user(img(GREEN), img(BLUE))]
    result = rewrite(make(None), messages)
    assert text_of(result.messages[0]) == "Look\n\n[Image 1: not available, no vision model loaded]"
    assert text_of(result.messages[1]) == (
        "[Image 2: not available, no vision model loaded]\n"
        "[Image 3: not available, no vision model loaded]"
    )
    assert len(result.warnings) == 1 and "out of memory" in result.warnings[0]
    assert result.captions == []


def test_a_failing_captioner_degrades_to_a_placeholder_not_an_error():
    fake = FakeCaptioner(fail=True)
    proxy = make(fake)
    result = rewrite(proxy, [user("Hm", img(RED))])
    assert text_of(result.messages[0]) == "Hm\n\n[Image 1: could not be described]"
    assert result.warnings and result.captions == []
    rewrite(proxy, [user("Hm", img(RED))])
    assert len(fake.calls) == 2, "failures are not cached"


def test_a_bad_image_fails_before_any_captioning():
    fake = FakeCaptioner()
    messages = [
        user("ok", img(RED)),
        {"role": "assistant", "content": "x"},
        user("bad", img(BROKEN)),
    ]
    with pytest.raises(ImageError) as info:
        rewrite(make(fake), messages)
    assert info.value.param == "messages[2].content[1].image_url"
    assert "messages[2].content[1]" in info.value.message
    assert fake.calls == []


def test_too_many_images():
    with pytest.raises(ImageError) as info:
        rewrite(
            make(FakeCaptioner(), max_images_per_request=2),
            [user(img(RED), img(GREEN)), user(img(BLUE))],
        )
    assert info.value.code == "too_many_images"
    assert info.value.param == "messages[1].content[0].image_url"


def test_image_part_with_a_blank_url():
    """A URL of only spaces passes the schema (it is a non-empty string) and is refused here;
    missing, empty and non-string URLs are refused by the schema (tests/api/test_vision_e2e.py)."""
    messages = [user("x", {"type": "image_url", "image_url": {"url": "   "}})]
    with pytest.raises(ImageError) as info:
        rewrite(make(FakeCaptioner()), messages)
    assert info.value.param == "messages[0].content[1].image_url"


def test_input_image_parts_are_captioned_like_image_url_parts():
    """The Responses API's image part: it used to be dropped silently."""
    result = rewrite(make(FakeCaptioner()), [user("What is it?", {"type": "input_image", "image_url": RED})])
    assert text_of(result.messages[0]) == "What is it?\n\nImage 1: red square"


def test_repeated_image_is_not_decoded_again(monkeypatch):
    """Chat UIs resend earlier images every turn: a repeat costs a hash, not a decode."""
    import asyncio

    import app.vision.proxy as proxy_mod
    from app.vision.cache import CaptionCache
    from app.vision.images import ImagePolicy
    from app.vision.proxy import VisionProxy
    from tests.vision.sample_images import data_url, striped_bytes

    class Fixed:
        name = "fixed"

        def prompt(self, user_text):
            return "describe"

        async def describe(self, image, user_text, *, scope=""):
            return f"{image.size[0]}x{image.size[1]}"

    decodes = []
    real = proxy_mod.decode_image_async

    async def counting(*a, **k):
        decodes.append(1)
        return await real(*a, **k)

    monkeypatch.setattr(proxy_mod, "decode_image_async", counting)
    proxy = VisionProxy(Fixed(), CaptionCache(8), ImagePolicy())
    msg = typed([{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(striped_bytes(5))}}]}])
    first = asyncio.run(proxy.rewrite(msg))
    again = asyncio.run(proxy.rewrite(msg))
    assert len(decodes) == 1
    assert again.captions[0].cached and again.messages == first.messages


def test_images_wait_for_captioning_at_vlm_size():
    """Each image is shrunk to the captioner's max_pixels as soon as it is checked."""
    import asyncio

    from app.vision.cache import CaptionCache
    from app.vision.images import ImagePolicy
    from app.vision.proxy import VisionProxy
    from tests.vision.sample_images import data_url, image_bytes

    class Small:
        name = "small"
        max_pixels = 32 * 32

        def prompt(self, user_text):
            return "describe"

        async def describe(self, image, user_text, *, scope=""):
            return f"{image.image.size[0] * image.image.size[1]} pixels"

    big = data_url(image_bytes(size=(400, 300)))
    msg = typed([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": big}}]}])
    result = asyncio.run(VisionProxy(Small(), CaptionCache(4), ImagePolicy()).rewrite(msg))
    pixels = int(result.captions[0].caption.split()[0])
    assert pixels <= Small.max_pixels
