"""The edge where every error becomes the wire format's error JSON.

First every exception becomes an ``AppError`` (``as_app_error``): Tandem's own
pass through; Litestar's (body validation, unknown route, wrong method, body
too large) and anything unexpected are mapped onto the tree. Then a renderer
writes it in the route's format: ``openai_error`` here, Anthropic's shape in
its own adapter. A client always gets its format's error body, and a request
whose client has gone (``ClientGone``) gets nginx's 499 and no body.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Any

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from app.api.streaming import ClientGone
from app.errors import (
    AppError,
    AuthenticationError,
    InvalidRequestError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    RateLimitError,
    ServiceUnavailableError,
    UnsupportedMediaTypeError,
)

log = logging.getLogger("tandem.api")

ErrorRenderer = Callable[[AppError], dict[str, Any]]

_BY_STATUS: dict[int, type[AppError]] = {
    400: InvalidRequestError,
    401: AuthenticationError,
    404: NotFoundError,
    405: MethodNotAllowedError,
    413: PayloadTooLargeError,
    415: UnsupportedMediaTypeError,
    429: RateLimitError,
    503: ServiceUnavailableError,
}


def openai_error(err: AppError) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": err.message, "type": err.openai_type, "param": err.param, "code": err.code}}


def _loc_to_param(loc: Any) -> str | None:
    if not loc:
        return None
    parts = [p for p in (loc if isinstance(loc, (list, tuple)) else [loc]) if p not in ("body", "data")]
    out = ""
    for p in parts:
        index = isinstance(p, int) or (isinstance(p, str) and p.isdigit())
        out += f"[{p}]" if index else (f".{p}" if out else str(p))
    return out or None


def _validation_error(exc: ValidationException) -> InvalidRequestError:
    detail = exc.detail or "invalid request body"
    if "JSON" in detail or "decode" in detail.lower() or "recursion" in detail.lower():
        return InvalidRequestError(f"request body is not valid JSON: {detail}")
    extra = exc.extra if isinstance(exc.extra, list) else []
    if not extra:
        return InvalidRequestError(detail)
    first = extra[0] if isinstance(extra[0], dict) else {}
    key = first.get("key") or first.get("loc")
    param = _loc_to_param(key.split(".") if isinstance(key, str) else key)
    msgs = []
    for err in extra[:5]:
        if isinstance(err, dict):
            loc = err.get("key") or err.get("loc")
            where = _loc_to_param(loc.split(".") if isinstance(loc, str) else loc)
            msgs.append(f"{where}: {err.get('message') or err.get('msg')}" if where else str(err.get("message")))
    return InvalidRequestError("; ".join(msgs) or detail, param=param)


def as_app_error(request: Request, exc: Exception) -> AppError:
    """Any exception as a member of the error tree."""
    if isinstance(exc, AppError):
        return exc
    if isinstance(exc, ValidationException):
        return _validation_error(exc)
    if isinstance(exc, HTTPException):
        if exc.status_code == 413:
            limit = request.app.state.tandem.settings.max_body_bytes
            return PayloadTooLargeError(f"request body is larger than {limit} bytes (server.max_body_bytes)")
        kind = _BY_STATUS.get(exc.status_code, AppError)
        err = kind(exc.detail, headers=dict(getattr(exc, "headers", None) or {}))
        err.status_code = exc.status_code
        return err
    if isinstance(exc, UnicodeDecodeError):
        return InvalidRequestError(f"request body is not valid UTF-8: {exc.reason}")
    if isinstance(exc, RecursionError):  # msgspec on '[' * 10000: nesting past what it parses
        return InvalidRequestError("request body is nested too deeply")
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return AppError("internal server error")


def error_response(err: AppError, render: ErrorRenderer = openai_error) -> Response[Any]:
    """``err`` as an HTTP response in a format's shape; 5xx are logged."""
    if err.status_code >= 500:  # a 503 (busy, shutting down) is the server working as designed
        log.log(logging.WARNING if err.status_code == 503 else logging.ERROR, "%s: %s", type(err).__name__, err.message)
    return Response(render(err), status_code=err.status_code, headers=err.headers)


def exception_handlers(render: ErrorRenderer = openai_error) -> dict[Any, Callable[..., Response[Any]]]:
    """Litestar exception handlers that answer in ``render``'s format."""

    def handle(request: Request, exc: Exception) -> Response[Any]:
        try:
            if isinstance(exc, ClientGone):
                return Response(b"", status_code=499)  # nobody is listening; nginx's "client closed request"
            return error_response(as_app_error(request, exc), render)
        finally:
            release_frames(exc)

    return {Exception: handle, HTTPException: handle}


def release_frames(exc: BaseException) -> None:
    """Drop the locals of the finished frames an answered exception passed through.

    They often hold the decoded body (a validation error's frames do, as do the errors it
    lists, whose own tracebacks lead back to them): in that reference cycle the body lives
    until a full collection, which a body of many small objects rarely sets off.
    """
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # frames still running are skipped
        stack += [e.__cause__, e.__context__]


def stream_error(exc: BaseException, render: ErrorRenderer = openai_error) -> dict[str, Any]:
    """The error event that ends a stream which had already started."""
    if isinstance(exc, AppError):
        return render(exc)
    log.error("stream failed", exc_info=exc)
    return render(AppError("internal error during generation"))
