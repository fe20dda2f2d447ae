"""Native vision: a chat request's messages and images as a native VLM takes them.

For a ``vision_mode: native`` chat model (served by ``app.engine.vlm.VlmEngine``)
the pipeline sends the images themselves, not captions:

    parts  = native_image_parts(messages)          # every image part, in order (400s: no URL,
                                                   #   an image outside a user message, too many)
    images = await load_native_images(parts, policy, max_pixels=..., min_pixels=...)
    dicts  = vlm_messages(messages)                # mlx-vlm's message format, images in place
    text   = render_vlm_prompt(loaded, dicts)      # app.engine.vlm: the model's own placeholders
    GenerationRequest([], max_tokens, ..., prompt_text=text, images=tuple(images))

``vlm_messages`` writes an image part as ``{"type": "image"}`` where the client
put it, so the chat template places the model's placeholder there and the
processor expands it; the images list follows the same order. All images are
read and decoded (the check) before any generation starts, as in proxy mode.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from PIL import Image

from app.errors import ImageError
from app.pipeline.request import ImagePart, Message, TextPart
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


def vlm_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """The messages in mlx-vlm's format, for ``render_vlm_prompt``.

    A message with images: ``{"role": "user", "content": [...]}`` with
    ``{"type": "image"}`` and ``{"type": "text", "text": ...}`` parts in the client's
    order (text parts next to each other joined by a newline, ``Message.text``'s
    rule). Any other message: ``{"role", "content": text}`` with ``name``,
    ``tool_calls`` and ``tool_call_id`` as the chat template takes them.
    """
    out = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role}
        d["content"] = _parts(m.content) if m.images() else m.text()
        if m.name:
            d["name"] = m.name
        if m.tool_calls:
            d["tool_calls"] = [tc.as_dict(arguments_as_object=True) for tc in m.tool_calls]
        if m.tool_call_id:
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def _parts(content: Sequence[TextPart | ImagePart]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = []
    for p in content:
        if isinstance(p, ImagePart):
            parts.append({"type": "image"})
        elif parts and parts[-1]["type"] == "text":
            parts[-1] = {"type": "text", "text": f"{parts[-1]['text']}\n{p.text}"}
        else:
            parts.append({"type": "text", "text": p.text})
    return parts
