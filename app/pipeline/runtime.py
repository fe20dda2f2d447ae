"""The server as the API layer sees it: what it serves and how it is doing.

The wire formats reach the rest of Tandem through the pipeline only
(``tests/test_layering.py``). Besides requests (``Pipeline``) they need the state of
what serves them: the models /v1/models lists, /health's report, the figures /metrics
reads when scraped, the server's settings. ``Runtime`` holds the parts ``app/main.py``
wires together (the config, the MLX thread, the registry, the pipeline) and answers
those questions in typed reports, so no route holds an engine or reads the registry.

    Runtime.models() / model(name)   ModelReport per served model (what /v1/models shows)
    Runtime.health()                 Health: the engine thread, memory, models, vision
    Runtime.figures()                Figures: every loaded engine's stats, for /metrics
    Runtime.overview()               Overview: every entry's state and memory, for the dashboard
    Runtime.load / unload / pin      the dashboard's buttons (through the registry)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from app.config.loader import ResolvedConfig
from app.config.schema import ServerSettings
from app.engine import (
    SCORED,
    CacheTierStats,
    Distributed,
    DraftCounts,
    EncoderStats,
    Engine,
    EngineStats,
    GenerationRecord,
    LoadStep,
    MLXWorker,
    ModelSpec,
    Registry,
)
from app.pipeline.pipeline import Pipeline, VisionState
from app.pipeline.prompting import ModelProfile
from app.request_context import note_model

# What the API layer names of the layers below, through this module.
__all__ = ["SCORED", "CacheTierStats", "EncoderStats", "EngineStats", "Figures", "GenerationRecord", "Health",
           "LoadStep", "ModelReport", "ModelState", "Overview", "Runtime", "ServerSettings", "VisionReport"]


@dataclass(frozen=True)
class VisionReport:
    """How images reach a chat model."""

    mode: str
    model: str | None
    available: bool
    reason: str | None

    @classmethod
    def of(cls, v: VisionState) -> VisionReport:
        return cls(v.mode, v.model, v.available, v.reason)


@dataclass(frozen=True)
class ModelReport:
    """One served model: what is known before loading, and more once loaded."""

    name: str
    role: str
    loaded: bool
    # Chat models: their vision, and (once profiled) reasoning and tool parser.
    chat: bool
    vision: VisionReport | None = None
    reasoning: bool | None = None
    tool_parser: str | None = None
    max_model_len: int | None = None
    # Embedding models, once loaded.
    dimensions: int | None = None


@dataclass(frozen=True)
class Health:
    """/health's facts."""

    alive: bool
    error: str | None
    default_model: str
    # The registry's snapshot: the budget, MLX's memory, every model's state and memory.
    memory: dict[str, Any]
    # The default model's engine, when loaded.
    engine: EngineStats | None
    vision: VisionReport
    distributed: dict[str, Any] | None
    # The proxy caption cache's counters (hits, misses, evictions, bytes, entries), when the
    # default model has one; a native VLM's vision-feature cache is in ``engine``.
    captions: dict[str, int] | None = None
    # Each loaded chat model's speculative decoding, per drafter: tokens proposed and accepted.
    speculation: dict[str, dict[str, DraftCounts]] = field(default_factory=dict)
    # Each loaded chat model's family as its template says (``family_report``).
    families: dict[str, dict[str, Any]] = field(default_factory=dict)


def family_report(profile: ModelProfile) -> dict[str, Any]:
    """How a chat model's output is read, and why: the parser family, its reasoning markers
    and the template switches Tandem sets (what /health and the load log say)."""
    found = profile.detection
    return {"tool_parser": profile.parser, "reasoning": profile.reasoning,
            "reasoning_markers": list(profile.reasoning_markers),
            "prompt_opens_reasoning": found.opens_reasoning if found is not None else False,
            "switches": list(profile.switches), "why": found.why if found is not None else ""}


@dataclass(frozen=True)
class Figures:
    """What /metrics reads at scrape time."""

    alive: bool
    chat: list[tuple[str, EngineStats]]
    encoders: list[tuple[str, EncoderStats]]
    memory: dict[str, Any]
    # The proxy caption cache's counters (hits, misses, evictions, bytes, entries), when the
    # default model has one.
    captions: dict[str, int] | None


@dataclass(frozen=True)
class ModelState:
    """One models.yaml entry as the dashboard shows it: its state, memory and load."""

    name: str
    role: str
    # unloaded | loading | loaded | unloading | failed
    state: str
    default: bool
    pinned: bool
    # Whether its files are on disk (unloaded hub models may not be); None: unknown.
    on_disk: bool | None
    # Clients may name it (a vision entry only captions: no buttons).
    public: bool
    idle_s: float | None
    weights_mb: float
    kv_budget_mb: float
    kv_used_mb: float
    running: int
    waiting: int
    error: str | None
    # A loaded chat model's prefix-cache tiers ("memory", and "disk" when on).
    cache_tiers: dict[str, CacheTierStats] = field(default_factory=dict)
    # A loaded chat model's speculative decoding, per drafter: tokens proposed and accepted so far.
    speculation: dict[str, DraftCounts] = field(default_factory=dict)
    # While loading: how far (downloading, converting, loading weights, starting engine).
    progress: LoadStep | None = None


@dataclass(frozen=True)
class Overview:
    """The whole server at a glance: the budget, MLX's memory, every entry."""

    alive: bool
    default_model: str
    limit_mb: float
    used_mb: float
    mlx: dict[str, float]
    models: list[ModelState]
    distributed: dict[str, Any] | None


@dataclass
class Runtime:
    config: ResolvedConfig
    worker: MLXWorker
    registry: Registry
    pipeline: Pipeline
    # The chat model /health names first, AG-UI runs without a model use, and the CLI loads at start.
    default_model: str
    started: float = field(default_factory=time.time)
    # This process's part in an mlx.launch (rank 0), or None in one process.
    distributed: Distributed | None = None

    @property
    def settings(self) -> ServerSettings:
        return self.config.server

    @property
    def reasoning_fields(self) -> tuple[str, ...]:
        return tuple(self.config.server.reasoning_fields)

    @property
    def alive(self) -> bool:
        """Whether the MLX thread runs."""
        return self.worker.alive

    @property
    def closing(self) -> bool:
        """Whether shutdown has begun: long-lived streams that are not generations (the
        dashboard's) end, so the HTTP server's drain does not wait on them."""
        return self.registry.closing

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

    # ---- reports ---------------------------------------------------------------------------

    def models(self) -> list[ModelReport]:
        """Every model the API serves (a vision entry captions for proxy-mode models and serves
        no API of its own)."""
        return [self._report(spec) for spec in self.registry.public_specs]

    def model(self, name: str) -> ModelReport:
        """One model by name (``ModelNotFoundError`` if none is served so)."""
        return self._report(self.registry.spec(name))

    def _report(self, spec: ModelSpec) -> ModelReport:
        loaded = self.registry.loaded(spec.name) is not None
        if self.registry.serves(spec.name, "chat"):
            profile = self.pipeline.profile(spec.name)
            vision = VisionReport.of(self.pipeline.vision(spec.name))
            if profile is None:
                return ModelReport(spec.name, spec.role, loaded, True, vision)
            return ModelReport(spec.name, spec.role, loaded, True, vision, profile.reasoning, profile.parser,
                               profile.max_model_len)
        encoder = self.registry.loaded_encoder(spec.name)
        if encoder is None:
            return ModelReport(spec.name, spec.role, loaded, False)
        return ModelReport(spec.name, spec.role, loaded, False, max_model_len=encoder.encoder.max_length,
                           dimensions=encoder.encoder.dim)

    def health(self) -> Health:
        engine = self.registry.loaded_chat(self.default_model)
        dead = self.worker.dead
        speculation = {name: dict(stats.speculation) for name, stats in self._chat_stats()}
        families = {name: family_report(profile) for name, _ in self._chat_stats()
                    if (profile := self.pipeline.profile(name)) is not None}
        return Health(self.worker.alive, repr(dead) if dead else None, self.default_model, self.registry.snapshot(),
                      engine.stats() if engine is not None else None, VisionReport.of(self.vision),
                      self.distributed.health() if self.distributed is not None else None,
                      self.vision.proxy.cache.stats() if self.vision.proxy is not None else None, speculation,
                      families)

    def _chat_stats(self) -> list[tuple[str, EngineStats]]:
        """Every loaded chat model's engine stats."""
        registry = self.registry
        return [(e.name, e.stats()) for spec in registry.specs
                if registry.serves(spec.name, "chat") and (e := registry.loaded_chat(spec.name))]

    def figures(self) -> Figures:
        registry = self.registry
        chat = self._chat_stats()
        encoders = [(enc.name, enc.stats()) for spec in registry.specs
                    if (enc := registry.loaded_encoder(spec.name))]
        proxy = self.vision.proxy
        return Figures(self.worker.alive, chat, encoders, registry.snapshot(),
                       proxy.cache.stats() if proxy is not None else None)

    def overview(self) -> Overview:
        registry = self.registry
        snapshot = registry.snapshot()
        public = {spec.name for spec in registry.public_specs}
        models = []
        for spec in registry.specs:
            row = snapshot["models"][spec.name]
            mem, requests = row["memory_mb"], row["requests"]
            engine = registry.loaded_chat(spec.name)
            stats = engine.stats() if engine is not None else None
            on_disk = True if row["state"] == "loaded" else registry.on_disk(spec.name)
            models.append(ModelState(spec.name, spec.role, row["state"], spec.name == self.default_model,
                                     row["pinned"], on_disk, spec.name in public, row["idle_s"], mem["weights"],
                                     mem["kv_budget"], mem["kv_used"], requests["running"], requests["waiting"],
                                     row["error"], dict(stats.prompt_cache_tiers) if stats else {},
                                     dict(stats.speculation) if stats else {},
                                     LoadStep(**row["progress"]) if row["progress"] else None))
        return Overview(self.worker.alive, self.default_model, snapshot["limit_mb"], snapshot["used_mb"],
                        snapshot["mlx"], models,
                        self.distributed.health() if self.distributed is not None else None)

    def _state(self, name: str) -> ModelState:
        note_model(name)
        return next(m for m in self.overview().models if m.name == name)

    async def load(self, name: str) -> ModelState:
        """Load a served model now (404 for an unknown name; 503 when it cannot fit or load)."""
        return self._state(await self.registry.load(name))

    async def unload(self, name: str) -> ModelState:
        """Unload a model now (409 while it is pinned, busy or loading)."""
        return self._state(await self.registry.unload_idle(name))

    def pin(self, name: str, pinned: bool) -> ModelState:
        """Pin or unpin a model until the server restarts."""
        return self._state(self.registry.pin(name, pinned))
