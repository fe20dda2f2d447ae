"""GET /v1/models and GET /health."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from litestar import Request, Response, get
from litestar.params import FromPath

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


@get("/health", summary="Engine, model and vision status")
async def health(request: Request) -> Response:
    state: AppState = request.app.state.tandem
    stats = state.engine.stats()
    ok = stats.alive and state.worker.alive
    body = {
        "status": "ok" if ok else "unhealthy",
        "model": state.profile.name,
        "engine": {**asdict(stats), "error": repr(state.worker.dead) if state.worker.dead else None},
        "vision": _vision(state),
    }
    return Response(body, status_code=200 if ok else 503)
