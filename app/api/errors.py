"""The edge where every error becomes OpenAI's error JSON.

``AppError`` subclasses carry their own status and type. Litestar's own
exceptions (body validation, unknown route, wrong method, body too large) and
anything unexpected are mapped to the same shape, so a client always gets
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import logging
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException
from litestar.status_codes import HTTP_500_INTERNAL_SERVER_ERROR

from app.errors import AppError

log = logging.getLogger("tandem.api")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _loc_to_param(loc: Any) -> str | None:
    if not loc:
        return None
    parts = [p for p in (loc if isinstance(loc, (list, tuple)) else [loc]) if p not in ("body", "data")]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def _validation_message(exc: ValidationException) -> tuple[str, str | None]:
    extra = exc.extra if isinstance(exc.extra, list) else []
    if not extra:
        return exc.detail or "invalid request body", None
    first = extra[0] if isinstance(extra[0], dict) else {}
    key = first.get("key") or first.get("loc")
    param = _loc_to_param(key.split(".") if isinstance(key, str) else key)
    msgs = []
    for err in extra[:5]:
        if isinstance(err, dict):
            where = err.get("key") or _loc_to_param(err.get("loc"))
            msgs.append(f"{where}: {err.get('message') or err.get('msg')}" if where else str(err.get("message")))
    return "; ".join(msgs) or exc.detail, param


def app_error_handler(_: Request, exc: AppError) -> Response:
    if exc.status_code >= 500:  # a 503 (busy, shutting down) is the server working as designed
        log.log(logging.WARNING if exc.status_code == 503 else logging.ERROR, "%s: %s", type(exc).__name__, exc.message)
    return Response(exc.to_dict(), status_code=exc.status_code, headers=exc.headers)


def http_error_handler(request: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    if status == 413:
        limit = request.app.state.tandem.config.server.max_body_bytes
        message = f"request body is larger than {limit} bytes (server.max_body_bytes)"
        return Response(error_body(message, "invalid_request_error", code="request_too_large"), status_code=413)
    if isinstance(exc, ValidationException):
        message, param = _validation_message(exc)
        if "JSON" in (exc.detail or "") or "decode" in (exc.detail or "").lower():
            message = f"request body is not valid JSON: {exc.detail}"
        return Response(error_body(message, "invalid_request_error", param), status_code=400)
    headers = getattr(exc, "headers", None) or {}
    return Response(
        error_body(exc.detail, _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")),
        status_code=status,
        headers=headers,
    )


def decode_error_handler(_: Request, exc: UnicodeDecodeError) -> Response:
    return Response(error_body(f"request body is not valid UTF-8: {exc.reason}", "invalid_request_error"), status_code=400)


def internal_error_handler(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return Response(
        error_body("internal server error", "server_error"),
        status_code=HTTP_500_INTERNAL_SERVER_ERROR,
    )


EXCEPTION_HANDLERS = {
    AppError: app_error_handler,
    HTTPException: http_error_handler,
    UnicodeDecodeError: decode_error_handler,
    Exception: internal_error_handler,
}
