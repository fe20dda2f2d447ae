"""Captioners: turn one image (and what the user asked) into a text description.

``Captioner`` is the seam the proxy depends on; tests put a fake there.
``VlmCaptioner`` captions with a VLM the registry serves: a ``role: vision``
entry, or a native VLM chat model (``vision_mode: native``), whose one loaded
copy then serves both. Either is an ordinary registry slot run by a
the chat engine serving a VLM: it loads on demand, unloads when idle (its ``idle_unload_secs``)
or to make room, counts in the memory budget, and is never unloaded
mid-caption, since the captioner holds a lease while it captions.

A caption is a generation like any other: the VLM's own prompt builder
(``VlmPrompts``) renders the caption prompt with the image and builds its
``MultimodalPrompt`` (exact tokens, the image's span and hash), and the engine
runs it at temperature 0 in its batch, beside its chat requests and under its
KV budget. Every MLX call stays on the MLX-owner thread; Pillow work and the
template run off it and off the event loop (``asyncio.to_thread``).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from app.engine import GenerationRequest, completion_room
from app.errors import ConfigError, EngineError, InvalidRequestError
from app.vision.images import LoadedImage, downscale

if TYPE_CHECKING:
    from app.engine import Registry

logger = logging.getLogger("tandem.vision")

DEFAULT_PROMPT_TEMPLATE = (
    "Describe this image in detail for someone who cannot see it. The user asked: {user_text}"
)
# Used when the image's message has no text: "The user asked: " would dangle.
DEFAULT_NO_TEXT_PROMPT = "Describe this image in detail for someone who cannot see it."
# The user's words in a caption prompt are cut at this many characters.
MAX_CONTEXT_CHARS = 2000
# A caption's generations are tagged so in logs and listeners.
CAPTION_REQUEST_ID = "caption"


@runtime_checkable
class Captioner(Protocol):
    """Describes images. ``name`` identifies the model (it is part of the cache key)."""

    name: str

    def prompt(self, user_text: str | None) -> str:
        """The exact text the model is asked with (part of the cache key)."""
        ...

    async def describe(self, image: LoadedImage, user_text: str | None, *, scope: str = "") -> str:
        """A text description of ``image``, with ``user_text`` (the user's words) as context;
        ``scope`` is the request's cache namespace, which the model's own caches keep apart."""
        ...


def render_prompt(template: str, no_text_prompt: str, user_text: str | None, max_chars: int) -> str:
    """The caption prompt: ``template`` with ``{user_text}``, or ``no_text_prompt``."""
    text = (user_text or "").strip()
    if not text:
        return no_text_prompt
    if len(text) > max_chars:
        # A pasted document would swamp a small VLM; the question is usually first.
        text = text[:max_chars] + "..."
    return template.format(user_text=text)


def check_prompt_template(template: str) -> None:
    """``ConfigError`` unless ``template`` uses no field but ``{user_text}``."""
    try:
        probe = template.format(user_text="x")
    except (KeyError, IndexError, ValueError) as exc:
        raise ConfigError(f"vision prompt_template may only use the {{user_text}} field: {exc}") from exc
    if probe == template:
        logger.warning("vision prompt_template has no {user_text}; the user's text is ignored")


def image_then_text(text: str) -> dict[str, Any]:
    """A user message of one image and ``text``, in mlx-vlm's message format."""
    # Image before text, the order Qwen2-VL's own examples use.
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}


class VlmCaptioner:
    """Captions with the VLM the registry serves as ``name`` (a vision entry or a native
    chat model), at temperature 0, through its engine's batch."""

    def __init__(
        self,
        registry: Registry,
        name: str,
        *,
        prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
        no_text_prompt: str = DEFAULT_NO_TEXT_PROMPT,
        max_tokens: int = 256,
        max_pixels: int | None = None,
        min_pixels: int | None = None,
        max_context_chars: int = MAX_CONTEXT_CHARS,
    ) -> None:
        check_prompt_template(prompt_template)
        self._registry = registry
        self.name = name
        self.prompt_template = prompt_template
        self.no_text_prompt = no_text_prompt
        self.max_tokens = max_tokens
        self.max_pixels = max_pixels
        self.min_pixels = min_pixels
        self.max_context_chars = max_context_chars

    def prompt(self, user_text: str | None) -> str:
        """The text the VLM is asked for an image in a message with ``user_text``."""
        return render_prompt(self.prompt_template, self.no_text_prompt, user_text, self.max_context_chars)

    async def describe(self, image: LoadedImage, user_text: str | None, *, scope: str = "") -> str:
        """Caption ``image``; an ``AppError`` when the model cannot load or fails on it. The
        generation runs in ``scope``'s partition of the VLM's prefix and vision-feature caches,
        so a caption never reads what another key's caption of that image left there."""
        from app.engine import vlm_clean_output

        pixels = await asyncio.to_thread(downscale, image.image, self.max_pixels, self.min_pixels)
        lease = await self._registry.acquire_captioner(self.name)
        try:
            engine = lease.handle
            prompts = engine.prompts
            text = self.prompt(user_text)
            prompt = await asyncio.to_thread(lambda: prompts.build(prompts.render([image_then_text(text)]), [pixels]))
            room = completion_room(len(prompt.tokens), engine.max_model_len, engine.stats().kv_max_sequence_tokens)
            req = GenerationRequest(prompt, max_tokens=min(self.max_tokens, room), request_id=CAPTION_REQUEST_ID,
                                    cache_namespace=scope)
            out = [delta.text async for delta in engine.stream(req)]
            assert engine.vision is not None  # acquire_captioner leases VLMs only
            return str(vlm_clean_output(engine.vision.loaded.processor, "".join(out))).strip()
        except InvalidRequestError as exc:  # the caption's own prompt, never the client's request
            raise EngineError(f"vision model {self.name} failed: {exc.message}") from exc
        finally:
            lease.release()
