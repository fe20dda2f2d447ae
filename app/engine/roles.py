"""The roles a served model can have, as one table: what each loads, what it serves, what it costs.

    role       handle         loader                  memory                     serves
    chat       ChatEngine     mlx-lm (or mlx-vlm for   weights + KV budget        chat APIs, captions
                              a native VLM)           (+ its draft model's KV    (a native VLM)
                                                      for its rows)
    vision     ChatEngine     mlx-vlm                 weights + KV budget        captions (proxy mode)
    embedding  EncoderEngine  mlx-embeddings          weights x (1 + activ.)     /v1/embeddings, /v1/rerank
    rerank     EncoderEngine  mlx-embeddings          weights x (1 + activ.)     /v1/rerank

The registry reads this table and nothing else about a role: it loads a slot with
its row's loader (a generator run on the MLX thread in slices), budgets it with
the row's memory rule, and hands out leases by what the row serves
(``Registry.acquire_chat`` / ``acquire_captioner`` / ``acquire_encoder``), each
typed by its handle. The config side's twin is ``app/config/schema.py``'s
``ROLE_ENTRIES`` (role -> entry type -> params); a test checks the two name the
same roles. Config and the engine never import each other, so a role is a row on
each side: a new role (a draft model, speech-to-text) that reuses a params model
is its engine module (its handle and loader), a row here and one
``role_entry(...)`` row there. ``app/specs.py`` maps an entry by its params model,
not its role, and the registry is not edited (``Registry.acquire(name, api,
HandleClass)``); tests/engine/test_roles.py registers such a role to keep it so.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Literal

from app.engine.batch.batching import BatchingEngine
from app.engine.batch.encoder_engine import EncoderEngine
from app.engine.models.loader import LoadedModel, load_text_model_steps, model_source
from app.engine.models.progress import LoadProgress
from app.engine.params import ModelSpec
from app.engine.types import Engine, ModelHandle
from app.engine.worker import MLXWorker
from app.errors import InvalidRequestError

ChatEngine = Engine
# What a request asks a model for: a chat API, an embeddings or rerank one, or the
# proxy's image captions (which no client names).
Api = Literal["chat", "embedding", "rerank", "captions"]
# A loaded model and the bytes its weights (and a VLM's worst-case images) take.
Loaded = tuple[ModelHandle, int]
# How a chat model loads when not by mlx-lm's load (distributed: this rank's shard).
ChatLoader = Callable[[ModelSpec], tuple[ModelHandle, int]]
# An encoder's activations while it embeds, as a multiple of its weights (MiniLM measured
# ~2x for a full 4096-token batch).
ENCODER_ACTIVATION_FACTOR = 2.0


@dataclass(frozen=True)
class LoadContext:
    """What a loader may use besides the spec."""

    worker: MLXWorker
    load_chat: ChatLoader | None = None
    # The loaded draft model of a chat model whose spec names one (``speculative.draft``): the
    # registry loads that entry first and keeps it loaded while this one is.
    draft: LoadedModel | None = None
    # Where this load reports its phases (the registry gives each load its own).
    progress: LoadProgress = field(default_factory=LoadProgress)


Loader = Callable[[LoadContext, ModelSpec], Generator[None, None, Loaded]]


@dataclass(frozen=True)
class RoleSpec:
    """One role: its handle's class, its loader, its memory rule, what it serves."""

    handle: type[ModelHandle]  # the class its loader builds; ``Registry.acquire`` narrows to it
    load: Loader
    serves: frozenset[Api]
    # For error messages: "model 'x' is <what>".
    what: str
    # None: weights plus the KV budget (``ModelSpec.kv_budget_bytes``); else weights x (1 + this).
    activation_factor: float | None = None

    @property
    def public(self) -> bool:
        """Whether clients may name it (a vision entry only captions for the proxy)."""
        return bool(self.serves - {"captions"})

    def budget_bytes(self, weights: int, spec: ModelSpec) -> int:
        """What a model of this role counts against the memory limit."""
        if self.activation_factor is not None:
            return int(weights * (1 + self.activation_factor))
        return weights + spec.kv_budget_bytes


def _load_vlm(ctx: LoadContext, spec: ModelSpec) -> Generator[None, None, Loaded]:
    from app.engine.batch.engine import TextEngine
    from app.engine.batch.vision_rows import VisionRows
    from app.engine.models.vlm import load_vlm

    _require(spec, spec.load is not None and spec.engine is not None and spec.vision is not None)
    assert spec.load is not None and spec.engine is not None and spec.vision is not None
    path = model_source(spec.source, "vision", ctx.progress)
    ctx.progress.report("loading weights and profiling images")
    yield
    v = spec.vision
    vlm = load_vlm(path, spec.load, name=spec.name, max_pixels=v.max_pixels, min_pixels=v.min_pixels,
                   max_images=v.max_images)
    ctx.progress.report("starting engine")
    # The worst-case images' peak through the vision tower, and the cap on cached
    # image features, count with the weights.
    engine = TextEngine(ctx.worker, vlm, spec.engine, vision=VisionRows(vlm, ctx.worker, v.feature_cache_bytes))
    return engine, vlm.weights_bytes + vlm.profile_peak_bytes + v.feature_cache_bytes


def _load_chat(ctx: LoadContext, spec: ModelSpec) -> Generator[None, None, Loaded]:
    if spec.vision is not None:  # a native VLM
        return (yield from _load_vlm(ctx, spec))
    if ctx.load_chat is not None:
        ctx.progress.report("loading this rank's shard on every rank")
        yield
        return ctx.load_chat(spec)
    from app.engine.batch.engine import TextEngine

    _require(spec, spec.load is not None and spec.engine is not None)
    assert spec.load is not None and spec.engine is not None
    loaded = yield from load_text_model_steps(spec.source, spec.load, ctx.progress)
    if ctx.draft is None:
        return TextEngine(ctx.worker, loaded, spec.engine), loaded.weights_bytes
    from app.engine.speculative.draft_model import DraftModelSource

    draft = DraftModelSource(ctx.draft, loaded)  # refuses a draft with another tokenizer
    # The draft's KV for this model's rows counts with its weights: at most every token admitted,
    # at the draft's bytes per token (the draft's own weights count in its own entry).
    allowance = draft.budget(loaded.kv.budget_tokens(spec.engine.kv_mem_mb))
    return TextEngine(ctx.worker, loaded, spec.engine, draft=draft), loaded.weights_bytes + allowance


def _load_encoder(ctx: LoadContext, spec: ModelSpec) -> Generator[None, None, Loaded]:
    from app.engine.models.encoder import load_encoder

    _require(spec, spec.encoder is not None)
    assert spec.encoder is not None
    path = model_source(spec.source, "embedding", ctx.progress)  # the files mlx-embeddings loads, whatever the role
    ctx.progress.report("loading weights")
    yield
    encoder = load_encoder(path, name=spec.name, limits=spec.encoder.limits, dtype=spec.encoder.dtype)
    ctx.progress.report("starting engine")
    if spec.role == "embedding" and encoder.kind != "embedding":
        raise InvalidRequestError(f"model {spec.name!r} is a cross-encoder: serve it with role: rerank")
    engine = EncoderEngine(ctx.worker, encoder, max_queue=spec.max_queue, queue_timeout_s=spec.queue_timeout_s)
    return engine, encoder.weight_bytes


def _require(spec: ModelSpec, ok: bool) -> None:
    if not ok:
        raise InvalidRequestError(f"model {spec.name!r}: role {spec.role!r} (without its params) is not loaded by "
                                  "the registry")


ROLES: dict[str, RoleSpec] = {
    "chat": RoleSpec(BatchingEngine, _load_chat, frozenset({"chat", "captions"}),
                     "a chat model (/v1/chat/completions and friends)"),
    "vision": RoleSpec(BatchingEngine, _load_vlm, frozenset({"captions"}),
                       "a vision model (it captions images for proxy-mode chat models)"),
    "embedding": RoleSpec(EncoderEngine, _load_encoder, frozenset({"embedding", "rerank"}),
                          "an embedding model (/v1/embeddings, /v1/rerank)", ENCODER_ACTIVATION_FACTOR),
    "rerank": RoleSpec(EncoderEngine, _load_encoder, frozenset({"rerank"}),
                       "a rerank model (/v1/rerank)", ENCODER_ACTIVATION_FACTOR),
}


def role(name: str) -> RoleSpec:
    """The row of ``name``; a spec with a role the table lacks is a programming error."""
    try:
        return ROLES[name]
    except KeyError:
        raise InvalidRequestError(f"role {name!r} is not one of {', '.join(ROLES)}") from None
