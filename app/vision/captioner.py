"""Captioners: turn one image (and what the user asked) into a text description.

``Captioner`` is the seam the proxy depends on; tests put a fake there.
``MlxVlmCaptioner`` runs a local mlx-vlm model (Qwen2-VL and friends): its own
copy, or (``MlxVlmCaptioner.from_engine``) the copy a native VLM chat model
already serves, captioning through that model's engine. The engine then
batches captions with its chat requests and counts them in its KV budget, and
no second copy of the weights is loaded. Captions never run beside the engine
on the same weights through ``stream_generate``: Qwen2-VL's language model
keeps its M-RoPE offsets in itself, and the engine's batch steps overwrite them
between a caption's tokens.

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
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from app.errors import ConfigError, EngineError, VisionUnavailableError
from app.vision.images import LoadedImage, downscale

if TYPE_CHECKING:
    from app.engine.vlm import VlmEngine

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
        hf_id: str | None = None,
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
        # A hub repo id: fetched (every name and hash checked, app.engine.hub) on the first load,
        # then model_path is its snapshot. mlx-vlm itself is only ever given a directory.
        self.hf_id = hf_id
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
        # What the loaded weights take (0 when not loaded): the registry counts it in the budget.
        self.weights_bytes = 0
        # Unload after this long unused (models.yaml idle_unload_secs); reloaded on demand.
        self.idle_unload_s = idle_unload_s
        self.unloaded = False
        self._last_used = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        # Set by from_engine: caption through a native chat model's engine, on its weights.
        self._engine: VlmEngine | None = None

    @classmethod
    def from_engine(
        cls,
        engine: VlmEngine,
        *,
        name: str | None = None,
        prompt_template: str = DEFAULT_PROMPT_TEMPLATE,
        no_text_prompt: str = DEFAULT_NO_TEXT_PROMPT,
        max_tokens: int = 256,
        max_context_chars: int = 2000,
    ) -> MlxVlmCaptioner:
        """A captioner on the VLM ``engine`` already serves (a ``vision_mode: native``
        chat model): captions are requests to that engine, batched with its chat
        requests and admitted under its KV budget. Nothing is loaded or unloaded
        here; the pixel bounds are the engine's model's."""
        loaded = engine.loaded
        captioner = cls(
            loaded.path, engine.worker, name=name or loaded.name, prompt_template=prompt_template,
            no_text_prompt=no_text_prompt, max_tokens=max_tokens, max_pixels=loaded.max_pixels,
            min_pixels=loaded.min_pixels, max_context_chars=max_context_chars,
        )
        captioner._engine = engine
        return captioner

    @property
    def loaded(self) -> bool:
        """Whether ``load()`` has succeeded (always, for a captioner on an engine)."""
        return self._model is not None or self._engine is not None

    def load(self) -> None:
        """Load model and processor on the MLX thread, blocking; ``ConfigError`` if unusable.

        Meant for start-up; from async code use ``await asyncio.to_thread(captioner.load)``.
        A captioner on an engine has nothing to load.
        """
        if self._engine is not None:
            return
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
        pixels = await asyncio.to_thread(downscale, image.image, self.max_pixels, self.min_pixels)
        if self._engine is not None:
            return await self._describe_on_engine(self._engine, pixels, self.prompt(user_text))
        self._touch()
        steps = partial(self._caption_steps, pixels, self.prompt(user_text))
        submit_steps = getattr(self._executor, "submit_steps", None)
        if submit_steps is not None:  # the engine thread: one token per turn, between batch steps
            return await asyncio.wrap_future(submit_steps(steps))
        return await asyncio.wrap_future(self._executor.submit(partial(_run_to_end, steps)))

    async def _describe_on_engine(self, engine: VlmEngine, pixels: Any, prompt: str) -> str:
        """The caption as a temperature-0 request to the native model's engine."""
        from app.engine.mlx_internals import vlm_clean_output
        from app.engine.types import GenerationRequest
        from app.engine.vlm import render_vlm_prompt

        messages = [_image_then_text(prompt)]
        prompt_text = await asyncio.to_thread(render_vlm_prompt, engine.loaded, messages)
        req = GenerationRequest(
            [], max_tokens=self.max_tokens, prompt_text=prompt_text, images=(pixels,), request_id="caption",
        )
        text = [delta.text async for delta in engine.stream(req)]
        return vlm_clean_output(engine.loaded.processor, "".join(text)).strip()

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
        self.weights_bytes = 0
        self.unloaded = True
        mx.clear_cache()
        logger.info("vision model %s unloaded after %.0f s idle", self.name, self.idle_unload_s)

    def _load_on_mlx_thread(self) -> None:
        # Imported here: mlx-vlm pulls in transformers (~1 s), needless when vision is off.
        if self.hf_id is not None:
            from app.engine.hub import local_snapshot

            self.model_path = local_snapshot(self.name, self.hf_id, "vision")
        if not self.model_path.is_dir():  # mlx-vlm would take a missing path for a hub id
            raise ConfigError(f"cannot load vision model {self.name} from {self.model_path}: not a directory")
        try:
            from mlx_vlm import load

            model, processor = load(str(self.model_path))
        except Exception as exc:
            raise ConfigError(
                f"cannot load vision model {self.name} from {self.model_path}: {exc}"
            ) from exc
        self._check_loaded(model, processor)
        self._model, self._processor = model, processor
        from mlx.utils import tree_flatten

        flat: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
        self.weights_bytes = sum(array.nbytes for _, array in flat)

    def _check_loaded(self, model: Any, processor: Any) -> None:
        """Refuse, loudly, the setups where mlx-vlm would silently ignore the image."""
        from app.engine.vlm import check_vlm

        check_vlm(self.name, model, processor)

    @staticmethod
    def _chat_prompt(model: Any, processor: Any, text: str) -> str:
        from mlx_vlm import apply_chat_template

        return str(apply_chat_template(processor, model.config, _image_then_text(text), num_images=1))

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


def _image_then_text(text: str) -> dict[str, Any]:
    # Image before text, the order Qwen2-VL's own examples use.
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}


def _run_to_end(make: Callable[[], Generator[None, None, T]]) -> T:
    """Drive a step generator to its return value (executors without submit_steps)."""
    gen = make()
    while True:
        try:
            next(gen)
        except StopIteration as done:
            return done.value
