"""What the route handlers share: the engine, the model profile, vision, settings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from app.api.metrics import Metrics
from app.api.prompting import ModelProfile
from app.config.loader import ResolvedConfig
from app.engine.engine import TextEngine
from app.engine.worker import MLXWorker


@dataclass
class VisionState:
    """The vision model's state, as /health and /v1/models report it."""

    mode: str  # the primary's vision_mode
    model: str | None = None
    available: bool = False
    reason: str | None = None
    proxy: Any = None  # app.vision.proxy.VisionProxy when mode is proxy


@dataclass
class AppState:
    config: ResolvedConfig
    worker: MLXWorker
    engine: TextEngine
    profile: ModelProfile
    vision: VisionState
    started: float = field(default_factory=time.time)
    metrics: Metrics = field(default_factory=Metrics)

    @property
    def reasoning_fields(self) -> tuple[str, ...]:
        return tuple(self.config.server.reasoning_fields)
