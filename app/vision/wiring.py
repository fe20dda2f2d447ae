"""Start-up wiring: the VisionProxy for a ``vision_mode: proxy`` model, from config.

A vision model that cannot load (missing files, out of memory, a broken
checkout) never stops the server: the proxy is built without a captioner and
images become placeholders, with the reason in the warning and in /health.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from app.engine.registry import Registry
from app.errors import AppError
from app.vision.cache import CaptionCache
from app.vision.captioner import (
    DEFAULT_NO_TEXT_PROMPT,
    DEFAULT_PROMPT_TEMPLATE,
    MlxExecutor,
    MlxVlmCaptioner,
    render_prompt,
)
from app.vision.images import ImagePolicy, LoadedImage
from app.vision.proxy import VisionProxy

if TYPE_CHECKING:
    from app.config.loader import ResolvedConfig
    from app.config.schema import ChatEntry, ChatParams, ServerSettings, VisionParams

logger = logging.getLogger("tandem.vision")
# The user's words in a caption prompt are cut at this many characters.
MAX_CONTEXT_CHARS = 2000


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


class LeasedCaptioner:
    """Captions with a VLM the registry serves natively (``vision_mode: native``): one
    loaded copy serves both roles. The VLM is leased per image, so it loads on demand and
    is never unloaded mid-caption; each caption is a request to its engine, batched with
    its chats and admitted under its KV budget."""

    def __init__(self, registry: Registry, name: str, *, prompt_template: str, max_tokens: int,
                 max_pixels: int | None) -> None:
        self._registry = registry
        self.name = name
        self.prompt_template = prompt_template
        self.max_tokens = max_tokens
        self.max_pixels = max_pixels

    def prompt(self, user_text: str | None) -> str:
        return render_prompt(self.prompt_template, DEFAULT_NO_TEXT_PROMPT, user_text, MAX_CONTEXT_CHARS)

    async def describe(self, image: LoadedImage, user_text: str | None) -> str:
        lease = await self._registry.acquire(self.name, roles=("chat",))
        try:
            captioner = MlxVlmCaptioner.from_engine(lease.handle, name=self.name,
                                                    prompt_template=self.prompt_template, max_tokens=self.max_tokens)
            return await captioner.describe(image, user_text)
        finally:
            lease.release()


def build_proxy(config: ResolvedConfig, executor: MlxExecutor, *, load: bool = True,
                chat: ChatEntry | None = None, registry: Registry | None = None) -> tuple[VisionProxy, str | None]:
    """Load the vision model of ``chat`` (default: the primary model) on the MLX thread;
    return the proxy and why vision is off, if it is.

    With ``load=False`` (``--no-vision``) the proxy has no captioner: images are
    still checked, then replaced by placeholders with a warning."""
    from app.config.schema import ChatEntry, VisionEntry

    chat = chat or config.primary
    proxy_config = chat.capabilities.vision_proxy
    found = config.models_file.find(proxy_config.model) if proxy_config else None
    entry = found if isinstance(found, (ChatEntry, VisionEntry)) else None  # an encoder cannot caption
    params = (entry or chat).params
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
    if entry.role == "chat" and entry.capabilities.vision_mode == "native" and registry is not None:
        leased = LeasedCaptioner(registry, entry.name, max_tokens=proxy_config.max_tokens, max_pixels=params.max_pixels,
                                 prompt_template=proxy_config.prompt_template or DEFAULT_PROMPT_TEMPLATE)
        return VisionProxy(leased, cache, policy), None
    source = Path(entry.local_path).expanduser() if entry.local_path else entry.hf_id
    if source is None:
        return unavailable(f"vision model {entry.name!r} needs local_path or hf_id")
    try:
        captioner = MlxVlmCaptioner(
            source,
            executor,
            hf_id=None if entry.local_path else entry.hf_id,
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
