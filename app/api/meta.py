"""GET /v1/models, GET /v1/models/{id}, GET and HEAD /health."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from litestar import Request, Response, get, head
from litestar.params import FromPath

from app.api.guards import api_keys, key_name, presented_key
from app.api.state import AppState
from app.errors import EngineDeadError
from app.pipeline.runtime import ModelReport, VisionReport


def _vision(v: VisionReport) -> dict[str, Any]:
    return {"mode": v.mode, "model": v.model, "available": v.available, "reason": v.reason}


def _entry(state: AppState, m: ModelReport) -> dict[str, Any]:
    """One model as /v1/models lists it: what is known before loading, and more once loaded."""
    entry: dict[str, Any] = {"id": m.name, "object": "model", "created": int(state.started), "owned_by": "tandem",
                             "role": m.role, "loaded": m.loaded}
    if m.max_model_len is not None:
        entry["max_model_len"] = m.max_model_len
    if m.chat:
        caps: dict[str, Any] = {"vision": _vision(m.vision) if m.vision else None}
        if m.reasoning is not None:
            caps.update(reasoning=m.reasoning, tool_parser=m.tool_parser)
        entry["capabilities"] = caps
    elif m.dimensions is not None:
        entry["dimensions"] = m.dimensions
    return entry


@get("/v1/models", summary="List the served models")
async def list_models(request: Request[Any, Any, Any]) -> dict[str, Any]:
    state: AppState = request.app.state.tandem
    if not state.alive:  # UIs poll this to decide whether the server works: it does not
        raise EngineDeadError("the engine is not running; see /health")
    return {"object": "list", "data": [_entry(state, m) for m in state.models()]}


@get("/v1/models/{model_id:str}", summary="Describe one model")
async def get_model(request: Request[Any, Any, Any], model_id: FromPath[str]) -> dict[str, Any]:
    state: AppState = request.app.state.tandem
    return _entry(state, state.model(model_id))


def _health(state: AppState, request: Request[Any, Any, Any]) -> tuple[dict[str, Any], int]:
    report = state.health()
    ok = report.alive
    body: dict[str, Any] = {"status": "ok" if ok else "unhealthy", "model": report.default_model}
    keys = api_keys(state.settings)
    if keys and key_name(keys, presented_key(request)) is None:
        # Open for probes, but details (paths, exception text) only for key holders.
        if not ok:
            body["reason"] = "the engine is not running"
        return body, 200 if ok else 503
    snapshot = report.memory
    body["default_model"] = report.default_model
    body["memory"] = {k: snapshot[k] for k in ("limit_mb", "used_mb", "free_mb", "mlx")}
    body["models"] = snapshot["models"]
    for name, family in report.families.items():
        body["models"][name]["family"] = family
    for name, drafters in report.speculation.items():
        body["models"][name]["speculation"] = {drafter: {
            "proposed": c.proposed, "accepted": c.accepted, "steps": c.steps,
            "acceptance": round(c.accepted / c.proposed, 4) if c.proposed else None} for drafter, c in drafters.items()}
    stats = asdict(report.engine) if report.engine is not None else None
    body["engine"] = {**(stats or {"alive": ok}), "error": report.error}
    body["vision"] = _vision(report.vision)
    if report.captions is not None:
        body["vision"]["caption_cache"] = report.captions
    body["distributed"] = report.distributed
    return body, 200 if ok else 503


@get("/health", summary="Models, memory, engine and vision status")
async def health(request: Request[Any, Any, Any]) -> Response[Any]:
    body, status = _health(request.app.state.tandem, request)
    return Response(body, status_code=status)


@head("/health", summary="Whether the engine runs (200) or not (503), without a body")
async def health_head(request: Request[Any, Any, Any]) -> Response[None]:
    _, status = _health(request.app.state.tandem, request)
    return Response(None, status_code=status)
