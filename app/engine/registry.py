"""The model registry: every served model by name, loaded on demand, under one memory budget.

    unloaded --acquire--> loading --> loaded --idle / room--> unloading --> unloaded
                             \\--> failed --retry time, or an admin load--> loading

What a role loads, costs and serves is its row of ``app/engine/roles.py``; the
registry asks nothing else of a role. ``acquire_chat(name)`` returns a
``Lease[ChatEngine]`` on a loaded chat model (``acquire_captioner``: a
``Lease[TextEngine]`` serving a VLM, ``acquire_encoder``: a ``Lease[EncoderEngine]``); a model
with leases (requests preparing, queued or running) is never unloaded. Loading runs on the
MLX thread in slices (``MLXWorker.submit_steps``), so streams of models already
loaded keep moving; requests for a model that is loading wait under its queue
limits (429 when too many wait, 503 past ``queue_timeout_s``).

Memory: a model's budget is its weights plus, for a chat or vision model, its KV budget
(``mem``), and for an encoder an allowance for its activations. Loading a model
that does not fit first unloads the least recently used models that are idle
and not pinned; if it still cannot fit, the request gets a 503 saying what is
needed and what is free. After each load or unload, MLX's buffer cache is
bounded to what the budget leaves free, and on Metal the loaded models' memory
is kept wired (as mlx-lm's ``wired_limit`` does for mlx_lm.server).

A chat model with a draft model (models.yaml ``speculative.draft``) loads it first, as its
own entry (its weights and KV budget its own), and holds a lease on it while loaded: the
draft is never unloaded under its target, and is free to go once the target is. The draft's
KV for the target's rows counts with the target (``roles._load_chat``).

A model that fails to load is remembered as failed, with why: until its retry time
(``LOAD_RETRY_S`` after the first failure in a row, then the next step of it, the last
one repeating), each request for it gets a 503 with that reason and a ``Retry-After``
at once, rather than load it again (a broken model used to be loaded, and its error
logged, by every request of a burst). At the retry time the next request loads it
again; an admin load (``load``) tries at once. A load that succeeds forgets the
failures.

The dashboard's buttons are ``load``, ``unload_idle`` and ``pin``: the same
transitions, asked for by name (an unload never cuts off a request: 409 when busy).
While a model loads, its slot's ``LoadProgress`` says how far (downloading, converting,
loading weights: ``app/engine/models/progress.py``); ``snapshot`` shows its last step.

Bookkeeping (states, leases, timestamps) happens on the event loop; every MLX
call (loading, unloading) on the MLX thread.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import os
import time
from collections.abc import Callable, Generator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Generic, TypeVar

import mlx.core as mx

from app.engine.batch.batching import BatchingEngine
from app.engine.batch.encoder_engine import EncoderEngine
from app.engine.batch.engine import TextEngine
from app.engine.models.loader import LoadedModel
from app.engine.models.progress import LoadProgress, LoadStep
from app.engine.params import ModelSource, ModelSpec
from app.engine.roles import Api, ChatEngine, ChatLoader, LoadContext, Loaded, RoleSpec, role
from app.engine.types import GenerationRecord, ModelHandle
from app.engine.worker import MLXWorker
from app.errors import (
    AppError,
    ConflictError,
    EngineBusyError,
    EngineDeadError,
    InsufficientMemoryError,
    InvalidRequestError,
    ModelLoadError,
    ModelNotFoundError,
    RateLimitError,
)

log = logging.getLogger("tandem.registry")

MB = 2**20
# The memory budget when server.memory_limit_mb is not set: this share of physical memory.
DEFAULT_MEMORY_SHARE = 0.75
# How often idle models are looked for.
IDLE_SWEEP_S = 1.0
# Seconds a model that failed to load is not tried again, after 1, 2, 3, ... failures in a row
# (the last repeats): a model that cannot load costs a load every few minutes, not every request.
LOAD_RETRY_S = (10.0, 30.0, 60.0, 120.0, 300.0)
# An admin load (by a name clients may use) tries at once; a proxy's vision model has no such name.
_OR_ADMIN = {True: ", or on an admin load", False: ""}


@dataclass(eq=False)
class _Slot:
    spec: ModelSpec
    role: RoleSpec
    state: str = "unloaded"
    handle: ModelHandle | None = None
    weights_bytes: int = 0
    error: str | None = None
    leases: int = 0
    waiting: int = 0
    last_used: float | None = None
    transition: asyncio.Future[None] | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # The draft model this one loaded with (``speculative.draft``), leased while this one is loaded.
    draft: _Slot | None = None
    # How far the load in progress has got (None when not loading).
    progress: LoadProgress | None = None
    # Loads failed in a row, and when (time.monotonic) the next request may try again.
    failures: int = 0
    retry_at: float = 0.0

    @property
    def budget_bytes(self) -> int:
        """What this model counts against the memory limit while loaded."""
        return self.role.budget_bytes(self.weights_bytes, self.spec)

    @property
    def busy(self) -> bool:
        in_flight = self.handle.in_flight if self.handle is not None else 0
        return bool(self.leases or self.waiting or in_flight)

    def as_(self, cls: type[H]) -> H | None:
        """The handle if it is a ``cls`` (the registry's one way to tell handles apart), else None."""
        return self.handle if isinstance(self.handle, cls) else None

    @property
    def chat(self) -> ChatEngine | None:
        """The handle as a chat engine (text or VLM), or None (an encoder, or not loaded)."""
        return self.as_(BatchingEngine)


H = TypeVar("H", bound=ModelHandle)
H_co = TypeVar("H_co", bound=ModelHandle, covariant=True)


class Lease(Generic[H_co]):
    """A model kept loaded while a request uses it; ``release`` is idempotent."""

    def __init__(self, slot: _Slot, handle: H_co) -> None:
        self._slot = slot
        self._handle = handle
        self.name = slot.spec.name
        self.role = slot.spec.role
        self._released = False

    @property
    def handle(self) -> H_co:
        return self._handle

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._slot.leases -= 1
            self._slot.last_used = time.monotonic()


def physical_memory_bytes() -> int:
    """This machine's physical memory (unified memory on a Mac)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 * 2**30


def local_dir(source: ModelSource) -> Path | None:
    """Where a model's files already are on disk, without converting or downloading anything."""
    if source.local_path:
        return Path(source.local_path).expanduser()
    if source.builtin:
        from app.engine.paths import cache_root

        return cache_root() / "models" / source.builtin
    if source.weight_file:
        from app.engine.paths import cache_root

        return cache_root() / "converted" / source.name
    return None  # a hub id: its size is known after the load


def estimate_weights_bytes(path: Path | None) -> int:
    """The weights' size on disk, a good estimate of their size in memory before loading."""
    if path is None or not path.is_dir():
        return 0
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


class Registry:
    """Every served model by name and alias, its state, and the memory budget."""

    def __init__(self, worker: MLXWorker, specs: list[ModelSpec], *, memory_limit_bytes: int | None = None,
                 load_chat: ChatLoader | None = None, load_retry_s: tuple[float, ...] = LOAD_RETRY_S) -> None:
        self.worker = worker
        self.load_retry_s = load_retry_s
        # How a text chat model loads when not by mlx-lm's load (distributed: this rank's shard,
        # Distributed.load_engine): (engine, weights bytes). MLX thread.
        self._load_ctx = LoadContext(worker, load_chat)
        self.limit_bytes = memory_limit_bytes or int(physical_memory_bytes() * DEFAULT_MEMORY_SHARE)
        self._slots: dict[str, _Slot] = {}
        self._by_name: dict[str, _Slot] = {}
        for spec in specs:
            slot = _Slot(spec, role(spec.role))
            self._slots[spec.name] = slot
            for key in (spec.name, *spec.aliases):
                self._by_name.setdefault(key, slot)
        for slot in self._slots.values():
            draft = slot.spec.engine.speculative.draft if slot.spec.engine is not None else None
            if draft is not None and draft not in self._slots:
                log.warning("model %s: draft model %s is not served here; decoding without it", slot.spec.name, draft)
        self._listeners: list[Callable[[GenerationRecord], None]] = []
        self._load_listeners: list[Callable[[str, LoadStep], None]] = []
        self._sweeper: asyncio.Task[None] | None = None
        self._closing = False

    # ---- what is served -----------------------------------------------------------------

    @property
    def specs(self) -> list[ModelSpec]:
        return [slot.spec for slot in self._slots.values()]

    @property
    def public_specs(self) -> list[ModelSpec]:
        """The models clients may name (every role but those that only caption)."""
        return [slot.spec for slot in self._slots.values() if slot.role.public]

    def serves(self, name: str, api: Api) -> bool:
        """Whether the model ``name`` (a served entry's name) serves ``api``, by its role."""
        slot = self._slots.get(name)
        return slot is not None and api in slot.role.serves

    def spec(self, name: str, param: str = "model") -> ModelSpec:
        """The spec a client names as ``name`` (or alias); 404 if none."""
        return self._slot(name, None, param).spec

    def _slot(self, name: str, api: Api | None, param: str) -> _Slot:
        """The slot of ``name`` for ``api``: 404 for an unknown name (or a role no client may
        name, such as vision), 400 for a model of a role that does not serve ``api``."""
        slot = self._by_name.get(name)
        if slot is None or not (slot.role.public or api in slot.role.serves):
            shown = name if len(name) <= 64 else name[:64] + "..."
            served = ", ".join(sorted(s.spec.name for s in self._slots.values() if s.role.public))
            raise ModelNotFoundError(f"model {shown!r} does not exist; this server serves {served}", param=param)
        if api is not None and api not in slot.role.serves:
            raise InvalidRequestError(f"model {slot.spec.name!r} is {slot.role.what}", param=param,
                                      code="wrong_model_type")
        return slot

    def loaded(self, name: str) -> ModelHandle | None:
        """The handle of a loaded model, or None (no lease: for /health and tests)."""
        slot = self._slots.get(name)
        return slot.handle if slot is not None and slot.state == "loaded" else None

    def loaded_chat(self, name: str) -> ChatEngine | None:
        """A loaded chat (or vision) model's engine, or None."""
        slot = self._slots.get(name)
        return slot.chat if slot is not None and slot.state == "loaded" else None

    def loaded_encoder(self, name: str) -> EncoderEngine | None:
        """A loaded embedding or rerank model's encoder, or None."""
        slot = self._slots.get(name)
        return slot.as_(EncoderEngine) if slot is not None and slot.state == "loaded" else None

    @property
    def closing(self) -> bool:
        """Whether shutdown has begun (``stop_accepting``)."""
        return self._closing

    def stop_accepting(self) -> list[ModelHandle]:
        """Shutdown: no more loads, and every loaded model (chat, vision or encoder) refuses new
        requests; returns them, to drain."""
        self._closing = True
        handles = [s.handle for s in self._slots.values() if s.handle is not None]
        for handle in handles:
            handle.stop_accepting()
        return handles

    def add_listener(self, listener: Callable[[GenerationRecord], None]) -> None:
        """Be told of every generation of every chat engine, those loaded later included."""
        self._listeners.append(listener)
        for slot in self._slots.values():
            if (engine := slot.chat) is not None:
                engine.add_listener(listener)

    def add_load_listener(self, listener: Callable[[str, LoadStep], None]) -> None:
        """Be told of each step of every load (model name, step), on the thread that made it
        (the MLX thread, mostly): keep it short."""
        self._load_listeners.append(listener)

    def _start_loading(self, slot: _Slot) -> None:
        name = slot.spec.name

        def tell(step: LoadStep) -> None:
            for listener in self._load_listeners:
                listener(name, step)

        slot.state = "loading"
        slot.progress = LoadProgress(tell)
        slot.progress.report(slot.progress.step.phase)

    # ---- leases and loading ---------------------------------------------------------------

    async def acquire(self, name: str, api: Api, handle: type[H], param: str = "model") -> Lease[H]:
        """A lease on the model ``name`` for ``api``, its handle a ``handle``, loading it first
        if need be; 404 for an unknown model, 400 for one whose role does not serve ``api``."""
        slot = await self._acquire(name, api, param)
        return self._lease(slot, slot.as_(handle))

    async def acquire_chat(self, name: str, param: str = "model") -> Lease[ChatEngine]:
        """A lease on the chat model ``name`` (text or native VLM)."""
        return await self.acquire(name, "chat", BatchingEngine, param)

    async def acquire_captioner(self, name: str) -> Lease[TextEngine]:
        """A lease on the VLM that captions for the vision proxy (a vision entry, or a native
        VLM chat model): the one engine, serving a VLM (``vision`` set)."""
        slot = await self._acquire(name, "captions", "model")
        engine = slot.as_(TextEngine)
        return self._lease(slot, engine if engine is not None and engine.vision is not None else None)

    async def acquire_encoder(self, name: str, *, rerank: bool = False, param: str = "model") -> Lease[EncoderEngine]:
        """A lease on the encoder ``name`` for embeddings (an embedding model) or for ranking
        (``rerank``: an embedding or a rerank model)."""
        return await self.acquire(name, "rerank" if rerank else "embedding", EncoderEngine, param)

    async def _acquire(self, name: str, api: Api, param: str) -> _Slot:
        slot = self._slot(name, api, param)
        slot.leases += 1
        slot.last_used = time.monotonic()
        try:
            await self._ensure_loaded(slot)
        except BaseException:
            slot.leases -= 1
            raise
        return slot

    @staticmethod
    def _lease(slot: _Slot, handle: H | None) -> Lease[H]:
        """The lease on ``slot`` as the handle asked for; a chat model that is not a VLM asked
        to caption (the one mismatch the table lets through) gets a 400."""
        if handle is None:
            slot.leases -= 1
            raise InvalidRequestError(f"model {slot.spec.name!r} ({type(slot.handle).__name__}) cannot serve this",
                                      code="wrong_model_type")
        return Lease(slot, handle)

    async def _ensure_loaded(self, slot: _Slot, *, now: bool = False) -> None:
        """Load ``slot`` unless it is loaded; a model that failed is tried again only at its
        retry time, or at once when ``now`` (an admin load)."""
        while slot.state != "loaded":
            if slot.transition is not None and not slot.transition.done():
                await self._wait(slot)
                continue
            if self._closing:
                raise EngineDeadError("the server is shutting down", retry_after=10)
            async with slot.lock:
                if slot.state == "failed" and not now and time.monotonic() < slot.retry_at:
                    raise self._load_error(slot)
                if slot.state in ("unloaded", "failed"):
                    draft = await self._acquire_draft(slot)
                    try:
                        await self._make_room(slot)
                    except BaseException:
                        self._release_draft(draft)
                        raise
                    self._start_loading(slot)
                    slot.transition = asyncio.ensure_future(self._load(slot, draft))
            if slot.state == "failed":
                raise self._load_error(slot)

    def _load_error(self, slot: _Slot) -> ModelLoadError:
        """The 503 for a model whose last load failed: why, and when it is tried again."""
        wait = max(1, math.ceil(slot.retry_at - time.monotonic()))
        tries = f"{slot.failures} time{'s' if slot.failures > 1 else ''}"
        return ModelLoadError(f"model {slot.spec.name!r} could not be loaded: {slot.error} (tried {tries}; next try "
                              f"in {wait}s{_OR_ADMIN[slot.role.public]})", retry_after=wait)

    def _failed(self, slot: _Slot, error: str, exc: BaseException | None = None) -> None:
        """Remember a failed load: why, and when the next request may try again; ``exc``: an
        unexpected exception, logged with its traceback."""
        slot.state, slot.error, slot.progress = "failed", error, None
        slot.failures += 1
        delay = self.load_retry_s[min(slot.failures, len(self.load_retry_s)) - 1]
        slot.retry_at = time.monotonic() + delay
        log.error("model %s: load failed (%d in a row; next try in %gs%s): %s", slot.spec.name, slot.failures, delay,
                  _OR_ADMIN[slot.role.public], error, exc_info=exc)

    async def _wait(self, slot: _Slot) -> None:
        """Wait for a load (or unload) in progress, under the model's queue limits."""
        spec = slot.spec
        if slot.waiting >= spec.max_queue:
            raise RateLimitError(f"model {slot.spec.name!r} is loading and {slot.waiting} requests wait for it; "
                                 "retry shortly", retry_after=2)
        slot.waiting += 1
        try:
            assert slot.transition is not None
            await asyncio.wait_for(asyncio.shield(slot.transition), spec.queue_timeout_s)
        except TimeoutError as exc:
            raise EngineBusyError(f"model {slot.spec.name!r} did not finish loading within "
                                  f"{spec.queue_timeout_s:.0f}s; retry shortly", retry_after=5) from exc
        finally:
            slot.waiting -= 1
        if slot.state == "failed":
            raise self._load_error(slot)

    def load_now(self, name: str, *, required: bool = True) -> str | None:
        """Load ``name`` at start-up, before the event loop runs (the default model, ``preload:
        true`` ones, a proxy's vision model). A required model that cannot load raises (start-up
        stops); another's error is returned (None when it loaded)."""
        slot = self._slots[name]
        draft = self._draft_slot(slot)
        if draft is not None and draft.state != "loaded" and (error := self.load_now(draft.spec.name, required=False)):
            error = f"its draft model {draft.spec.name!r} could not be loaded: {error}"
            if required:
                raise ModelLoadError(f"model {name!r} could not be loaded: {error}")
            self._failed(slot, error)
            return slot.error
        if draft is not None:
            draft.leases += 1
        started = time.monotonic()
        self._start_loading(slot)
        try:
            handle, weights = self.worker.submit_steps(lambda: self._load_steps(slot, draft)).result()
        except Exception as exc:
            self._release_draft(draft)
            error = exc.message if isinstance(exc, AppError) else repr(exc)
            if required:  # start-up stops, and says why
                slot.state, slot.error, slot.progress = "failed", error, None
                raise
            self._failed(slot, error)
            return slot.error
        self._loaded(slot, handle, weights, started, draft)
        return None

    async def _load(self, slot: _Slot, draft: _Slot | None = None) -> None:
        started = time.monotonic()
        try:
            handle, weights = await asyncio.wrap_future(
                self.worker.submit_steps(lambda: self._load_steps(slot, draft)))
        except AppError as exc:
            self._release_draft(draft)
            self._failed(slot, exc.message)
            return
        except Exception as exc:  # noqa: BLE001 - a model that cannot load fails its requests, not the server
            self._release_draft(draft)
            self._failed(slot, f"{type(exc).__name__}: {exc}", exc)
            return
        self._loaded(slot, handle, weights, started, draft)

    def _loaded(self, slot: _Slot, handle: ModelHandle, weights: int, started: float,
                draft: _Slot | None = None) -> None:
        slot.handle, slot.weights_bytes, slot.error, slot.progress = handle, weights, None, None
        slot.state, slot.draft, slot.failures = "loaded", draft, 0
        if (engine := slot.chat) is not None:
            for listener in self._listeners:
                engine.add_listener(listener)
        log.info("model %s: loaded in %.1fs, %.0f MB of weights; %.0f of %.0f MB in use", slot.spec.name,
                 time.monotonic() - started, weights / MB, self.used_bytes / MB, self.limit_bytes / MB)
        self.worker.submit(self._tune_mlx_memory)

    def _load_steps(self, slot: _Slot, draft: _Slot | None = None) -> Generator[None, None, Loaded]:
        """Load one model on the MLX thread, in slices, by its role's loader (with its loaded draft model)."""
        assert slot.progress is not None
        ctx = replace(self._load_ctx, progress=slot.progress)
        if draft is not None:
            engine = draft.as_(TextEngine)
            if engine is None or not isinstance(engine.loaded, LoadedModel):
                raise ModelLoadError(f"model {slot.spec.name!r}: draft model {draft.spec.name!r} is not a text "
                                     f"model served by mlx-lm ({type(draft.handle).__name__})")
            ctx = replace(ctx, draft=engine.loaded)
        handle, weights = yield from slot.role.load(ctx, slot.spec)
        if not isinstance(handle, slot.role.handle):
            handle.close()
            raise TypeError(f"model {slot.spec.name}: role {slot.spec.role} loaded a {type(handle).__name__}")
        return handle, weights

    # ---- draft models: loaded with their target, and kept loaded while it is -----------------

    def _draft_slot(self, slot: _Slot) -> _Slot | None:
        """The slot of the draft model ``slot``'s spec names, or None (none named; or not served
        here: distributed serving serves one chat model, which then decodes without it)."""
        name = slot.spec.engine.speculative.draft if slot.spec.engine is not None else None
        return self._slots.get(name) if name is not None else None

    async def _acquire_draft(self, slot: _Slot) -> _Slot | None:
        """Load ``slot``'s draft model (making room as its own request would) and lease it; the
        lease is given back when ``slot`` unloads or fails to load."""
        draft = self._draft_slot(slot)
        if draft is None:
            return None
        draft.leases += 1
        draft.last_used = time.monotonic()
        try:
            await self._ensure_loaded(draft)
        except AppError as exc:
            draft.leases -= 1
            raise ModelLoadError(f"model {slot.spec.name!r} could not be loaded: its draft model "
                                 f"{draft.spec.name!r}: {exc.message}", headers=exc.headers) from exc
        except BaseException:
            draft.leases -= 1
            raise
        return draft

    @staticmethod
    def _release_draft(draft: _Slot | None) -> None:
        if draft is not None:
            draft.leases -= 1
            draft.last_used = time.monotonic()

    # ---- admin actions (the dashboard's buttons) -----------------------------------------------

    async def load(self, name: str, param: str = "model") -> str:
        """Load a model clients may name, as its first request would (making room the same way),
        without serving anything; one that failed is tried at once, whatever its retry time.
        Returns its served name."""
        slot = self._slot(name, None, param)
        slot.leases += 1  # no idle sweep or room-making unloads it while it loads
        slot.last_used = time.monotonic()
        try:
            await self._ensure_loaded(slot, now=True)
        finally:
            slot.leases -= 1
        return slot.spec.name

    async def unload_idle(self, name: str, param: str = "model") -> str:
        """Unload a model on request: 409 if it is pinned, busy or loading (nothing is cut off);
        a model already unloaded stays so. Returns its served name."""
        slot = self._slot(name, None, param)
        what = slot.spec.name
        if slot.spec.pin:
            raise ConflictError(f"model {what!r} is pinned; unpin it first", param=param, code="model_pinned")
        if slot.state in ("loading", "unloading"):
            raise ConflictError(f"model {what!r} is {slot.state}; retry when it is done", param=param,
                                code="model_busy")
        targets = [s.spec.name for s in self._slots.values() if s.draft is slot]
        if targets:
            raise ConflictError(f"model {what!r} drafts for {', '.join(map(repr, targets))}, which is loaded; unload "
                                "that first", param=param, code="model_busy")
        if slot.state == "loaded" and slot.busy:
            raise ConflictError(f"model {what!r} is serving requests; retry when they are done", param=param,
                                code="model_busy")
        await self.unload(what, reason="asked to")
        return what

    def pin(self, name: str, pinned: bool, param: str = "model") -> str:
        """Pin a model (never unloaded when idle or to make room) or unpin it, until the server
        restarts (models.yaml's ``pin`` is the lasting setting). Returns its served name."""
        slot = self._slot(name, None, param)
        slot.spec = replace(slot.spec, pin=pinned)
        return slot.spec.name

    # ---- memory -----------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        return sum(s.budget_bytes for s in self._slots.values() if s.state in ("loaded", "unloading"))

    def _need_bytes(self, slot: _Slot) -> int:
        need = slot.role.budget_bytes(estimate_weights_bytes(local_dir(slot.spec.source)), slot.spec)
        if self._draft_slot(slot) is not None:
            # Its draft's KV for its rows, before the load tells: as if a draft token cost what one of its own does.
            need += slot.spec.kv_budget_bytes
        return need

    async def _make_room(self, slot: _Slot) -> None:
        """Unload least recently used idle models until ``slot`` fits; 503 if it cannot. The
        fit is checked first: a model that would not fit even with every idle one unloaded
        unloads nothing (the default model stays loaded for the next request)."""
        need = self._need_bytes(slot)
        loading = sum(self._need_bytes(s) for s in self._slots.values() if s.state == "loading")
        while self.used_bytes + loading + need > self.limit_bytes:
            victims = sorted((s for s in self._slots.values()
                              if s.state == "loaded" and not s.spec.pin and not s.busy and s is not slot),
                             key=lambda s: s.last_used or 0.0)
            freeable = sum(v.budget_bytes for v in victims)
            if self.used_bytes + loading + need - freeable > self.limit_bytes:
                free = max(0, self.limit_bytes - self.used_bytes - loading)
                loaded = ", ".join(f"{s.spec.name} ({s.budget_bytes / MB:.0f} MB{', pinned' if s.spec.pin else ''}"
                                   f"{', busy' if s.busy else ''})" for s in self._slots.values()
                                   if s.state == "loaded") or "none"
                raise InsufficientMemoryError(
                    f"model {slot.spec.name!r} needs {need / MB:.0f} MB but {free / MB:.0f} MB of the "
                    f"{self.limit_bytes / MB:.0f} MB memory limit (server.memory_limit_mb) are free, "
                    f"{(free + freeable) / MB:.0f} MB with every idle model unloaded; loaded: {loaded}")
            await self.unload(victims[0].spec.name, reason="to make room for " + slot.spec.name)

    async def unload(self, name: str, reason: str = "") -> None:
        """Unload an idle model, freeing its memory (MLX thread)."""
        slot = self._slots[name]
        if slot.state != "loaded" or slot.busy:
            return
        slot.state = "unloading"
        handle = slot.handle
        assert handle is not None
        loop = asyncio.get_running_loop()
        slot.transition = loop.create_future()

        def unload_on_mlx_thread() -> None:
            handle.close()
            gc.collect()
            mx.clear_cache()
            self._tune_mlx_memory()

        try:
            await asyncio.wrap_future(self.worker.submit(unload_on_mlx_thread))
        finally:
            slot.handle, slot.weights_bytes = None, 0
            slot.state = "unloaded"
            self._release_draft(slot.draft)
            slot.draft = None
            slot.transition.set_result(None)
            log.info("model %s: unloaded%s; %.0f of %.0f MB in use", name, f" ({reason})" if reason else "",
                     self.used_bytes / MB, self.limit_bytes / MB)

    def _tune_mlx_memory(self) -> None:
        """Bound MLX's buffer cache to what the budget leaves free; on Metal, keep the loaded
        models wired. MLX thread only."""
        free = max(0, self.limit_bytes - self.used_bytes)
        mx.set_cache_limit(free)
        metal = getattr(mx, "metal", None)
        if metal is not None and metal.is_available():
            ceiling = int(metal.device_info().get("max_recommended_working_set_size", self.limit_bytes))
            mx.set_wired_limit(min(self.used_bytes, ceiling))

    # ---- idle unloading ---------------------------------------------------------------------

    def start(self) -> None:
        """Start unloading idle models (call on the server's event loop)."""
        if self._sweeper is None and any(s.spec.idle_unload_s for s in self._slots.values()):
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(IDLE_SWEEP_S)
            now = time.monotonic()
            for slot in list(self._slots.values()):
                idle = slot.spec.idle_unload_s
                if (idle and slot.state == "loaded" and not slot.spec.pin and not slot.busy
                        and now - (slot.last_used or now) >= idle):
                    try:
                        await self.unload(slot.spec.name, reason=f"idle for {idle:g}s")
                    except AppError as exc:  # the engine thread is gone: nothing to unload on
                        log.warning("model %s: not unloaded: %s", slot.spec.name, exc.message)

    # ---- reporting ----------------------------------------------------------------------------

    def on_disk(self, name: str) -> bool | None:
        """Whether a model's files are on disk (a hub model: in the hub's cache); None: unknown."""
        source = self._slots[name].spec.source
        path = local_dir(source)
        if path is not None:
            return path.exists()
        if source.hf_id:
            try:
                from huggingface_hub import try_to_load_from_cache
            except ImportError:
                return None
            return isinstance(try_to_load_from_cache(source.hf_id, "config.json"), str)
        return None

    def snapshot(self) -> dict[str, Any]:
        """Every model's state and memory, and the budget, for /health and /metrics."""
        now = time.monotonic()
        models: dict[str, Any] = {}
        for slot in self._slots.values():
            kv_used, running, waiting = 0.0, 0, 0
            if (engine := slot.chat) is not None:
                stats = engine.stats()
                kv_used = stats.kv_reserved_bytes / MB
                running, waiting = stats.active, stats.waiting + stats.paused
            elif (encoder := slot.as_(EncoderEngine)) is not None:
                jobs = encoder.stats()
                running, waiting = jobs.running, jobs.waiting
            models[slot.spec.name] = {
                "role": slot.spec.role, "state": slot.state, "pinned": slot.spec.pin,
                "idle_s": None if slot.last_used is None else round(now - slot.last_used, 1),
                "memory_mb": {"weights": round(slot.weights_bytes / MB, 1),
                              "kv_budget": round(slot.spec.kv_budget_bytes / MB, 1) if slot.state == "loaded" else 0.0,
                              "kv_used": round(kv_used, 1)},
                "requests": {"running": running, "waiting": waiting + slot.waiting},
                "draft": slot.draft.spec.name if slot.draft is not None else None,
                "error": slot.error,
                # While loading: {"phase", "done", "total", "unit"} (``LoadStep``).
                "progress": asdict(slot.progress.step) if slot.progress is not None else None,
            }
        used = self.used_bytes
        return {
            "limit_mb": round(self.limit_bytes / MB), "used_mb": round(used / MB),
            "free_mb": round(max(0, self.limit_bytes - used) / MB),
            "mlx": {"active_mb": round(mx.get_active_memory() / MB, 1), "peak_mb": round(mx.get_peak_memory() / MB, 1),
                    "cache_mb": round(mx.get_cache_memory() / MB, 1)},
            "models": models,
        }
