"""The request id, carried through async code and onto every log record.

``app/api/request_id.py`` picks the id for each HTTP request and sets
``REQUEST_ID``; the pipeline hands it to the engine with each generation, and
``RequestIdFilter`` puts it on every log record made while serving the request
("-" outside one). A record that names its request itself (``extra={"request_id":
...}``, as the engine's generation log does from the MLX thread) keeps its own.

``NOTE`` is what serving a request learned about it for the dashboard's request log:
the HTTP layer sets a fresh ``RequestNote`` per request, and the pipeline writes the
model it resolved into it (``note_model``) wherever a request names one: chat,
embeddings, rerank and the admin buttons alike. It is a mutable object rather than a
value so that what is written below (in a handler, or a task it starts) is seen above.
"""

from __future__ import annotations

import logging
from contextvars import ContextVar
from dataclasses import dataclass

REQUEST_ID: ContextVar[str] = ContextVar("tandem_request_id", default="-")
# The name of the API key the request presented ("" with no keys configured).
CLIENT: ContextVar[str] = ContextVar("tandem_client", default="")


@dataclass
class RequestNote:
    """The model a request was served by and the input tokens an encoder counted."""

    model: str | None = None
    input_tokens: int = 0


NOTE: ContextVar[RequestNote | None] = ContextVar("tandem_request_note", default=None)


def note_model(name: str, input_tokens: int = 0) -> None:
    """Record the model serving this request (and an encoder's input tokens), if one is noted."""
    note = NOTE.get()
    if note is not None:
        note.model = name
        note.input_tokens += input_tokens


class RequestIdFilter(logging.Filter):
    """Adds ``record.request_id`` for the log format."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "request_id"):
            record.request_id = REQUEST_ID.get()
        return True
