"""What the route handlers share: the registry, the pipeline, settings, metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from app.api.metrics import Metrics
from app.api.openai.response_store import ResponseStore
from app.config.loader import ResolvedConfig
from app.engine.distributed.distributed import Distributed
from app.engine.registry import Registry
from app.engine.types import Engine
from app.engine.worker import MLXWorker
from app.pipeline.pipeline import Pipeline, VisionState
from app.pipeline.prompting import ModelProfile


@dataclass
class AppState:
    config: ResolvedConfig
    worker: MLXWorker
    registry: Registry
    pipeline: Pipeline
    # The chat model /health names first, AG-UI runs without a model use, and the CLI loads at start.
    default_model: str
    started: float = field(default_factory=time.time)
    metrics: Metrics = field(default_factory=Metrics)
    # The Responses API's stored responses (server.responses_store_*).
    responses: ResponseStore = field(init=False)
    # This process's part in an mlx.launch (rank 0), or None in one process.
    distributed: Distributed | None = None

    def __post_init__(self) -> None:
        server = self.config.server
        self.responses = ResponseStore(server.responses_store_entries, server.responses_store_mb * 2**20)

    @property
    def reasoning_fields(self) -> tuple[str, ...]:
        return tuple(self.config.server.reasoning_fields)

    @property
    def engine(self) -> Engine:
        """The default model's engine (loaded at start-up; it loads again on its next
        request if it was unloaded since)."""
        engine: Engine | None = self.registry.loaded_chat(self.default_model)
        assert engine is not None, f"{self.default_model} is not loaded"
        return engine

    @property
    def profile(self) -> ModelProfile | None:
        return self.pipeline.profile(self.default_model)

    @property
    def vision(self) -> VisionState:
        return self.pipeline.vision(self.default_model)
