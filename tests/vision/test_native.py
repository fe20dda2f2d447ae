"""Native vision's request side: image parts checked, images loaded (the messages' template
form is the pipeline's, tests/pipeline/test_prompting.py)."""

from __future__ import annotations

import asyncio

import pytest

from app.errors import ImageError
from app.pipeline.request import ImagePart, Message
from app.vision.images import ImagePolicy
from app.vision.native import load_native_images, native_image_parts
from tests.vision.sample_images import data_url, image_bytes


def img(n: int, param: str) -> ImagePart:
    return ImagePart(data_url(image_bytes((n * 40, 0, 0), (640, 480))), param)


def test_too_many_images_names_the_first_extra_part():
    messages = [Message("user", (img(1, "messages[0].content[0]"),)),
                Message("user", (img(2, "messages[1].content[0]"), img(3, "messages[1].content[1]")))]
    with pytest.raises(ImageError) as info:
        native_image_parts(messages, ImagePolicy(max_images_per_request=2))
    assert info.value.code == "too_many_images" and info.value.param == "messages[1].content[1]"
    assert info.value.status_code == 400 and "at most 2" in info.value.message
    assert len(native_image_parts(messages, ImagePolicy(max_images_per_request=3))) == 3


def test_images_outside_user_messages_are_refused():
    messages = [Message("tool", (img(1, "messages[0].content[0]"),), tool_call_id="c1")]
    with pytest.raises(ImageError, match="user messages only") as info:
        native_image_parts(messages, ImagePolicy())
    assert info.value.param == "messages[0].content[0]"


def test_images_load_within_max_pixels_in_order():
    parts = [img(1, "a"), ImagePart(data_url(image_bytes((0, 0, 255), (10, 10))), "b")]
    images = asyncio.run(load_native_images(parts, ImagePolicy(), max_pixels=112 * 112, min_pixels=28 * 28))
    assert images[0].width * images[0].height <= 112 * 112 and images[0].getpixel((0, 0)) == (40, 0, 0)
    assert images[1].width * images[1].height >= 28 * 28 and images[1].getpixel((0, 0)) == (0, 0, 255)
    with pytest.raises(ImageError) as info:
        asyncio.run(load_native_images([ImagePart("data:image/png;base64,AAAA", "messages[0].content[1]")],
                                       ImagePolicy(), max_pixels=112 * 112))
    assert info.value.param == "messages[0].content[1]"
