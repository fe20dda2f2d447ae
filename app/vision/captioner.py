"""Captioners: turn one image (and what the user asked) into a text description.

``Captioner`` is the seam the proxy depends on; tests put a fake there.
``MlxVlmCaptioner`` runs a local mlx-vlm model (Qwen2-VL and friends).

MLX is not thread-safe, so every MLX call (load and generate) runs on the
server's one MLX-owner thread, reached through an ``MlxExecutor``: anything
with ``submit(fn) -> concurrent.futures.Future`` (the engine thread, or a
``ThreadPoolExecutor(max_workers=1)`` in tests). Pillow work stays off that
thread and off the event loop (``asyncio.to_thread``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Generator
from concurrent.futures import Future
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

from app.errors import ConfigError, EngineError, VisionUnavailableError
from app.vision.images import LoadedImage, downscale

T = TypeVar("T")

logger = logging.getLogger("tandem.vision")

DEFAULT_PROMPT_TEMPLATE = (
    "Describe this image in detail for someone who cannot see it. The user asked: {user_text}"
)
# Used when the image's message has no text: "The user asked: " would dangle.
DEFAULT_NO_TEXT_PROMPT = "Describe this image in detail for someone who cannot see it."


class MlxExecutor(Protocol):
    """Runs a callable on the MLX-owner thread."""

    def submit(self, fn: Callable[[], T], /) -> Future[T]: ...


@runtime_checkable
class Captioner(Protocol):
    """Describes images. ``name`` identifies the model (it is part of the cache key)."""

    name: str

    def prompt(self, user_text: str | None) -> str:
        """The exact text the model is asked with (part of the cache key)."""
        ...

    async def describe(self, image: LoadedImage, user_text: str | None) -> str:
        """A text description of ``image``, with ``user_text`` (the user's words) as context."""
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


class MlxVlmCaptioner:
    """Captions with an mlx-vlm model loaded from a local directory; temperature 0."""

    def __init__(
        self,
        model_path: str | Path,
        executor: MlxExecutor,
        *,
        name: str | None = None,
        prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
        no_text_prompt: str = DEFAULT_NO_TEXT_PROMPT,
        max_tokens: int = 256,
        max_pixels: int | None = None,
        min_pixels: int | None = None,
        max_context_chars: int = 2000,
        idle_unload_s: float | None = None,
    ) -> None:
        try:
            template_probe = prompt_template.format(user_text="x")
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(
                f"vision prompt_template may only use the {{user_text}} field: {exc}"
            ) from exc
        if template_probe == prompt_template:
            logger.warning("vision prompt_template has no {user_text}; the user's text is ignored")
        self.model_path = Path(model_path)
        self.name = name or self.model_path.name
        self.prompt_template = prompt_template
        self.no_text_prompt = no_text_prompt
        self.max_tokens = max_tokens
        self.max_pixels = max_pixels
        self.min_pixels = min_pixels
        self.max_context_chars = max_context_chars
        self._executor = executor
        self._model: Any = None
        self._processor: Any = None
        # Unload after this long unused (models.yaml idle_unload_secs); reloaded on demand.
        self.idle_unload_s = idle_unload_s
        self.unloaded = False
        self._last_used = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None

    @property
    def loaded(self) -> bool:
        """Whether ``load()`` has succeeded."""
        return self._model is not None

    def load(self) -> None:
        """Load model and processor on the MLX thread, blocking; ``ConfigError`` if unusable.

        Meant for start-up; from async code use ``await asyncio.to_thread(captioner.load)``.
        """
        started = time.perf_counter()
        self._executor.submit(self._load_on_mlx_thread).result()
        logger.info(
            "vision model %s loaded from %s in %.1f s",
            self.name,
            self.model_path,
            time.perf_counter() - started,
        )

    def prompt(self, user_text: str | None) -> str:
        """The text the VLM is asked for an image in a message with ``user_text``."""
        return render_prompt(
            self.prompt_template, self.no_text_prompt, user_text, self.max_context_chars
        )

    async def describe(self, image: LoadedImage, user_text: str | None) -> str:
        """Caption ``image``; ``EngineError`` if the model fails on it."""
        if not self.loaded and not self.unloaded:
            raise VisionUnavailableError(f"vision model {self.name} is not loaded")
        self._touch()
        pixels = await asyncio.to_thread(downscale, image.image, self.max_pixels, self.min_pixels)
        steps = partial(self._caption_steps, pixels, self.prompt(user_text))
        submit_steps = getattr(self._executor, "submit_steps", None)
        if submit_steps is not None:  # the engine thread: one token per turn, between batch steps
            return await asyncio.wrap_future(submit_steps(steps))
        return await asyncio.wrap_future(self._executor.submit(partial(_run_to_end, steps)))

    def _touch(self) -> None:
        self._last_used = time.monotonic()
        if self.idle_unload_s and self._idle_timer is None:
            self._idle_timer = asyncio.get_running_loop().call_later(self.idle_unload_s, self._idle_check)

    def _idle_check(self) -> None:
        self._idle_timer = None
        limit = self.idle_unload_s or 0.0
        idle = time.monotonic() - self._last_used
        if idle < limit:
            loop = asyncio.get_running_loop()
            self._idle_timer = loop.call_later(limit - idle, self._idle_check)
        elif self.loaded:
            self._executor.submit(self._unload_on_mlx_thread)

    def _unload_on_mlx_thread(self) -> None:
        if time.monotonic() - self._last_used < (self.idle_unload_s or 0):
            return  # used again while this job waited
        import mlx.core as mx

        self._model = self._processor = None
        self.unloaded = True
        mx.clear_cache()
        logger.info("vision model %s unloaded after %.0f s idle", self.name, self.idle_unload_s)

    def _load_on_mlx_thread(self) -> None:
        # Imported here: mlx-vlm pulls in transformers (~1 s), needless when vision is off.
        try:
            from mlx_vlm import load

            model, processor = load(str(self.model_path))
        except Exception as exc:
            raise ConfigError(
                f"cannot load vision model {self.name} from {self.model_path}: {exc}"
            ) from exc
        self._check_loaded(model, processor)
        self._model, self._processor = model, processor

    def _check_loaded(self, model: Any, processor: Any) -> None:
        """Refuse, loudly, the setups where mlx-vlm would silently ignore the image."""
        tokenizer = getattr(processor, "tokenizer", processor)
        if not (
            getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None)
        ):
            raise ConfigError(
                f"vision model {self.name} has no chat template "
                "(mlx-vlm would fall back to a bare prompt)"
            )
        config_id = getattr(model.config, "image_token_id", None)
        image_token = getattr(processor, "image_token", None)
        if config_id is not None and isinstance(image_token, str):
            token_id = tokenizer.convert_tokens_to_ids(image_token)
            if token_id != config_id:
                raise ConfigError(
                    f"vision model {self.name}: config image_token_id {config_id} is not "
                    f"the tokenizer's id {token_id} for {image_token!r}"
                )
            try:
                probe = self._chat_prompt(model, processor, "probe")
            except Exception as exc:
                raise ConfigError(f"vision model {self.name}: chat template fails: {exc}") from exc
            if image_token not in probe:
                raise ConfigError(
                    f"vision model {self.name}: its chat template drops the image token"
                )

    @staticmethod
    def _chat_prompt(model: Any, processor: Any, text: str) -> str:
        from mlx_vlm import apply_chat_template

        # Image before text, the order Qwen2-VL's own examples use.
        message = {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": text}],
        }
        return str(apply_chat_template(processor, model.config, message, num_images=1))

    def _caption_steps(self, pixels: Any, prompt: str) -> Generator[None, None, str]:
        """mlx-vlm's ``generate``, one token per step, so the MLX thread can
        interleave text decoding while a caption is being written."""
        from mlx_vlm import stream_generate

        from app.engine.mlx_internals import is_draft, reset_vlm_stopping, vlm_clean_output

        if self._model is None:  # unloaded while idle: load again, here on the MLX thread
            self._load_on_mlx_thread()
            self.unloaded = False
            logger.info("vision model %s reloaded", self.name)
        try:
            chat_prompt = self._chat_prompt(self._model, self._processor, prompt)
            reset_vlm_stopping(self._processor, self._model)
            text = []
            for response in stream_generate(
                self._model, self._processor, chat_prompt, image=[pixels],
                max_tokens=self.max_tokens, temperature=0.0, skip_special_tokens=True,
            ):
                if not is_draft(response):
                    text.append(response.text)
                yield
            caption = vlm_clean_output(self._processor, "".join(text))
        except Exception as exc:
            raise EngineError(f"vision model {self.name} failed: {exc}") from exc
        return caption.strip()


def _run_to_end(make: Callable[[], Generator[None, None, T]]) -> T:
    """Drive a step generator to its return value (executors without submit_steps)."""
    gen = make()
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value
