"""create_app(config) -> Litestar: the one place where the parts are wired together.

``build_state`` starts the MLX-owner thread and loads the chat model on it
(and the vision model, whose failure is logged and reported, never fatal);
``create_app`` puts routes, error handlers, auth, CORS and limits around it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable

from litestar import Litestar, Router
from litestar.config.cors import CORSConfig
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.openapi import OpenAPIConfig

from app.api import request_id
from app.api.agui import agui
from app.api.errors import exception_handlers
from app.api.meta import get_model, health, list_models
from app.api.metrics import metrics
from app.api.openai.chat import chat_completions
from app.api.openai.completions import completions
from app.api.state import AppState
from app.config.loader import ResolvedConfig
from app.config.mapping import engine_params, load_params, model_source
from app.engine.engine import TextEngine
from app.engine.loader import load_text_model
from app.engine.worker import MLXWorker
from app.errors import AuthenticationError, EngineDeadError
from app.pipeline.pipeline import Pipeline, ServedModel, VisionState, log_generation
from app.pipeline.prompting import make_profile

log = logging.getLogger("tandem")


def build_state(config: ResolvedConfig, *, load_vision: bool = True) -> AppState:
    """Start the MLX thread, load the models, and return the shared state."""
    primary = config.primary
    load = load_params(primary.params)
    log.info("model %s: LoadParams %s", primary.name, load)
    worker = MLXWorker()
    worker.start()
    try:
        loaded = worker.submit(lambda: load_text_model(model_source(primary), load)).result()
    except BaseException:
        worker.stop()  # a failed load leaves no thread behind; the caller reports why
        raise
    engine = TextEngine(worker, loaded, engine_params(primary.params))
    profile = make_profile(primary.name, loaded.tokenizer, primary.params, loaded.max_model_len, primary.capabilities,
                           vocab_size=engine.vocab_size, kv_budget_tokens=engine.stats().kv_max_sequence_tokens)
    log.info("model %s: parser=%s reasoning=%s thinking_switch=%s system_prompt=%s", primary.name, profile.parser,
             profile.reasoning, profile.thinking_switch, profile.system_prompt)
    vision = build_vision(config, worker, load=load_vision)
    served = ServedModel(profile, engine, vision, aliases=(primary.hf_id,) if primary.hf_id else ())
    state = AppState(config, worker, engine, profile, vision, Pipeline([served], config.server))
    engine.add_listener(state.metrics.on_generation)
    engine.add_listener(log_generation)
    state.metrics.watch(lambda: state)
    return state


def build_vision(config: ResolvedConfig, worker: MLXWorker, *, load: bool = True) -> VisionState:
    """The vision side for a proxy-mode model; any failure (or ``--no-vision``) leaves
    text serving, with images replaced by placeholders and a warning."""
    from app.vision.wiring import build_proxy

    caps = config.primary.capabilities
    state = VisionState(mode=caps.vision_mode)
    if caps.vision_mode != "proxy":
        return state
    state.model = config.vision.name if config.vision else caps.vision_proxy.model if caps.vision_proxy else None
    state.proxy, state.reason = build_proxy(config, worker, load=load)
    state.available = state.reason is None
    if state.reason:
        log.warning("vision model %s unavailable, serving text only: %s", state.model, state.reason)
    else:
        log.info("vision model %s loaded", state.model)
    return state


def _api_key_guard(key: str) -> Callable[[ASGIConnection, BaseRouteHandler], None]:
    expected = key.encode()

    def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        header = connection.headers.get("authorization", "")
        scheme, _sep, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise AuthenticationError(
                "missing or invalid API key (Authorization: Bearer <key>)", headers={"WWW-Authenticate": "Bearer"}
            )

    return guard


async def drain(state: AppState) -> None:
    """Graceful shutdown of the engine: refuse new requests (503), give running ones
    ``shutdown_grace_s`` to finish, then end the rest with an error (an error event
    when streaming), and finish the prefix cache's queued disk writes. The HTTP server
    drains its connections meanwhile."""
    state.engine.stop_accepting()
    grace = state.config.server.shutdown_grace_s
    deadline = time.monotonic() + grace
    while state.engine.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    if state.engine.in_flight and state.worker.alive:
        log.warning("shutdown: ending %d requests still running after %gs", state.engine.in_flight, grace)
        aborted = state.engine.abort_all(EngineDeadError("the server is shutting down", retry_after=10))
        await asyncio.wrap_future(aborted)
    # Prefixes queued for the prompt cache's disk tier are written before the process ends.
    if not await asyncio.to_thread(state.engine.close, max(grace, 10.0)):
        log.warning("shutdown: prompt cache writes still queued after %gs were dropped", max(grace, 10.0))


def create_app(state: AppState) -> Litestar:
    server = state.config.server
    guards = [_api_key_guard(server.api_key.get_secret_value())] if server.api_key else []
    cors = CORSConfig(allow_origins=server.cors_origins, allow_headers=["*"]) if server.cors_origins else None

    async def on_shutdown(app: Litestar) -> None:
        await drain(app.state.tandem)
        app.state.tandem.worker.stop()

    app = Litestar(
        # /health stays open for probes; /v1 and /metrics need the key when one is set.
        route_handlers=[
            Router("/", route_handlers=[chat_completions, completions, agui, list_models, get_model, metrics],
                   guards=guards),
            health,
        ],
        exception_handlers=exception_handlers(),
        cors_config=cors,
        request_max_body_size=server.max_body_bytes,
        openapi_config=OpenAPIConfig(title="Tandem", version="0.1.0", path="/docs"),
        before_request=request_id.before_request,
        # Every response, errors and SSE included, is tagged with its request id and counted.
        before_send=[request_id.before_send, state.metrics.before_send],
        on_shutdown=[on_shutdown],
        logging_config=None,  # the process's logging (app.cli.configure_logging) stays as it is
        debug=False,
    )
    app.state.tandem = state
    return app
