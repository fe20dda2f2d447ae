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

from litestar import Litestar, Request, Router
from litestar.config.cors import CORSConfig
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.openapi import OpenAPIConfig

from app.api.chat import ChatController
from app.api.errors import EXCEPTION_HANDLERS
from app.api.agui import agui
from app.api.meta import get_model, health, list_models
from app.api.prompting import make_profile
from app.api.state import AppState, VisionState
from app.config.loader import ResolvedConfig
from app.engine.engine import TextEngine
from app.engine.loader import load_text_model
from app.engine.worker import MLXWorker
from app.errors import AuthenticationError

log = logging.getLogger("tandem")


def build_state(config: ResolvedConfig, *, load_vision: bool = True) -> AppState:
    """Start the MLX thread, load the models, and return the shared state."""
    primary = config.primary
    log.info("model %s: EngineParams %s", primary.name, primary.params.to_log_string())
    worker = MLXWorker()
    worker.start()
    loaded = worker.submit(lambda: load_text_model(primary, primary.params)).result()
    engine = TextEngine(worker, loaded, primary.params)
    profile = make_profile(primary.name, loaded.tokenizer, primary.params, loaded.max_model_len, primary.capabilities)
    log.info("model %s: parser=%s reasoning=%s", primary.name, profile.parser, profile.reasoning)
    vision = build_vision(config, worker) if load_vision else VisionState(
        mode=primary.capabilities.vision_mode, reason="vision loading skipped"
    )
    return AppState(config=config, worker=worker, engine=engine, profile=profile, vision=vision)


def build_vision(config: ResolvedConfig, worker: MLXWorker) -> VisionState:
    """The vision side for a proxy-mode model; any failure leaves text serving."""
    from app.vision.wiring import build_proxy

    caps = config.primary.capabilities
    state = VisionState(mode=caps.vision_mode)
    if caps.vision_mode != "proxy":
        return state
    state.model = config.vision.name if config.vision else caps.vision_proxy.model
    state.proxy, state.reason = build_proxy(config, worker)
    state.available = state.reason is None
    if state.reason:
        log.warning("vision model %s unavailable, serving text only: %s", state.model, state.reason)
    else:
        log.info("vision model %s loaded", state.model)
    return state


def _api_key_guard(key: str):
    expected = key.encode()

    def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        header = connection.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), expected):
            raise AuthenticationError("missing or invalid API key (Authorization: Bearer <key>)")

    return guard


async def _drain(state: AppState, timeout: float = 30.0) -> None:
    """Graceful shutdown: refuse new work, let running streams finish, then stop MLX."""
    state.engine.stop_accepting()
    deadline = time.monotonic() + timeout
    while state.engine.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    state.worker.stop()


def create_app(state: AppState) -> Litestar:
    server = state.config.server
    guards = [_api_key_guard(server.api_key)] if server.api_key else []
    cors = CORSConfig(allow_origins=server.cors_origins, allow_headers=["*"]) if server.cors_origins else None

    async def on_shutdown(app: Litestar) -> None:
        await _drain(app.state.tandem)

    async def request_id(request: Request) -> None:
        request.state.request_id = request.headers.get("x-request-id") or f"req-{time.monotonic_ns():x}"

    app = Litestar(
        # /health stays open for probes; everything under /v1 needs the key when one is set.
        route_handlers=[Router("/", route_handlers=[ChatController, agui, list_models, get_model], guards=guards), health],
        exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
        cors_config=cors,
        request_max_body_size=server.max_body_bytes,
        openapi_config=OpenAPIConfig(title="Tandem", version="0.1.0", path="/docs"),
        before_request=request_id,
        on_shutdown=[on_shutdown],
        debug=False,
    )
    app.state.tandem = state
    return app
