"""GET /v1/models and GET /health."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from litestar import Request, Response, get, head
from litestar.params import FromPath

from app.api.guards import api_keys, key_name, presented_key
from app.api.state import AppState
from app.errors import EngineDeadError


def _vision(state: AppState) -> dict[str, Any]:
    v = state.vision
    return {"mode": v.mode, "model": v.model, "available": v.available, "reason": v.reason}


@get("/v1/models", summary="List the served models")
async def list_models(request: Request) -> dict[str, Any]:
    state: AppState = request.app.state.tandem
    if not state.worker.alive:  # UIs poll this to decide whether the server works: it does not
        raise EngineDeadError("the engine is not running; see /health")
    entry = {
        "id": state.profile.name,
        "object": "model",
        "created": int(state.started),
        "owned_by": "tandem",
        "max_model_len": state.profile.max_model_len,
        "capabilities": {
            "reasoning": state.profile.reasoning,
            "tool_parser": state.profile.parser,
            "vision": _vision(state),
        },
    }
    return {"object": "list", "data": [entry]}


@get("/v1/models/{model_id:str}", summary="Describe one model")
async def get_model(request: Request, model_id: FromPath[str]) -> dict[str, Any]:
    state: AppState = request.app.state.tandem
    state.pipeline.model(model_id)
    return (await list_models.fn(request))["data"][0]


def _health(state: AppState, request: Request[Any, Any, Any]) -> tuple[dict[str, Any], int]:
    stats = state.engine.stats()
    ok = stats.alive and state.worker.alive
    body: dict[str, Any] = {"status": "ok" if ok else "unhealthy", "model": state.profile.name}
    keys = api_keys(state.config.server)
    if keys and key_name(keys, presented_key(request)) is None:
        # Open for probes, but details (paths, exception text) only for key holders.
        if not ok:
            body["reason"] = "the engine is not running"
        return body, 200 if ok else 503
    body["engine"] = {**asdict(stats), "error": repr(state.worker.dead) if state.worker.dead else None}
    body["vision"] = _vision(state)
    return body, 200 if ok else 503


@get("/health", summary="Engine, model and vision status")
async def health(request: Request[Any, Any, Any]) -> Response[Any]:
    body, status = _health(request.app.state.tandem, request)
    return Response(body, status_code=status)


@head("/health", summary="Whether the engine runs (200) or not (503), without a body")
async def health_head(request: Request[Any, Any, Any]) -> Response[None]:
    _, status = _health(request.app.state.tandem, request)
    return Response(None, status_code=status)
