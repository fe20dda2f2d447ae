"""The request id, carried through async code and onto every log record.

``app/api/request_id.py`` picks the id for each HTTP request and sets
``REQUEST_ID``; the pipeline hands it to the engine with each generation, and
``RequestIdFilter`` puts it on every log record made while serving the request
("-" outside one). A record that names its request itself (``extra={"request_id":
...}``, as the engine's generation log does from the MLX thread) keeps its own.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar

REQUEST_ID: ContextVar[str] = ContextVar("tandem_request_id", default="-")
# The name of the API key the request presented ("" with no keys configured).
CLIENT: ContextVar[str] = ContextVar("tandem_client", default="")


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id`` for the log format."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get()
        return True
