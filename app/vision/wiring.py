"""Start-up wiring: the VisionProxy for a ``vision_mode: proxy`` model, from config.

A vision model that cannot load (missing files, out of memory, a broken
checkout) never stops the server: the proxy is built without a captioner and
images become placeholders, with the reason in the warning and in /health.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from app.errors import AppError
from app.vision.cache import CaptionCache
from app.vision.captioner import DEFAULT_PROMPT_TEMPLATE, MlxExecutor, MlxVlmCaptioner
from app.vision.images import ImagePolicy
from app.vision.proxy import VisionProxy

if TYPE_CHECKING:
    from app.config.loader import ResolvedConfig
    from app.config.schema import ModelEntry, ModelParams, ServerSettings

logger = logging.getLogger("tandem.vision")


def image_policy(server: ServerSettings, params: ModelParams) -> ImagePolicy:
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


def build_proxy(config: ResolvedConfig, executor: MlxExecutor, *, load: bool = True,
                chat: ModelEntry | None = None) -> tuple[VisionProxy, str | None]:
    """Load the vision model of ``chat`` (default: the primary model) on the MLX thread;
    return the proxy and why vision is off, if it is.

    With ``load=False`` (``--no-vision``) the proxy has no captioner: images are
    still checked, then replaced by placeholders with a warning."""
    chat = chat or config.primary
    proxy_config = chat.capabilities.vision_proxy
    entry = config.models_file.find(proxy_config.model) if proxy_config else None
    params = (entry or chat).params
    cache = CaptionCache(config.server.caption_cache_entries)
    policy = image_policy(config.server, params)

    def unavailable(reason: str) -> tuple[VisionProxy, str]:
        return VisionProxy(None, cache, policy, unavailable_reason=reason), reason

    if proxy_config is None or entry is None:
        return unavailable("no vision model is configured")
    if not load:
        return unavailable("vision loading skipped (--no-vision)")
    source = Path(entry.local_path).expanduser() if entry.local_path else entry.hf_id
    if source is None:
        return unavailable(f"vision model {entry.name!r} needs local_path or hf_id")
    try:
        captioner = MlxVlmCaptioner(
            source,
            executor,
            name=entry.name,
            prompt_template=proxy_config.prompt_template or DEFAULT_PROMPT_TEMPLATE,
            max_tokens=proxy_config.max_tokens,
            max_pixels=params.max_pixels,
            min_pixels=params.min_pixels,
            idle_unload_s=config.models_file.idle_unload_secs,
        )
        captioner.load()
    except AppError as exc:  # ConfigError from the load, EngineDeadError from the thread
        logger.warning("vision model %s not loaded: %s", entry.name, exc.message)
        return unavailable(exc.message)
    return VisionProxy(captioner, cache, policy), None
