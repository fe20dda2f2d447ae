"""Vision: image input, the captioner, the caption cache, the proxy.

Layering: works on the conversation's typed messages (``app.messages``, below the
pipeline too); never imports the pipeline, Litestar, pydantic or ``app.api``. The captioner's VLM is a registry
slot, so mlx-vlm is imported only when one loads.
"""

from __future__ import annotations

from app.vision.cache import CaptionCache, CaptionKey
from app.vision.captioner import (
    DEFAULT_NO_TEXT_PROMPT,
    DEFAULT_PROMPT_TEMPLATE,
    Captioner,
    VlmCaptioner,
)
from app.vision.images import ImagePolicy, LoadedImage, downscale, load_image
from app.vision.proxy import (
    CaptionInfo,
    ProxyResult,
    VisionProxy,
)

__all__ = [
    "DEFAULT_NO_TEXT_PROMPT",
    "DEFAULT_PROMPT_TEMPLATE",
    "CaptionCache",
    "CaptionInfo",
    "CaptionKey",
    "Captioner",
    "ImagePolicy",
    "LoadedImage",
    "ProxyResult",
    "VisionProxy",
    "VlmCaptioner",
    "downscale",
    "load_image",
]
