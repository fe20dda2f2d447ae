"""Native vision: a chat request's messages and images as a native VLM takes them.

For a ``vision_mode: native`` chat model (served by the chat engine with a VLM's rows: ``app.engine.batch.vision_rows``)
the pipeline sends the images themselves, not captions:

    parts  = native_image_parts(messages)          # every image part, in order (400s: no URL,
                                                   #   an image outside a user message, too many)
    images = await load_native_images(parts, policy, max_pixels=..., min_pixels=...)

(``native_images`` does both; ``app.vision.wiring.native_reader`` binds it to a
model's limits for the pipeline.) The pipeline then hands the messages and these images to the model's prompt
builder (``app.engine.models.vlm.VlmPrompts``): each image part becomes the model's
own placeholder where the client put it (``prompting.template_message``), the
processor expands it to the image's tokens, and the images follow the same
order. All images are read and decoded (the check) before any generation
starts, as in proxy mode.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from PIL import Image

from app.errors import ImageError
from app.messages import ImagePart, Message
from app.vision.images import ImagePolicy, check_image_count, decode_image_async, downscale, read_image_async
from app.vision.proxy import image_parts


def native_image_parts(messages: Sequence[Message], policy: ImagePolicy) -> list[ImagePart]:
    """The request's image parts in order, checked: a URL each, user messages only,
    at most ``policy.max_images_per_request`` (``too_many_images`` names the first extra)."""
    parts = image_parts(messages)
    for i, part in parts:
        if messages[i].role != "user":
            raise ImageError(
                f"{part.param}: this model takes images in user messages only, not in a {messages[i].role} message",
                param=part.param,
            )
    check_image_count([p.param for _, p in parts], policy.max_images_per_request)
    return [p for _, p in parts]


async def load_native_images(
    parts: Sequence[ImagePart], policy: ImagePolicy, *, max_pixels: int, min_pixels: int | None = None
) -> list[Image.Image]:
    """Read and decode every part (``ImageError`` naming the bad one), shrunk to
    ``max_pixels`` while decoding and lifted to ``min_pixels``: what the VLM sees."""
    images = []
    for part in parts:
        raw = await read_image_async(part.url, policy, param=part.param)
        loaded = await decode_image_async(raw, policy, param=part.param, max_pixels=max_pixels)
        images.append(await asyncio.to_thread(downscale, loaded.image, max_pixels, min_pixels))
    return images


async def native_images(messages: Sequence[Message], policy: ImagePolicy, *, max_pixels: int,
                        min_pixels: int | None = None) -> list[Image.Image]:
    """Every image of ``messages``, checked and decoded in order: what a native VLM's
    prompt builder takes with the rendered messages."""
    parts = native_image_parts(messages, policy)
    return await load_native_images(parts, policy, max_pixels=max_pixels, min_pixels=min_pixels)
