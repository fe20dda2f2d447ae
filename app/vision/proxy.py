"""Proxy vision: replace image parts with captions so a text-only model can answer.

Works on the pipeline's typed messages (``app.pipeline.request``) and returns
the same type. A message with images, e.g.

    Message("user", (TextPart("What breed is this?"), ImagePart("data:image/png;base64,...")))

becomes a text-only message:

    Message("user", (TextPart("What breed is this?\n\nImage 1: A brown dog ..."),))

Combining rules (from the design): no text -> the caption lines alone; no
captions -> the text; else ``f"{text}\n\n" + "\n".join(lines)``. The text is
``Message.text()``, the text parts joined by newlines: the same message reads
the same with or without an image.

Numbering: N counts images across the whole request, in order. Chat UIs resend
the history on every turn and append new images at the end, so "Image 3" names
the same picture on every turn, and the model never sees two "Image 1"s from
different turns (which per-message numbering would give it).

Roles: an image in any role is captioned (a tool result can carry a
screenshot); the primary model cannot read image parts from any role.

Partitions: ``rewrite`` takes the request's cache namespace (``scope``: its API key
and ``cache_salt``, as the prefix cache is partitioned). The caption cache, the
record of images already decoded and the VLM's own caches are all kept per scope,
so how fast an image is described never tells one key what another sent.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from app.engine import pixel_digest
from app.errors import AppError, ImageError, InvalidRequestError
from app.messages import ImagePart, Message
from app.vision.cache import CaptionCache, CaptionKey
from app.vision.captioner import Captioner
from app.vision.images import (
    THUMBNAIL_PIXELS,
    ImagePolicy,
    LoadedImage,
    check_image_count,
    decode_image_async,
    read_image_async,
)

logger = logging.getLogger("tandem.vision")

UNAVAILABLE = "[Image {n}: not available, no vision model loaded]"
FAILED = "[Image {n}: could not be described]"


@dataclass
class _Image:
    """An image's bytes, their hash and its pixels' hash; decoded only when it must be
    checked or captioned (a repeat's pixel hash is remembered from its first decode)."""

    sha256: str
    raw: bytes
    param: str
    pixels: str
    loaded: LoadedImage | None = None


@dataclass(frozen=True)
class CaptionInfo:
    """One image's caption, for logs and for the response's debugging extras."""

    message_index: int
    image_index: int  # N in "Image N", 1-based across the request
    caption: str
    cached: bool
    latency_ms: float

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready fields, for the response's extras."""
        return asdict(self)


@dataclass
class ProxyResult:
    """The rewritten messages and what happened to each image."""

    messages: list[Message]
    captions: list[CaptionInfo] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def image_parts(messages: Sequence[Message]) -> list[tuple[int, ImagePart]]:
    """Every image part in order, with its message's index; ``ImageError`` for one without a URL."""
    parts = []
    for i, message in enumerate(messages):
        for part in message.images():
            if not part.url.strip():
                raise ImageError(f"{part.param}: image part has no URL", param=part.param)
            parts.append((i, part))
    return parts


def combine(text: str, lines: list[str]) -> str:
    """The design's rule for a message's text and its image lines."""
    if not text.strip():
        return "\n".join(lines)
    if not lines:
        return text
    return f"{text}\n\n" + "\n".join(lines)


class VisionProxy:
    """Rewrites image-bearing messages into text with captions from a ``Captioner``.

    ``captioner`` None means vision is unavailable (``unavailable_reason`` says
    why, for the warning): images become placeholders, the request goes on.
    """

    def __init__(
        self,
        captioner: Captioner | None,
        cache: CaptionCache,
        policy: ImagePolicy,
        *,
        unavailable_reason: str | None = None,
    ) -> None:
        self.captioner = captioner
        self.cache = cache
        self.policy = policy
        self.unavailable_reason = unavailable_reason
        # One image at a time: VLM work never runs concurrently with itself, and
        # a request waiting here finds a caption another request just made.
        self._lock = asyncio.Lock()
        # Images that decoded cleanly under this policy, by scope, bytes hash and decode size,
        # with their pixel hash: chat UIs resend every earlier image on every turn, and a repeat
        # should cost a hash, not a decode (within one scope: a skipped decode is faster too).
        self._known: OrderedDict[tuple[str, str, int | None], str] = OrderedDict()
        self._known_max = max(64, cache.max_entries)

    async def rewrite(self, messages: Sequence[Message], *, scope: str = "") -> ProxyResult:
        """Messages with every image replaced by text. ``messages`` is not modified.
        ``scope``: the request's cache namespace; nothing cached under another is used.

        All images are checked (count, URL, decode) before any is captioned, so
        a bad image fails the request with a 400 before any VLM time is spent.
        """
        parts = image_parts(messages)
        if not parts:
            return ProxyResult(messages=list(messages))
        self._check_count(parts)
        # A broken image is the client's mistake whether or not vision is loaded.
        images = [await self._check(p, scope) for _, p in parts]
        if self.captioner is None:
            return self._placeholders(messages, parts)
        result = ProxyResult(messages=list(messages))
        failed = 0
        for i, numbered in _by_message(parts, images):
            text = messages[i].text()
            lines = []
            for n, image in numbered:
                info = await self._caption(i, n, image, text.strip() or None, scope)
                if info is None:
                    failed += 1
                    lines.append(FAILED.format(n=n))
                else:
                    result.captions.append(info)
                    lines.append(f"Image {n}: {info.caption}")
            result.messages[i] = messages[i].with_text(combine(text, lines))
        if failed:
            result.warnings.append(f"{failed} image(s) could not be described by the vision model")
        return result

    async def _check(self, part: ImagePart, scope: str) -> _Image:
        """Read the bytes; decode them (the check) unless this exact image decoded before in ``scope``."""
        raw = await read_image_async(part.url, self.policy, param=part.param)
        sha = hashlib.sha256(raw).hexdigest()
        known = (scope, sha, self._decode_pixels())
        pixels = self._known.get(known)
        if pixels is not None:
            self._known.move_to_end(known)
            return _Image(sha, raw, part.param, pixels)
        loaded = await self._decode_small(raw, part.param)
        pixels = await asyncio.to_thread(pixel_digest, loaded.image)
        self._known[known] = pixels
        if len(self._known) > self._known_max:
            self._known.popitem(last=False)
        return _Image(sha, raw, part.param, pixels, loaded)

    async def _decoded(self, image: _Image) -> LoadedImage:
        if image.loaded is None:
            image.loaded = await self._decode_small(image.raw, image.param)
        return image.loaded

    async def _decode_small(self, raw: bytes, param: str) -> LoadedImage:
        """Decode straight to what the VLM will see (a thumbnail with no VLM: the
        decode is the check), so a request's images wait small, not at up to
        max_image_pixels each."""
        return await decode_image_async(raw, self.policy, param=param, max_pixels=self._decode_pixels())

    def _decode_pixels(self) -> int | None:
        if self.captioner is None:
            return THUMBNAIL_PIXELS
        max_pixels: int | None = getattr(self.captioner, "max_pixels", None)
        return max_pixels

    def _check_count(self, parts: list[tuple[int, ImagePart]]) -> None:
        check_image_count([p.param for _, p in parts], self.policy.max_images_per_request)

    def _placeholders(self, messages: Sequence[Message], parts: list[tuple[int, ImagePart]]) -> ProxyResult:
        result = ProxyResult(messages=list(messages))
        for i, numbered in _by_message(parts, [None] * len(parts)):
            lines = [UNAVAILABLE.format(n=n) for n, _ in numbered]
            result.messages[i] = messages[i].with_text(combine(messages[i].text(), lines))
        reason = f" ({self.unavailable_reason})" if self.unavailable_reason else ""
        result.warnings.append(
            f"{len(parts)} image(s) were not described: no vision model is loaded{reason}"
        )
        logger.warning(
            "vision unavailable%s: %d image(s) replaced by placeholders", reason, len(parts)
        )
        return result

    async def _caption(
        self, message_index: int, n: int, image: _Image, user_text: str | None, scope: str
    ) -> CaptionInfo | None:
        """Caption one image through ``scope``'s part of the cache; None if the VLM failed on it."""
        captioner = self.captioner
        assert captioner is not None
        key = CaptionKey(image.pixels, captioner.prompt(user_text), captioner.name, scope)
        started = time.perf_counter()
        caption = self.cache.get(key)
        cached = caption is not None
        if not cached:
            async with self._lock:
                if key in self.cache:  # captioned by another request while we waited
                    caption, cached = self.cache.get(key), True
                else:
                    caption = await _describe(captioner, await self._decoded(image), user_text, n, scope)
                    if caption is None:
                        return None
                    self.cache.put(key, caption)
        assert caption is not None
        return self._info(message_index, n, image, caption, cached, started)

    def _info(
        self, i: int, n: int, image: _Image, caption: str, cached: bool, started: float
    ) -> CaptionInfo:
        latency_ms = (time.perf_counter() - started) * 1000
        logger.info(
            "image %d (message %d, pixels %s): %s in %.0f ms; cache %s",
            n,
            i,
            image.pixels[:12],
            "cache hit" if cached else "captioned",
            latency_ms,
            self.cache.stats(),
        )
        return CaptionInfo(i, n, caption, cached, latency_ms)


async def _describe(
    captioner: Captioner, image: LoadedImage, user_text: str | None, n: int, scope: str
) -> str | None:
    try:
        caption = await captioner.describe(image, user_text, scope=scope)
    except InvalidRequestError:
        raise
    except AppError:
        # The primary model can still answer the text; the warning says what was lost.
        logger.exception("vision model failed on image %d (sha256 %s)", n, image.sha256[:12])
        return None
    return caption.strip() or "(the vision model gave no description)"


def _by_message(
    parts: list[tuple[int, ImagePart]], images: list[Any]
) -> Iterator[tuple[int, list[tuple[int, Any]]]]:
    """Group (N, image) by message index, N counting from 1 across the request."""
    grouped: dict[int, list[tuple[int, Any]]] = {}
    for n, ((i, _), image) in enumerate(zip(parts, images, strict=True), start=1):
        grouped.setdefault(i, []).append((n, image))
    yield from grouped.items()
