"""Start-up wiring: the VisionProxy for a ``vision_mode: proxy`` model, from config.

The vision model is an ordinary registry slot (``app.vision.captioner.VlmCaptioner``
captions through it). One that cannot load (missing files, out of memory, a broken
checkout) never stops the server: the proxy is built without a captioner and
images become placeholders, with the reason in the warning and in /health.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from app.engine import Registry
from app.errors import AppError
from app.vision.cache import CaptionCache
from app.vision.captioner import DEFAULT_PROMPT_TEMPLATE, VlmCaptioner
from app.vision.images import ImagePolicy
from app.vision.native import native_images
from app.vision.proxy import VisionProxy

if TYPE_CHECKING:
    from PIL.Image import Image

    from app.config.loader import ResolvedConfig
    from app.config.schema import ChatEntry, ChatParams, ServerSettings, VisionParams
    from app.messages import Message

logger = logging.getLogger("tandem.vision")


def image_policy(server: ServerSettings, params: ChatParams | VisionParams) -> ImagePolicy:
    """The image limits: server-wide settings plus the vision model's per-request cap."""
    return ImagePolicy(
        max_image_bytes=server.max_image_bytes,
        max_pixels=server.max_image_pixels,
        max_images_per_request=params.max_images_per_request,
        allowed_file_dir=Path(server.image_file_dir).expanduser()
        if server.image_file_dir
        else None,
        allow_remote=server.allow_remote_images,
        remote_allow_hosts=tuple(server.remote_image_hosts),
        allow_private_remote=server.allow_private_remote_images,
        remote_timeout_s=server.remote_image_timeout_s,
        remote_max_bytes=server.max_image_bytes,
    )


def native_reader(config: ResolvedConfig, chat: ChatEntry) -> Callable[[Sequence[Message]], Awaitable[list[Image]]]:
    """For a ``vision_mode: native`` model: a request's messages -> their images, checked
    and decoded at the model's size, for its prompt builder (``native_images``)."""
    p = chat.params
    return partial(native_images, policy=image_policy(config.server, p), max_pixels=p.max_pixels,
                   min_pixels=p.min_pixels)


def build_proxy(config: ResolvedConfig, registry: Registry, *, load: bool = True,
                chat: ChatEntry | None = None) -> tuple[VisionProxy, str | None]:
    """The proxy of ``chat`` (default: the primary model), captioning with its vision model
    through the registry; return it and why vision is off, if it is. A ``role: vision``
    entry is loaded now (on the MLX thread), so a model that cannot load is reported at
    start-up; a native chat model loads when it is first needed.

    With ``load=False`` (``--no-vision``) the proxy has no captioner: images are
    still checked, then replaced by placeholders with a warning."""
    from app.config.schema import ChatEntry, ChatParams, VisionParams

    chat = chat or config.primary
    proxy_config = chat.capabilities.vision_proxy
    found = config.models_file.find(proxy_config.model) if proxy_config else None
    # An entry whose params bound images (chat or vision); an encoder cannot caption.
    vlm_params = found.params if found is not None and isinstance(found.params, ChatParams | VisionParams) else None
    entry = found if vlm_params is not None else None
    params = vlm_params or chat.params
    cache = CaptionCache(config.server.caption_cache_entries)
    policy = image_policy(config.server, params)

    def unavailable(reason: str) -> tuple[VisionProxy, str]:
        return VisionProxy(None, cache, policy, unavailable_reason=reason), reason

    if found is not None and entry is None:
        return unavailable(f"vision model {found.name!r} is not a VLM (role {found.role})")
    if proxy_config is None or entry is None:
        return unavailable("no vision model is configured")
    if not load:
        return unavailable("vision loading skipped (--no-vision)")
    native = isinstance(entry, ChatEntry) and entry.capabilities.vision_mode == "native"
    if not (entry.role == "vision" or native):
        return unavailable(f"vision model {entry.name!r} is neither a vision entry nor a native VLM chat model")
    try:
        captioner = VlmCaptioner(registry, entry.name, max_tokens=proxy_config.max_tokens,
                                 prompt_template=proxy_config.prompt_template or DEFAULT_PROMPT_TEMPLATE,
                                 max_pixels=params.max_pixels, min_pixels=params.min_pixels)
        loads_now = entry.role == "vision" and registry.loaded(entry.name) is None  # one load for every chat model
        error = registry.load_now(entry.name, required=False) if loads_now else None
    except AppError as exc:  # ConfigError from the prompt template, EngineDeadError from the thread
        error = exc.message
    if error is not None:
        logger.warning("vision model %s not loaded: %s", entry.name, error)
        return unavailable(f"cannot load vision model {entry.name}: {error}")
    return VisionProxy(captioner, cache, policy), None
