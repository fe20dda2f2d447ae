"""What the route handlers share: the pipeline, the engine, the model profile, settings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from app.api.metrics import Metrics
from app.config.loader import ResolvedConfig
from app.engine.types import Engine
from app.engine.worker import MLXWorker
from app.pipeline.pipeline import Pipeline, VisionState
from app.pipeline.prompting import ModelProfile


@dataclass
class AppState:
    config: ResolvedConfig
    worker: MLXWorker
    engine: Engine
    profile: ModelProfile
    vision: VisionState
    pipeline: Pipeline
    started: float = field(default_factory=time.time)
    metrics: Metrics = field(default_factory=Metrics)

    @property
    def reasoning_fields(self) -> tuple[str, ...]:
        return tuple(self.config.server.reasoning_fields)

    @property
    def default_model(self) -> str:
        """The model a request that names none (AG-UI) goes to, and /health names first."""
        return self.profile.name
