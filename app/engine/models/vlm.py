"""Native VLM chat models: load with mlx-vlm and profile the worst case.

A chat entry with ``vision_mode: native`` is served by mlx-vlm itself: its
chat template places one image placeholder per image part (never a string we
guess), its processor expands each placeholder into the image's tokens, and
its vision tower turns the pixels into the features merged at those tokens.
The chat engine (``app.engine.batch.engine``, with ``vision_rows``) generates with it.

The discipline of vLLM's multimodal profiling (``get_supported_mm_limits``,
dummy inputs): ``max_images_per_request`` is the model's own (refused at load
where mlx-vlm knows the model takes fewer), and at load one worst-case input,
``max_images`` images at ``max_pixels``, goes through the processor and the
vision tower once. Its peak memory above the weights (``profile_peak_bytes``)
is logged and belongs in the model's memory budget next to ``weights_bytes``
and the KV budget: the engine encodes one request's images at a time, each
within that worst case, so images never take more than the budget says.

``load_vlm`` and ``profile_worst_case`` make MLX calls: run them on the
MLX-owner thread. ``VlmPrompts`` (``app.engine.models.vlm_prompts``, re-exported here)
is the model's prompt builder; ``app.engine.models.vlm_forward`` runs its rows in
Tandem's decode step.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from app.engine.kv.geometry import KVGeometry, probe_geometry
from app.engine.kv.kv_quant import quantize_caches, quantized_attention
from app.engine.kv.layers import batched
from app.engine.mlx_internals import (
    vlm_embedding_features,
    vlm_image_limit,
    vlm_language_model,
    vlm_make_cache,
    vlm_text_config,
)
from app.engine.models.loader import KV_GROUP_SIZE, apply_params
from app.engine.models.vlm_forward import check_features
from app.engine.models.vlm_prompts import (
    VlmPrompts,
    count_images,
    fit_image,
    image_marker,
    image_spans,
)
from app.engine.params import LoadParams
from app.engine.prompt import MultimodalPrompt, Prompt
from app.errors import ConfigError

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
    """A VLM loaded with mlx-vlm, ready for the chat engine (a native chat model or a vision entry)."""

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
    # What the chat template writes for one image (``image_marker``), which the processor
    # expands to the image's placeholder tokens.
    marker: str = ""
    # The KV cache's bits per element when its plain KV layers are quantized (kv_cache_bits),
    # handed back dequantized where the attention reads plain K/V only (``quantized_attention``).
    kv_cache_bits: int | None = None
    kv_plain_attention: bool = False

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
    try:
        model, processor = mlx_vlm_load(source)
    except Exception as exc:  # noqa: BLE001 - any load failure is a config problem for the user
        raise ConfigError(f"model {name!r}: cannot load {source} with mlx-vlm: {exc}") from exc
    marker = check_vlm(name, model, processor)
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
        language_model = vlm_language_model(model)
        # The caches the decode step gives its rows (mlx-lm's classes: vlm_make_cache), whose
        # kinds the geometry reads; the language model's own make_cache() is mlx-vlm's copies.
        make = lambda: vlm_make_cache(model)  # noqa: E731
        bits, plain = load.kv_cache_bits, False
        if bits is not None:  # its plain KV layers quantized, as the engine keeps them
            plain = quantized_attention(lambda cache: language_model(mx.array([[0]]), cache=cache),
                                        lambda p: quantize_caches(vlm_make_cache(model), bits, KV_GROUP_SIZE, plain=p),
                                        bits, KV_GROUP_SIZE)
            make = lambda: quantize_caches(vlm_make_cache(model), bits, KV_GROUP_SIZE, plain=plain)  # noqa: E731
        kv = probe_geometry(lambda: batched(make()), lambda tokens, cache: language_model(tokens, cache=cache))
    except ConfigError as exc:
        raise ConfigError(f"model {name!r}: {exc.message}") from exc
    native_len = int(config.get("max_position_embeddings") or 4096)
    loaded = LoadedVlm(
        name=name, model=model, processor=processor, config=config, kv=kv,
        max_model_len=min(load.max_model_len or native_len, native_len), path=source,
        max_pixels=max_pixels, min_pixels=min_pixels, max_images=max_images,
        weights_bytes=_weights_bytes(model),
        profile=VlmProfile(0, (0, 0), 0, 0, 0.0), load_s=0.0, marker=marker, kv_cache_bits=load.kv_cache_bits,
        kv_plain_attention=plain,
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
        features = vlm_embedding_features(loaded.model, prompt_inputs(prompt))
        mx.eval([v for v in features.values() if isinstance(v, mx.array)])
    except Exception as exc:  # noqa: BLE001 - a model that cannot take its own worst case is misconfigured
        raise ConfigError(
            f"model {loaded.name!r}: the worst-case input ({len(images)} image(s) at {side}x{side}) failed: {exc}"
        ) from exc
    peak = mx.get_peak_memory()
    check_features(loaded.name, features)
    tokens = len(prompt.tokens)
    del prompt, features
    mx.clear_cache()
    return VlmProfile(len(images), (side, side), tokens, max(0, peak - before), time.perf_counter() - started)


def check_vlm(name: str, model: Any, processor: Any) -> str:
    """Refuse, loudly, the setups where mlx-vlm would silently ignore the image; the
    marker its chat template writes for one image (``image_marker``)."""
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
        marker = image_marker(processor, model)
    except Exception as exc:  # noqa: BLE001 - a template that cannot render one image is unusable
        raise ConfigError(f"vision model {name}: chat template fails: {exc}") from exc
    if not marker:
        raise ConfigError(f"vision model {name}: its chat template drops the image token "
                          "(it writes nothing for an image)")
    return marker


__all__ = ["LoadedVlm", "VlmProfile", "VlmPrompts", "check_vlm", "count_images", "fit_image",
           "image_marker", "image_spans", "load_vlm", "profile_worst_case", "prompt_inputs"]
