"""The request id: one per request, made by the server, echoed as ``x-request-id``, carried by every log record.

The id is always the server's own (``req-`` and 24 hex digits): it keys the
dashboard's request rows and tags the log lines of one request, so a client must
not choose it (one that sent another request's id overwrote that request's row and
tagged its own log lines with it). A client's own id, sent as
``x-client-request-id`` (OpenAI's header) or ``x-request-id``, is recorded beside
it when it is short and plain: echoed as ``x-client-request-id`` and shown in the
dashboard's request list, so one call can be followed across a client, a proxy
and Tandem. Anything else (too long, spaces, control characters: a log-injection
vector) is dropped.

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
CLIENT_HEADER = "x-client-request-id"
_SANE = re.compile(r"[A-Za-z0-9._:+=/-]{1,128}")


def request_id(scope: Any) -> str:
    """This request's id, made (and put in the log context) on first use."""
    state = scope.setdefault("state", {})
    rid = state.get("request_id")
    if rid is None:
        rid = state["request_id"] = f"req-{uuid.uuid4().hex[:24]}"
        REQUEST_ID.set(rid)
    return rid


def client_request_id(scope: Any) -> str | None:
    """The id the client sent (``x-client-request-id``, else ``x-request-id``) if short and plain, else None."""
    headers = dict(scope.get("headers", ()))
    for name in (CLIENT_HEADER, HEADER):
        sent = headers.get(name.encode())
        if sent is not None:
            text = sent.decode("latin-1")
            return text if _SANE.fullmatch(text) else None
    return None


async def before_request(request: Request) -> None:
    request_id(request.scope)


async def before_send(message: Any, scope: Any) -> None:
    if message["type"] == "http.response.start":
        headers = [*message.get("headers", ()), (HEADER.encode(), request_id(scope).encode())]
        if (sent := client_request_id(scope)) is not None:
            headers.append((CLIENT_HEADER.encode(), sent.encode()))
        message["headers"] = headers
