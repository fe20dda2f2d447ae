"""Tandem under uvicorn, with an HTTP/1.1 protocol that idle and slow clients cannot exhaust.

uvicorn 0.54 alone counts every open socket against ``limit_concurrency``, arms
no timer before a connection's first request, and cancels its keep-alive timer
on the first byte of the next request: 256 silent sockets, or a request head
trickled a byte at a time, lock every client out with a plain-text 503 for as
long as the sockets stay open (tests/api/test_connections.py). ``GuardedH11Protocol``
is uvicorn's h11 protocol with five changes:

- A head deadline: a connection that has not sent a complete request head within
  ``server.header_timeout_s`` (from connecting, or from the first byte of its next
  request on a kept-alive connection) is closed, so slowloris holds nothing long.
- Room at the limit: when a connection would take the count past
  ``server.max_connections``, the connections idle longest (waiting for a request,
  no byte of it received: fresh or kept alive) are closed to make room, as nginx
  does. Idle sockets never starve new clients, and busy ones are never cut.
- Only when every connection is busy does a request get 503, in OpenAI's error
  shape (``too_many_connections``, with Retry-After and its request id).
- ``/health`` is answered whatever the count, so a probe sees a busy server as up.
- Nothing of a request outlives it: the protocol holds no reference cycle (which kept
  each connection's last scope, body and decoded JSON until a full collection), and
  the scope's state, where Litestar keeps the body, is emptied when the request ends.

``DrainingServer`` drains the engine while uvicorn drains its connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import logging
import math
import time
from typing import TYPE_CHECKING, Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from app.api.errors import openai_error
from app.api.request_id import HEADER, request_id
from app.errors import TooManyConnectionsError

if TYPE_CHECKING:
    from uvicorn._types import (
        ASGI3Application,
        ASGIReceiveCallable,
        ASGISendCallable,
        Scope,
    )
    from uvicorn.server import ServerState

    from app.api.state import AppState
    from app.config.schema import ServerSettings

log = logging.getLogger("tandem.http")

# The process's exit status when the MLX thread died (sysexits.h EX_SOFTWARE): a failure, so restarted.
EXIT_ENGINE_DIED = 70

# Served whatever the connection count: a probe must see a busy server as up, and it is cheap.
ALWAYS_SERVED = frozenset({"/health"})


class ServerConfig(uvicorn.Config):
    """uvicorn's Config served by ``GuardedH11Protocol``, with the limits that protocol reads."""

    def __init__(self, app: Any, *, max_connections: int, header_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(
            app,
            http=GuardedH11Protocol,
            ws="none",  # Tandem serves no WebSocket: an upgrade request is answered as plain HTTP
            limit_concurrency=None,  # counted by GuardedH11Protocol, which makes room before refusing
            **kwargs,
        )
        self.max_connections = max_connections
        self.header_timeout_s = header_timeout_s


def uvicorn_config(app: Any, server: ServerSettings, log_level: str = "info") -> ServerConfig:
    """Tandem under uvicorn: its limits, its log format, a drain as long as the grace period."""
    return ServerConfig(
        app, host=server.host, port=server.port, log_level=log_level,
        log_config=None,  # uvicorn's records (the access log too) go through our format, request id included
        max_connections=server.max_connections, header_timeout_s=server.header_timeout_s,
        backlog=server.backlog,
        # Past the grace period the engine ends what still runs; the extra seconds let those streams close.
        timeout_graceful_shutdown=math.ceil(server.shutdown_grace_s + 5),
    )


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a head deadline, idle-first room at the limit and a JSON 503."""

    def __init__(self, config: uvicorn.Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        if not isinstance(config, ServerConfig):
            raise TypeError("GuardedH11Protocol is served through app.httpserver.ServerConfig")
        super().__init__(config, server_state, app_state, _loop)  # sets self.app: see the property
        self.max_connections = config.max_connections
        self.header_timeout_s = config.header_timeout_s
        # Since when this connection waits for a request with no byte of it received; None otherwise.
        self.idle_since: float | None = None
        self._head_deadline: asyncio.TimerHandle | None = None

    # uvicorn runs ``self.app`` for each request. Handed out on each read, never stored: a bound
    # ``self._admit`` kept on ``self`` made every connection a reference cycle, which kept its last
    # request's scope (body and decoded JSON included) until a full collection, rarely run.
    @property
    def app(self) -> ASGI3Application:
        return self._admit

    @app.setter
    def app(self, app: ASGI3Application) -> None:
        self._app = app

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.idle_since = time.monotonic()
        self._arm_head_deadline()
        self._make_room()

    def data_received(self, data: bytes) -> None:
        if not self._in_request():
            self.idle_since = None  # a request head has begun: on the clock, and no longer idle
            self._arm_head_deadline()
        super().data_received(data)
        if self._in_request():
            self._cancel_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # arms uvicorn's keep-alive timer, or starts a pipelined request
        if not self._in_request() and not self.transport.is_closing() and self.conn.their_state is h11.IDLE \
                and not self.conn.trailing_data[0]:
            self.idle_since = time.monotonic()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.idle_since = None
        self._cancel_head_deadline()

    def _in_request(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _arm_head_deadline(self) -> None:
        if self._head_deadline is None:
            self._head_deadline = self.loop.call_later(
                self.header_timeout_s, self.hang_up, "no complete request head in time")

    def _cancel_head_deadline(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def hang_up(self, why: str) -> None:
        """Close the connection between requests (no response is under way on it)."""
        if self.transport.is_closing():
            return
        log.debug("closing the connection from %s: %s", self.client, why)
        with contextlib.suppress(h11.LocalProtocolError):
            self.conn.send(h11.ConnectionClosed())
        self.transport.close()

    def _open_connections(self) -> list[GuardedH11Protocol]:
        # A closed transport stays in the set until its connection_lost, a loop iteration later.
        return [c for c in self.connections if isinstance(c, GuardedH11Protocol) and not c.transport.is_closing()]

    def _make_room(self) -> int:
        """Close the connections idle longest until the count fits ``max_connections``; returns the count."""
        if len(self.connections) <= self.max_connections:  # the common case, without a pass over them
            return len(self.connections)
        open_ = self._open_connections()
        excess = len(open_) - self.max_connections
        if excess <= 0:
            return len(open_)
        idle = [c for c in open_ if c.idle_since is not None and c is not self]
        closing = heapq.nsmallest(excess, idle, key=lambda c: c.idle_since or 0.0)
        for conn in closing:
            conn.hang_up("idle at the connection limit")
        return len(open_) - len(closing)

    async def _admit(self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
        """The app, unless every connection (or as many requests) is busy; ``/health`` always."""
        if scope["type"] == "http" and scope["path"] not in ALWAYS_SERVED and (
            self._make_room() > self.max_connections or len(self.tasks) > self.max_connections
        ):
            await self._refuse(scope, send)
            return
        try:
            await self._app(scope, receive, send)
        finally:
            # The request is over: its state (Litestar keeps the body there) goes now, whatever
            # may still hold the scope (a traceback, uvicorn's last cycle on a kept-alive connection).
            scope.get("state", {}).clear()

    async def _refuse(self, scope: Scope, send: ASGISendCallable) -> None:
        rid = request_id(scope)  # first: it puts the id on this log record and on the access log's
        error = TooManyConnectionsError(
            f"all {self.max_connections} connections are busy (server.max_connections); retry shortly")
        log.warning("%s", error.message)
        body = json.dumps(openai_error(error)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close"), (HEADER.encode(), rid.encode()),
                   *((k.lower().encode(), v.encode()) for k, v in error.headers.items())]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})


class DrainingServer(uvicorn.Server):
    """On SIGTERM/SIGINT the engine drains (``app.main.drain``) while uvicorn drains its connections.

    With ``server.on_engine_death: exit`` a dead MLX thread shuts the server down the same way and
    ``exit_code`` becomes ``EX_SOFTWARE`` (70): the process exits non-zero, so launchd's KeepAlive or
    systemd's ``Restart=on-failure`` starts a fresh one, which clients reach at the same address.
    """

    def __init__(self, config: uvicorn.Config, state: AppState) -> None:
        super().__init__(config)
        self.state = state
        self.exit_code = 0
        if state.config.server.on_engine_death == "exit":
            state.worker.add_death_hook(self._engine_died)

    def _engine_died(self, exc: BaseException) -> None:
        # On the dying MLX thread, after the engine has failed its requests (their streams get
        # their error event); uvicorn's main loop sees should_exit within a tick and drains.
        log.error("the MLX engine thread died (%s): draining, then exiting with status %d so the service "
                  "manager restarts Tandem (server.on_engine_death: exit)", str(exc) or type(exc).__name__,
                  EXIT_ENGINE_DIED)
        self.exit_code = EXIT_ENGINE_DIED
        self.should_exit = True

    async def shutdown(self, sockets: Any = None) -> None:
        from app.main import drain

        drained = asyncio.create_task(drain(self.state))
        await super().shutdown(sockets)
        drained.cancel()  # done by now, unless a second Ctrl-C forced the exit
