"""GET /v1/models, GET /v1/models/{id}, GET and HEAD /health."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from litestar import Request, Response, get, head
from litestar.params import FromPath

from app.api.guards import api_keys, key_name, presented_key
from app.api.state import AppState
from app.engine.params import ModelSpec
from app.errors import EngineDeadError


def _vision(state: AppState, name: str) -> dict[str, Any]:
    v = state.pipeline.vision(name)
    return {"mode": v.mode, "model": v.model, "available": v.available, "reason": v.reason}


def _entry(state: AppState, spec: ModelSpec) -> dict[str, Any]:
    """One model as /v1/models lists it: what is known before loading, and more once loaded."""
    loaded = state.registry.loaded(spec.name) is not None
    entry: dict[str, Any] = {"id": spec.name, "object": "model", "created": int(state.started), "owned_by": "tandem",
                             "role": spec.role, "loaded": loaded}
    if state.registry.serves(spec.name, "chat"):
        profile = state.pipeline.profile(spec.name)
        caps: dict[str, Any] = {"vision": _vision(state, spec.name)}
        if profile is not None:
            entry["max_model_len"] = profile.max_model_len
            caps.update(reasoning=profile.reasoning, tool_parser=profile.parser)
        entry["capabilities"] = caps
    else:
        engine = state.registry.loaded_encoder(spec.name)
        if engine is not None:
            entry["max_model_len"] = engine.encoder.max_length
            entry["dimensions"] = engine.encoder.dim
    return entry


@get("/v1/models", summary="List the served models")
async def list_models(request: Request[Any, Any, Any]) -> dict[str, Any]:
    state: AppState = request.app.state.tandem
    if not state.worker.alive:  # UIs poll this to decide whether the server works: it does not
        raise EngineDeadError("the engine is not running; see /health")
    # A vision entry captions for proxy-mode models and serves no API of its own.
    return {"object": "list", "data": [_entry(state, spec) for spec in state.registry.public_specs]}


@get("/v1/models/{model_id:str}", summary="Describe one model")
async def get_model(request: Request[Any, Any, Any], model_id: FromPath[str]) -> dict[str, Any]:
    state: AppState = request.app.state.tandem
    return _entry(state, state.registry.spec(model_id))


def _health(state: AppState, request: Request[Any, Any, Any]) -> tuple[dict[str, Any], int]:
    ok = state.worker.alive
    body: dict[str, Any] = {"status": "ok" if ok else "unhealthy", "model": state.default_model}
    keys = api_keys(state.config.server)
    if keys and key_name(keys, presented_key(request)) is None:
        # Open for probes, but details (paths, exception text) only for key holders.
        if not ok:
            body["reason"] = "the engine is not running"
        return body, 200 if ok else 503
    snapshot = state.registry.snapshot()
    body["default_model"] = state.default_model
    body["memory"] = {k: snapshot[k] for k in ("limit_mb", "used_mb", "free_mb", "mlx")}
    body["models"] = snapshot["models"]
    engine = state.registry.loaded_chat(state.default_model)
    stats = asdict(engine.stats()) if engine is not None else None
    body["engine"] = {**(stats or {"alive": ok}), "error": repr(state.worker.dead) if state.worker.dead else None}
    body["vision"] = _vision(state, state.default_model)
    body["distributed"] = state.distributed.health() if state.distributed is not None else None
    return body, 200 if ok else 503


@get("/health", summary="Models, memory, engine and vision status")
async def health(request: Request[Any, Any, Any]) -> Response[Any]:
    body, status = _health(request.app.state.tandem, request)
    return Response(body, status_code=status)


@head("/health", summary="Whether the engine runs (200) or not (503), without a body")
async def health_head(request: Request[Any, Any, Any]) -> Response[None]:
    _, status = _health(request.app.state.tandem, request)
    return Response(None, status_code=status)
