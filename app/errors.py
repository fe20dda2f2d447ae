"""The one error tree of Tandem.

Code anywhere raises these; the API edge (``app.api.errors``) maps everything
else (Litestar's validation, routing and body-size errors, unexpected
exceptions) onto them too, and each wire format renders them in its own shape:
OpenAI's ``{"error": {"message", "type", "param", "code"}}``, Anthropic's
``{"type": "error", "error": {"type", "message"}}``.
Errors from MLX, Pillow, the network or the file system are translated where
they enter our code (``raise ... from exc``), never left to become a 500.

    AppError                         500 server_error
    ├── InvalidRequestError          400 invalid_request_error
    │   ├── ContextLengthError       400 code=context_length_exceeded
    │   ├── ImageError               400 code=invalid_image
    │   └── VisionNotSupportedError  400 code=vision_not_supported
    ├── AuthenticationError          401 authentication_error
    ├── ForbiddenError               403 permission_error
    ├── NotFoundError                404 not_found_error
    │   └── ModelNotFoundError       404 code=model_not_found
    ├── MethodNotAllowedError        405 invalid_request_error
    ├── ConflictError                409 invalid_request_error (a model busy, pinned or loading)
    ├── PayloadTooLargeError         413 invalid_request_error
    ├── UnsupportedMediaTypeError    415 invalid_request_error
    ├── RateLimitError               429 rate_limit_error (Retry-After)
    ├── ServiceUnavailableError      503 service_unavailable (Retry-After)
    │   ├── EngineBusyError          503 code=engine_busy
    │   ├── EngineDeadError          503 code=engine_unavailable
    │   ├── InsufficientMemoryError  503 code=insufficient_memory
    │   ├── ModelLoadError           503 code=model_unavailable
    │   ├── VisionUnavailableError   503 code=vision_unavailable
    │   └── TooManyConnectionsError  503 code=too_many_connections (rendered by app.httpserver)
    ├── ConfigError                  raised at start-up: bad models.yaml or flags
    ├── CommandError                 a local command (service, pull, ps, models) cannot do its job
    └── EngineError                  500: a failure inside one generation
"""

from __future__ import annotations


class AppError(Exception):
    """Base of every error Tandem raises on purpose."""

    status_code: int = 500
    openai_type: str = "server_error"
    default_code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.headers = dict(headers or {})


class InvalidRequestError(AppError):
    status_code = 400
    openai_type = "invalid_request_error"


class ContextLengthError(InvalidRequestError):
    default_code = "context_length_exceeded"


class ImageError(InvalidRequestError):
    """An image part that cannot be used: bad URL, bad bytes, over a cap."""

    default_code = "invalid_image"


class VisionNotSupportedError(InvalidRequestError):
    default_code = "vision_not_supported"


class AuthenticationError(AppError):
    status_code = 401
    openai_type = "authentication_error"
    default_code = "invalid_api_key"


class ForbiddenError(AppError):
    status_code = 403
    openai_type = "permission_error"


class NotFoundError(AppError):
    status_code = 404
    openai_type = "not_found_error"


class ModelNotFoundError(NotFoundError):
    default_code = "model_not_found"


class MethodNotAllowedError(AppError):
    status_code = 405
    openai_type = "invalid_request_error"
    default_code = "method_not_allowed"


class ConflictError(AppError):
    """An admin action the model's state forbids now (unloading one that is busy or pinned)."""

    status_code = 409
    openai_type = "invalid_request_error"
    default_code = "conflict"


class UnsupportedMediaTypeError(AppError):
    status_code = 415
    openai_type = "invalid_request_error"
    default_code = "unsupported_media_type"


class PayloadTooLargeError(AppError):
    status_code = 413
    openai_type = "invalid_request_error"
    default_code = "request_too_large"


class RateLimitError(AppError):
    status_code = 429
    openai_type = "rate_limit_error"
    default_code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after: int = 1, **kw) -> None:
        super().__init__(message, **kw)
        self.headers.setdefault("Retry-After", str(retry_after))


class ServiceUnavailableError(AppError):
    status_code = 503
    openai_type = "service_unavailable"

    def __init__(self, message: str, *, retry_after: int = 1, **kw) -> None:
        super().__init__(message, **kw)
        self.headers.setdefault("Retry-After", str(retry_after))


class EngineBusyError(ServiceUnavailableError):
    default_code = "engine_busy"


class EngineDeadError(ServiceUnavailableError):
    default_code = "engine_unavailable"


class InsufficientMemoryError(ServiceUnavailableError):
    """A model does not fit the memory budget, even with every idle model unloaded."""

    default_code = "insufficient_memory"


class ModelLoadError(ServiceUnavailableError):
    """A model could not be loaded (the next request tries again)."""

    default_code = "model_unavailable"


class VisionUnavailableError(ServiceUnavailableError):
    default_code = "vision_unavailable"


class TooManyConnectionsError(ServiceUnavailableError):
    """Every connection is busy; refused by the HTTP server before the app sees the request."""

    default_code = "too_many_connections"


class ConfigError(AppError):
    """models.yaml or the command line is wrong; raised before serving."""


class CommandError(AppError):
    """A local command (``tandem service``, ``pull``, ``ps``, ``models``) cannot do its job: no
    service manager, no network, no server. The CLI prints the message and exits ``exit_code``."""

    def __init__(self, message: str, *, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


class EngineError(AppError):
    """A failure inside the generation of one request."""

    default_code = "engine_error"
