"""GET / and /ui: the dashboard page; GET /ui/events: its live data; POST /v1/admin/models/*: its buttons.

The page is three static files in ``static/`` (HTML, one script, one stylesheet; no
build step, no CDN), read once and served with a strict ``Content-Security-Policy``:
scripts and styles from this server only, no inline script or style, no frames, no
form posts, fetches to this origin only. The page itself holds no data, so it needs
no key; everything it shows comes from ``/ui/events`` and the public API, which
need the key when one is set (the page asks for it and keeps it in the tab's
``sessionStorage``, sending it as ``Authorization: Bearer``; the event stream is read
with ``fetch`` rather than ``EventSource`` so the header can go with it).

The admin endpoints are POSTs with a JSON body (the request guard refuses any other
Content-Type with a 415, so a cross-site form cannot press the buttons), under the
API key like every /v1 route and, when keys are set, for admin keys only (403 for
the others); they answer with the model's new state.

What a page sees depends on its key: an admin key (or any request, when no key is
set) sees every request in the request list; another key sees its own requests
only. The models, memory and charts are the server's, the same for every key.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import Any

from litestar import Request, Response, get, post
from litestar.params import FromPath, JSONBody
from pydantic import BaseModel, ConfigDict, Field

from app.api.guards import admin_only, sees_everything
from app.api.state import AppState
from app.api.streaming import Event, EventStream, to_json
from app.api.ui.activity import Activity
from app.api.wire import JsonBool
from app.errors import NotFoundError, RateLimitError
from app.pipeline.runtime import ModelState, Overview, ServerSettings
from app.request_context import CLIENT

STATIC = Path(__file__).resolve().parent / "static"
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8"}
# Nothing from anywhere else, nothing inline; images as data: URLs (the playground's attachments).
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer",
           "X-Frame-Options": "DENY", "Cache-Control": "no-cache"}


# The page's files by name, read once: a client's name is looked up here, never given to the
# file system (a 5,000-character name made ``is_file`` raise ENAMETOOLONG: a 500).
_FILES = {p.name: (p.read_bytes(), _TYPES[p.suffix]) for p in STATIC.iterdir() if p.suffix in _TYPES}


def _asset(name: str) -> Response[bytes]:
    found = _FILES.get(name)
    if found is None:
        raise NotFoundError(f"no dashboard file {name[:64]!r}")
    body, media_type = found
    return Response(body, media_type=media_type, headers=HEADERS)


@get(["/", "/ui"], summary="The dashboard page (server.dashboard)", include_in_schema=False)
async def dashboard_page() -> Response[bytes]:
    return _asset("index.html")


@get("/ui/static/{name:str}", summary="The dashboard's script and stylesheet", include_in_schema=False)
async def dashboard_asset(name: FromPath[str]) -> Response[bytes]:
    return _asset(name)


def model_row(m: ModelState) -> dict[str, Any]:
    return asdict(m)


def overview_json(view: Overview) -> dict[str, Any]:
    return {"alive": view.alive, "default_model": view.default_model, "limit_mb": view.limit_mb,
            "used_mb": view.used_mb, "mlx": view.mlx, "models": [model_row(m) for m in view.models],
            "distributed": view.distributed}


def tick_text(sample: dict[str, Any] | None, view: Overview, activity: Activity, requests: bool,
              key: str | None) -> str:
    """A tick's JSON: the sample, the overview read with it, and the request list when asked
    (``key``'s requests; None: everyone's)."""
    tick: dict[str, Any] = {"sample": sample, "overview": overview_json(view)}
    if requests:
        tick["requests"] = activity.requests(key)
    return to_json(tick)


class EventStreams:
    """The ``/ui/events`` streams open, in all and per client, within their caps.

    A stream holds its connection for as long as the page is open: 24 of them took every
    one of ``max_connections: 24``, and chat and ``/v1/models`` were 503s while they stayed.
    So streams are capped (``server.max_event_streams`` in all, never more than half the
    connections, and ``max_event_streams_per_client``), and one past a cap is a 429.
    """

    def __init__(self, server: ServerSettings) -> None:
        self.total = min(server.max_event_streams, server.max_connections // 2)
        self.per_client = min(server.max_event_streams_per_client, self.total)
        self.open: Counter[str] = Counter()

    def take(self, client: str) -> Callable[[], None]:
        """A slot for ``client``'s stream, or a 429; returns what gives it back (at most once)."""
        if self.open[client] >= self.per_client:
            raise RateLimitError(f"{self.open[client]} dashboard event streams are open for this client, the most "
                                 f"allowed (server.max_event_streams_per_client); close one", retry_after=10)
        if self.open.total() >= self.total:
            raise RateLimitError(f"{self.total} dashboard event streams are open, the most allowed "
                                 "(server.max_event_streams, at most half of server.max_connections)", retry_after=10)
        self.open[client] += 1
        given = False

        def give_back() -> None:
            nonlocal given
            if not given:
                given = True
                self.open[client] -= 1
                if not self.open[client]:
                    del self.open[client]

        return give_back


@get("/ui/events", summary="The dashboard's live data (SSE): models, memory, speed, requests")
async def dashboard_events(request: Request[Any, Any, Any]) -> EventStream:
    state: AppState = request.app.state.tandem
    activity: Activity = request.app.state.activity
    # Whose requests this page lists: everyone's for an admin key, else its key's own.
    key = None if sees_everything(state.settings) else CLIENT.get()
    give_back = request.app.state.event_streams.take(CLIENT.get() or (request.client.host if request.client else ""))

    async def events() -> AsyncIterator[Event]:
        try:
            # First the last 15 minutes, so the charts start full; then one tick per sample.
            yield Event(to_json({"samples": list(activity.samples), "overview": overview_json(state.overview()),
                                 "requests": activity.requests(key)}), "history")
            seen = activity.version
            while not state.closing:
                sample = await activity.next_sample()
                # The request list only when it changed since this page's last tick; each
                # variant's JSON is built once per sample for all the pages open.
                changed = activity.version if activity.version != seen else None
                seen = activity.version
                if sample is None or activity.view is None:  # no sample within the timeout: read now
                    text = tick_text(sample, state.overview(), activity, changed is not None, key)
                else:
                    text = activity.once_per_sample(("tick", changed, key), partial(
                        tick_text, sample, activity.view, activity, changed is not None, key))
                yield Event(text, "tick")
        finally:
            give_back()

    stream = events()
    # A stream never started (its client gone before the first byte) runs no finally: its slot
    # comes back when the generator is collected.
    weakref.finalize(stream, give_back)
    return EventStream(stream)


class ModelAction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1, max_length=256)


class PinAction(ModelAction):
    pinned: JsonBool = True


@post("/v1/admin/models/load", status_code=200, guards=[admin_only],
      summary="Load a model now (the dashboard's Load button)")
async def admin_load(data: JSONBody[ModelAction], request: Request[Any, Any, Any]) -> dict[str, Any]:
    state: AppState = request.app.state.tandem
    return model_row(await state.load(data.model))


@post("/v1/admin/models/unload", status_code=200, guards=[admin_only],
      summary="Unload a model now; 409 while it is pinned, busy or loading")
async def admin_unload(data: JSONBody[ModelAction], request: Request[Any, Any, Any]) -> dict[str, Any]:
    state: AppState = request.app.state.tandem
    return model_row(await state.unload(data.model))


@post("/v1/admin/models/pin", status_code=200, guards=[admin_only],
      summary="Pin or unpin a model until the server restarts")
async def admin_pin(data: JSONBody[PinAction], request: Request[Any, Any, Any]) -> dict[str, Any]:
    state: AppState = request.app.state.tandem
    return model_row(state.pin(data.model, data.pinned))


ADMIN = [admin_load, admin_unload, admin_pin]
PAGE = [dashboard_page, dashboard_asset]
