"""Native VLM chat models: load with mlx-vlm, profile the worst case, render prompts.

A chat entry with ``vision_mode: native`` is served by mlx-vlm itself: its
chat template places one image placeholder per image part (never a string we
guess), its processor expands each placeholder into the image's tokens, and
its vision tower turns the pixels into the features merged at those tokens.
``VlmEngine`` (``app.engine.batch.vlm_engine``, re-exported here) generates with it.

The discipline of vLLM's multimodal profiling (``get_supported_mm_limits``,
dummy inputs): ``max_images_per_request`` is the model's own (refused at load
where mlx-vlm knows the model takes fewer), and at load one worst-case input,
``max_images`` images at ``max_pixels``, goes through the processor and the
vision tower once. Its peak memory above the weights (``profile_peak_bytes``)
is logged and belongs in the model's memory budget next to ``weights_bytes``
and the KV budget: the engine encodes one request's images at a time, each
within that worst case, so images never take more than the budget says.

``load_vlm`` and ``profile_worst_case`` make MLX calls: run them on the
MLX-owner thread. ``VlmPrompts`` is the model's prompt builder
(``app.engine.prompt``): its chat template is plain CPU work, fit for a worker
thread off the event loop; its processor runs once per prompt on the MLX thread.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx.utils import tree_flatten

from app.engine.mlx_internals import (
    vlm_image_limit,
    vlm_input_embeddings,
    vlm_language_model,
    vlm_prompt_inputs,
    vlm_text_config,
    vlm_text_tokens,
)
from app.engine.models.loader import KVGeometry, activation_dtype, apply_params, kv_geometry
from app.engine.params import LoadParams
from app.engine.prompt import MultimodalPrompt, Prompt, PromptImage, TokenPrompt, pixel_digest, placeholder_runs
from app.errors import ConfigError, InvalidRequestError

if TYPE_CHECKING:
    from PIL.Image import Image

log = logging.getLogger("tandem.engine")

# The text of the worst-case prompt; its images dominate its length.
_PROFILE_TEXT = "Describe these images."


@dataclass(frozen=True)
class VlmProfile:
    """What the worst-case input cost when it went through the vision tower at load."""

    images: int
    image_size: tuple[int, int]
    # Tokens of the worst-case prompt, images expanded by the processor.
    prompt_tokens: int
    # Peak memory above what was in use before (the weights): the vision tower's working set.
    peak_bytes: int
    seconds: float


@dataclass
class LoadedVlm:
    """A VLM loaded with mlx-vlm, ready for ``VlmEngine`` (a native chat model or a vision entry)."""

    name: str
    model: Any  # mlx-vlm Model: vision_tower, language_model
    processor: Any  # mlx-vlm / transformers processor: tokenizer, image_processor, chat template
    config: dict[str, Any]  # the language model's config
    kv: KVGeometry
    max_model_len: int
    path: str
    max_pixels: int
    min_pixels: int
    max_images: int
    weights_bytes: int
    profile: VlmProfile
    load_s: float

    @property
    def tokenizer(self) -> Any:
        """The processor's text tokenizer (``encode``, ``apply_chat_template``, ``get_vocab``)."""
        return getattr(self.processor, "tokenizer", self.processor)

    @property
    def profile_peak_bytes(self) -> int:
        """Memory the worst-case images take while they are encoded, above the weights."""
        return self.profile.peak_bytes

    @property
    def image_token(self) -> str | None:
        """The placeholder the processor expands, as its chat template writes it."""
        token = getattr(self.processor, "image_token", None)
        return token if isinstance(token, str) and token else None

    @property
    def image_token_id(self) -> int | None:
        """The id the processor repeats for each of an image's tokens."""
        config = self.model.config
        for key in ("image_token_id", "image_token_index"):
            value = getattr(config, key, None)
            if isinstance(value, int):
                return value
        token = self.image_token
        return int(self.tokenizer.convert_tokens_to_ids(token)) if token is not None else None


def load_vlm(
    source: str, load: LoadParams, *, name: str, max_pixels: int, min_pixels: int, max_images: int
) -> LoadedVlm:
    """Load ``source`` (a directory or hub id) with mlx-vlm, check it, apply ``load``,
    and run the worst-case profile. ``ConfigError`` when it cannot serve images."""
    from mlx_vlm import load as mlx_vlm_load

    started = time.perf_counter()
    if load.kv_cache_bits is not None:
        raise ConfigError(f"model {name!r}: kv_cache_bits is not supported for native VLMs")
    try:
        model, processor = mlx_vlm_load(source)
    except Exception as exc:  # noqa: BLE001 - any load failure is a config problem for the user
        raise ConfigError(f"model {name!r}: cannot load {source} with mlx-vlm: {exc}") from exc
    check_vlm(name, model, processor)
    limit = vlm_image_limit(model)
    if limit is not None and max_images > limit:
        raise ConfigError(
            f"model {name!r} takes at most {limit} image(s) per prompt; set max_images_per_request: {limit}"
        )
    # dtype for every weight; load-time quantization for the language model only, as
    # mlx-vlm's own convert leaves the vision tower unquantized.
    apply_params(model, replace(load, quantization=None))
    if load.quantization is not None:
        apply_params(vlm_language_model(model), replace(load, dtype=None))
    config = vlm_text_config(model)
    try:
        kv = kv_geometry(config, activation_dtype(vlm_language_model(model)), None)
    except ConfigError as exc:
        raise ConfigError(f"model {name!r}: {exc.message}") from exc
    native_len = int(config.get("max_position_embeddings") or 4096)
    loaded = LoadedVlm(
        name=name, model=model, processor=processor, config=config, kv=kv,
        max_model_len=min(load.max_model_len or native_len, native_len), path=source,
        max_pixels=max_pixels, min_pixels=min_pixels, max_images=max_images,
        weights_bytes=_weights_bytes(model),
        profile=VlmProfile(0, (0, 0), 0, 0, 0.0), load_s=0.0,
    )
    loaded.profile = profile_worst_case(loaded)
    loaded.load_s = time.perf_counter() - started
    p = loaded.profile
    log.info(
        "vlm %s: loaded in %.2f s, weights %.1f MB; worst case %d image(s) at %dx%d = %d prompt tokens, "
        "vision tower peak %.1f MB above the weights (%.2f s)",
        name, loaded.load_s, loaded.weights_bytes / 2**20, p.images, *p.image_size, p.prompt_tokens,
        p.peak_bytes / 2**20, p.seconds,
    )
    return loaded


def prompt_inputs(prompt: Prompt) -> dict[str, Any]:
    """The vision tower's inputs for ``prompt``: its token ids and the processor's
    other inputs (none for a ``TokenPrompt``). MLX thread."""
    extras = prompt.inputs if isinstance(prompt, MultimodalPrompt) else {}
    return {"input_ids": mx.array([prompt.tokens]), **extras}


def _weights_bytes(model: Any) -> int:
    flat: list[tuple[str, Any]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    return sum(int(v.nbytes) for _, v in flat)


def profile_worst_case(loaded: LoadedVlm) -> VlmProfile:
    """``max_images`` images of ``max_pixels`` through the processor and the vision
    tower once; the peak memory above what was in use before is the images' cost."""
    from PIL import Image as PILImage

    side = math.isqrt(loaded.max_pixels)
    images = [PILImage.new("RGB", (side, side), (127, 127, 127)) for _ in range(loaded.max_images)]
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": _PROFILE_TEXT}]
    prompts = VlmPrompts(loaded)
    text = prompts.render([{"role": "user", "content": content}])
    started = time.perf_counter()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    try:
        prompt = prompts.build(text, images)
        assert isinstance(prompt, MultimodalPrompt)
        features = vlm_input_embeddings(loaded.model, prompt_inputs(prompt))
        mx.eval([v for v in features.values() if isinstance(v, mx.array)])
    except Exception as exc:  # noqa: BLE001 - a model that cannot take its own worst case is misconfigured
        raise ConfigError(
            f"model {loaded.name!r}: the worst-case input ({len(images)} image(s) at {side}x{side}) failed: {exc}"
        ) from exc
    peak = mx.get_peak_memory()
    tokens = len(prompt.tokens)
    del prompt, features
    mx.clear_cache()
    return VlmProfile(len(images), (side, side), tokens, max(0, peak - before), time.perf_counter() - started)


def check_vlm(name: str, model: Any, processor: Any) -> None:
    """Refuse, loudly, the setups where mlx-vlm would silently ignore the image."""
    tokenizer = getattr(processor, "tokenizer", processor)
    if not (getattr(processor, "chat_template", None) or getattr(tokenizer, "chat_template", None)):
        raise ConfigError(f"vision model {name} has no chat template (mlx-vlm would fall back to a bare prompt)")
    config_id = getattr(model.config, "image_token_id", None)
    image_token = getattr(processor, "image_token", None)
    if config_id is not None and isinstance(image_token, str):
        token_id = tokenizer.convert_tokens_to_ids(image_token)
        if token_id != config_id:
            raise ConfigError(
                f"vision model {name}: config image_token_id {config_id} is not "
                f"the tokenizer's id {token_id} for {image_token!r}"
            )
        try:
            probe = _apply_template(processor, model, [_user_with_image("probe")], 1, True, {})
        except Exception as exc:  # noqa: BLE001 - a template that cannot render one image is unusable
            raise ConfigError(f"vision model {name}: chat template fails: {exc}") from exc
        if image_token not in probe:
            raise ConfigError(f"vision model {name}: its chat template drops the image token")


def _user_with_image(text: str) -> dict[str, Any]:
    # Image before text, the order Qwen2-VL's own examples use.
    return {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}


def count_images(messages: list[dict[str, Any]]) -> int:
    """Image parts in user messages of the mlx-vlm message format."""
    return sum(
        1
        for m in messages
        if m.get("role") == "user" and isinstance(m.get("content"), list)
        for part in m["content"]
        if isinstance(part, dict) and part.get("type") == "image"
    )


class VlmPrompts:
    """A native VLM's prompt builder (``app.engine.prompt.PromptBuilder``): mlx-vlm's chat
    template places the image placeholders, the model's processor expands them.

    ``render`` is plain CPU work. ``build`` hashes the images where it is called, then
    runs the processor once on the MLX thread (``run``; mlx-vlm's processors make MLX
    arrays), since the real length of each image's run of tokens is the processor's to
    say. ``run`` None: the caller is on the MLX thread already (the load-time profile).
    """

    takes_images = True

    def __init__(self, loaded: LoadedVlm, run: Callable[[Callable[[], Any]], Any] | None = None) -> None:
        self.loaded = loaded
        self._run = run or (lambda fn: fn())

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               switches: Mapping[str, Any] | None = None, generation_prompt: bool = True) -> str:
        """The prompt text for ``messages``, through mlx-vlm's chat template for this model.

        ``messages`` are dicts ``{"role": "system" | "user" | "assistant" | "tool", "content": ...}``:
        ``content`` is a string, or (user messages) a list of ``{"type": "image"}`` and
        ``{"type": "text", "text": str}`` parts in the order the client sent them; each image
        part becomes the model's own placeholder at that place, and the request's images
        must follow in that order. ``tool_calls``, ``tool_call_id`` and ``name`` pass
        through to the template. Images in other roles are refused: mlx-vlm's templates drop them.

        ``InvalidRequestError`` when the template rejects the messages, or renders a
        different number of placeholders than there are images.
        """
        loaded = self.loaded
        for m in messages:
            content = m.get("content")
            if m.get("role") != "user" and isinstance(content, list) and any(
                isinstance(p, dict) and p.get("type") == "image" for p in content
            ):
                raise InvalidRequestError(
                    f"this model takes images in user messages only, not in a {m.get('role')} message",
                    param="messages",
                )
        n = count_images(messages)
        kwargs: dict[str, Any] = {**(switches or {}), **({"tools": tools} if tools is not None else {})}
        try:
            text = _apply_template(loaded.processor, loaded.model, messages, n, generation_prompt, kwargs)
        except Exception as exc:  # noqa: BLE001 - jinja and mlx-vlm errors are the request's shape
            raise InvalidRequestError(
                f"the model's chat template rejected these messages: {exc}", param="messages"
            ) from exc
        token = loaded.image_token
        if token is not None and text.count(token) != n:
            raise InvalidRequestError(
                f"the chat template of {loaded.name} wrote {text.count(token)} image placeholder(s) for {n} image(s)",
                param="messages",
            )
        return text

    def build(self, text: str, images: Sequence[Image] = ()) -> Prompt:
        """``text`` (rendered by ``render``) and its images as exact tokens: a ``TokenPrompt``
        without images, else a ``MultimodalPrompt`` with each image's run, hash and inputs."""
        loaded = self.loaded
        token = loaded.image_token
        if token is not None and text.count(token) != len(images):
            # mlx-vlm's processors drop surplus placeholders, or images, in silence.
            raise InvalidRequestError(
                f"the prompt has {text.count(token)} image placeholder(s) for {len(images)} image(s)",
                param="messages",
            )
        if not images:
            return TokenPrompt(vlm_text_tokens(loaded.model, loaded.processor, text))
        fitted = [fit_image(img, loaded.max_pixels) for img in images]
        digests = [pixel_digest(img) for img in fitted]

        def process() -> tuple[list[int], dict[str, Any]]:
            try:
                inputs = vlm_prompt_inputs(loaded.model, loaded.processor, text, fitted)
            except Exception as exc:  # noqa: BLE001 - the processor refusing this prompt is the request's fault
                raise InvalidRequestError(f"the model's processor cannot take this prompt: {exc}",
                                          param="messages") from exc
            tokens = inputs.pop("input_ids")[0].tolist()
            return tokens, inputs

        tokens, inputs = self._run(process)
        runs = placeholder_runs(tokens, loaded.image_token_id) if loaded.image_token_id is not None else []
        if len(runs) != len(fitted):
            raise InvalidRequestError(
                f"the processor of {loaded.name} made {len(runs)} image token run(s) for {len(fitted)} image(s)",
                param="messages",
            )
        spans = tuple(PromptImage(start, length, digest, img)
                      for (start, length), digest, img in zip(runs, digests, fitted, strict=True))
        return MultimodalPrompt(tokens, spans, inputs)


def fit_image(image: Any, max_pixels: int) -> Any:
    """``image`` shrunk, keeping its aspect ratio, to at most ``max_pixels`` (the
    worst case the load-time profile measured). Usually a no-op: the pipeline
    decodes images to that size already."""
    w, h = image.size
    if w * h <= max_pixels:
        return image
    scale = math.sqrt(max_pixels / (w * h))
    return image.resize((max(1, math.floor(w * scale)), max(1, math.floor(h * scale))))


def _apply_template(
    processor: Any, model: Any, messages: list[dict[str, Any]], num_images: int, add_generation_prompt: bool,
    template_kwargs: dict[str, Any],
) -> str:
    from mlx_vlm import apply_chat_template

    return str(
        apply_chat_template(
            processor, model.config, messages, add_generation_prompt=add_generation_prompt, num_images=num_images,
            **template_kwargs,
        )
    )


from app.engine.batch.vlm_engine import VlmEngine  # noqa: E402 - re-exported: the engine half of this module

__all__ = ["LoadedVlm", "VlmEngine", "VlmProfile", "VlmPrompts", "check_vlm", "count_images", "fit_image", "load_vlm",
           "profile_worst_case", "prompt_inputs"]
