"""The request id: one per request, echoed as ``x-request-id``, carried by every log record.

A client's own ``x-request-id`` is reused when it is short and plain, so one id
can be followed across a client, a proxy and Tandem; anything else (too long,
spaces, control characters: a log-injection vector) is replaced by a fresh id.
The id is set by a ``before_request`` hook for routed requests and by the
``before_send`` hook otherwise (404s, 405s, body-too-large), which also puts it
on the response, SSE streams and errors included. A context variable makes it
visible to ``RequestIdFilter`` for every log record made while serving the
request (uvicorn's access log too: it is written from inside ``send``).
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from litestar import Request

from app.request_context import REQUEST_ID

HEADER = "x-request-id"
_SANE = re.compile(r"[A-Za-z0-9._:+=/-]{1,128}")


def request_id(scope: Any) -> str:
    """This request's id, chosen (and put in the log context) on first use."""
    state = scope.setdefault("state", {})
    rid = state.get("request_id")
    if rid is None:
        sent = next((v for k, v in scope.get("headers", ()) if k == HEADER.encode()), b"").decode("latin-1")
        rid = sent if _SANE.fullmatch(sent) else f"req-{uuid.uuid4().hex[:24]}"
        state["request_id"] = rid
        REQUEST_ID.set(rid)
    return rid


async def before_request(request: Request) -> None:
    request_id(request.scope)


async def before_send(message: Any, scope: Any) -> None:
    if message["type"] == "http.response.start":
        message["headers"] = [*message.get("headers", ()), (HEADER.encode(), request_id(scope).encode())]
