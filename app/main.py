"""create_app(config) -> Litestar: the one place where the parts are wired together.

``build_state`` starts the MLX-owner thread and loads the chat model on it
(and the vision model, whose failure is logged and reported, never fatal);
``create_app`` puts routes, error handlers, auth, CORS and limits around it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from litestar import Litestar, Router
from litestar.config.cors import CORSConfig
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin

from app.api import request_id
from app.api.agui import agui
from app.api.anthropic.messages import anthropic_router
from app.api.body import BoundedRequest
from app.api.errors import exception_handlers
from app.api.guards import api_key_guard, api_keys, request_guard
from app.api.meta import get_model, health, health_head, list_models
from app.api.metrics import metrics
from app.api.openai.chat import chat_completions
from app.api.openai.completions import completions
from app.api.openai.decisions import create_decision
from app.api.openai.embeddings import embeddings
from app.api.openai.responses import create_response, delete_response, get_response, list_input_items
from app.api.rerank import rerank
from app.api.state import AppState
from app.api.streaming import WARNING_HEADER
from app.api.ui.activity import Activity
from app.api.ui.dashboard import ADMIN, PAGE, EventStreams, dashboard_events
from app.config.loader import ResolvedConfig
from app.config.schema import ChatEntry, ModelEntry, ServerSettings
from app.engine import ROLES, Distributed, MLXWorker, ModelHandle, Registry
from app.errors import EngineDeadError
from app.pipeline.pipeline import ChatConfig, Pipeline, VisionState, log_generation
from app.pipeline.runtime import family_report
from app.specs import load_params, model_spec

log = logging.getLogger("tandem")


def build_state(config: ResolvedConfig, *, load_vision: bool = True, worker: MLXWorker | None = None,
                dist: Distributed | None = None) -> AppState:
    """Start the MLX thread (unless given one), load the default model (and ``preload`` ones),
    and return the shared state; every other served model loads on its first request. With
    ``dist`` (rank 0 of mlx.launch), the default model is this rank's shard, and the only chat model."""
    files = config.models_file
    primary = config.primary  # the default model, with the command line's overrides
    entries = [primary if e.name == primary.name else e for e in files.models]
    served: list[ModelEntry] = [e for e in entries if e.role in ROLES]
    if dist is not None:
        served = distributed_entries(served, primary.name)
    specs = [model_spec(e, files.idle_unload_secs) for e in served]
    log.info("model %s: LoadParams %s; distributed %s", primary.name, load_params(primary.params),
             dist.info.as_dict() if dist else None)
    if worker is None:
        worker = MLXWorker()
        worker.start()
    limit = config.server.memory_limit_mb
    registry = Registry(worker, specs, memory_limit_bytes=limit * 2**20 if limit else None,
                        load_chat=dist.load_engine if dist else None)
    try:
        registry.load_now(primary.name)
    except BaseException:
        worker.stop()  # a failed load leaves no thread behind; the caller reports why
        raise
    for entry in served:
        if entry.preload and entry.name != primary.name:
            registry.load_now(entry.name, required=False)
    chats = {e.name: ChatConfig(e.params, e.capabilities) for e in served if isinstance(e, ChatEntry)}
    vision = {e.name: build_vision(config, e, registry, load=load_vision) for e in served if isinstance(e, ChatEntry)}
    pipeline = Pipeline(registry, config.server, chats, vision)
    state = AppState(config, worker, registry, pipeline, primary.name, distributed=dist)
    registry.add_listener(state.metrics.on_generation)
    registry.add_listener(log_generation)
    state.metrics.watch(state.figures)
    profile = state.profile
    if profile is not None:
        family = family_report(profile)
        log.info("model %s: parser=%s reasoning=%s markers=%s switches=%s system_prompt=%s (%s)", primary.name,
                 profile.parser, profile.reasoning, "...".join(family["reasoning_markers"]),
                 ",".join(profile.switches) or "-", profile.system_prompt, family["why"])
    log.info("serving %s; memory limit %.0f MB", ", ".join(s.name for s in specs), registry.limit_bytes / 2**20)
    return state


def distributed_entries(served: list[ModelEntry], primary: str) -> list[ModelEntry]:
    """What rank 0 serves: the sharded default model, pinned (every rank holds it), as the only
    chat model; embedding and rerank models on rank 0 alone."""
    dropped = [e.name for e in served if e.role == "chat" and e.name != primary]
    if dropped:
        log.warning("distributed: only %s is served; chat models %s are not", primary, ", ".join(dropped))
    return [e.model_copy(update={"pin": True, "idle_unload_secs": 0}) if e.name == primary else e
            for e in served if e.role != "chat" or e.name == primary]


def build_vision(config: ResolvedConfig, chat: ChatEntry, registry: Registry, *, load: bool = True) -> VisionState:
    """The vision side of a proxy-mode chat model; any failure (or ``--no-vision``) leaves
    text serving, with images replaced by placeholders and a warning."""
    from app.vision.wiring import build_proxy, native_reader

    caps = chat.capabilities
    state = VisionState(mode=caps.vision_mode)
    if caps.vision_mode == "native":
        state.model, state.available, state.images = chat.name, True, native_reader(config, chat)
        return state
    if caps.vision_mode != "proxy" or caps.vision_proxy is None:
        return state
    state.model = caps.vision_proxy.model
    state.proxy, state.reason = build_proxy(config, registry, load=load, chat=chat)
    state.available = state.reason is None
    if state.reason:
        log.warning("vision model %s unavailable for %s, serving text only: %s", state.model, chat.name, state.reason)
    else:
        log.info("vision model %s loaded for %s", state.model, chat.name)
    return state


# How long the shutdown waits for the MLX thread to end the requests still running.
ABORT_WAIT_S = 2.0


async def drain(state: AppState) -> None:
    """Graceful shutdown of the engines: refuse new requests (503), give running ones
    ``shutdown_grace_s`` to finish, then end the rest with an error (an error event
    when streaming), and finish the prefix caches' queued disk writes. The HTTP server
    drains its connections meanwhile. Every model drains at once, within one deadline;
    the server's signal handler and the app's shutdown both call this, and the second
    call waits for the first."""
    if state.draining is None:
        state.draining = asyncio.ensure_future(_drain(state))
    await asyncio.shield(state.draining)


async def _drain(state: AppState) -> None:
    engines = state.registry.stop_accepting()
    grace = state.config.server.shutdown_grace_s
    deadline = time.monotonic() + grace
    in_flight = lambda: sum(e.in_flight for e in engines)  # noqa: E731
    while in_flight() and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if in_flight() and state.worker.alive:
        log.warning("shutdown: ending %d requests still running after %gs", in_flight(), grace)
        exc = EngineDeadError("the server is shutting down", retry_after=10)
        await asyncio.gather(*(_abort(engine, exc) for engine in engines))
    # Prefixes queued for the prompt caches' disk tiers are written before the process ends,
    # every model's at once.
    wait = max(grace, 10.0)
    done = await asyncio.gather(*(asyncio.to_thread(engine.finish_writes, wait) for engine in engines))
    for engine, finished in zip(engines, done):
        if not finished:
            log.warning("shutdown: %s's prompt cache writes still queued after %gs were dropped", engine.name, wait)


async def _abort(engine: ModelHandle, exc: BaseException) -> None:
    try:
        await asyncio.wait_for(asyncio.wrap_future(engine.abort_all(exc)), ABORT_WAIT_S)
    except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
        # The MLX thread is inside a step (one model's, while every model waits its turn on the
        # thread): the clients hear the end now, not when the step is done.
        log.warning("shutdown: the MLX thread is busy in a step; ending %s's streams without it", engine.name)
        engine.end_streams(exc)


def openapi_config(server: ServerSettings, guards: list[Any]) -> OpenAPIConfig | None:
    """The OpenAPI schema as JSON at /docs/openapi.json (and /docs), under the API key, when
    ``server.openapi_schema`` asks for it; never a viewer page, whose scripts come from a CDN."""
    if not server.openapi_schema:
        return None
    return OpenAPIConfig(title="Tandem", version="0.1.0", render_plugins=[JsonRenderPlugin()],
                         openapi_router=Router("/docs", route_handlers=[], guards=guards, include_in_schema=False))


def create_app(state: AppState) -> Litestar:
    server = state.config.server
    guards = [api_key_guard(server)] if api_keys(server) else []
    cors = (CORSConfig(allow_origins=server.cors_origins, allow_headers=["*"], expose_headers=[WARNING_HEADER])
            if server.cors_origins else None)
    # The dashboard's request log and 15-minute samples (app/api/ui/activity.py).
    activity = Activity(lambda: state.overview())
    sampler: list[asyncio.Task[None]] = []

    async def on_startup(app: Litestar) -> None:
        app.state.tandem.registry.start()
        if server.dashboard:
            app.state.tandem.registry.add_listener(activity.on_generation)
            sampler.append(asyncio.get_running_loop().create_task(activity.run()))

    async def on_shutdown(app: Litestar) -> None:
        for task in sampler:
            task.cancel()
        await app.state.tandem.registry.stop()
        await drain(app.state.tandem)
        app.state.tandem.worker.stop()

    app = Litestar(
        # /health stays open for probes; /v1 and /metrics need the key when one is set.
        route_handlers=[
            Router("/", route_handlers=[chat_completions, completions, create_decision, create_response, get_response,
                                        list_input_items, delete_response, embeddings, rerank, agui, list_models,
                                        get_model, metrics, *ADMIN, *([dashboard_events] if server.dashboard else [])],
                   guards=guards),
            *(PAGE if server.dashboard else []),  # a static page, no data: open, as /health is
            anthropic_router(guards),  # Anthropic's error shape on its routes
            health,
            health_head,
        ],
        exception_handlers=exception_handlers(),
        middleware=[request_guard(server), *([activity.middleware] if server.dashboard else [])],
        cors_config=cors,
        request_max_body_size=server.max_body_bytes,
        request_class=BoundedRequest,  # a body's JSON values are counted before it is decoded
        openapi_config=openapi_config(server, guards),
        before_request=request_id.before_request,
        # Every response, errors and SSE included, is tagged with its request id and counted.
        before_send=[request_id.before_send, state.metrics.before_send],
        on_startup=[on_startup],
        on_shutdown=[on_shutdown],
        logging_config=None,  # the process's logging (app.cli.configure_logging) stays as it is
        debug=False,
    )
    app.state.tandem = state
    app.state.activity = activity
    app.state.event_streams = EventStreams(server)  # /ui/events, capped below max_connections
    return app
