"""Who may call, from where, with what: the checks a request passes before any route runs.

The threat model is a local server: other users of the machine, web pages in
the user's own browser, and LAN clients when bound beyond loopback.

- **Host** (DNS rebinding): a page can point its own host name at 127.0.0.1
  and then read Tandem's answers as same-origin. Bound to loopback, Tandem
  serves only loopback Host names (``localhost``, ``127.0.0.1``, ``[::1]``, any
  port) plus ``server.allowed_hosts``; anything else is a 403, as Jupyter and
  Ollama guard theirs. Bound elsewhere, ``allowed_hosts`` (when set) is the list.
- **Content-Type** (CSRF): a page may POST ``text/plain`` (or a form) without
  a CORS preflight. A POST must say JSON, or it is a 415.
- **API keys**: with keys configured, ``/v1/*`` and ``/metrics`` need one, as
  ``Authorization: Bearer <key>`` or ``x-api-key`` (Anthropic's header),
  compared in constant time. Which key was used (its name) becomes the
  request's client, which partitions the prefix and caption caches under
  ``prompt_cache_scope: per_key``.
- **Key roles**: an admin key (``server.api_key``, or a named key with ``role:
  admin``) may also use ``/v1/admin/*`` and see every key's requests on the
  dashboard; any other key gets a 403 there and sees only its own requests.
  With no key configured there are no roles: whoever passes the Host check is
  the one user, and an admin.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Awaitable, Callable
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.types import ASGIApp, Receive, Scope, Send

from app.errors import AuthenticationError, ForbiddenError, UnsupportedMediaTypeError
from app.pipeline.runtime import ServerSettings
from app.request_context import CLIENT

LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
_LOOPBACK_BINDS = frozenset({"127.0.0.1", "localhost", "::1"})


def allowed_hosts(server: ServerSettings) -> frozenset[str] | None:
    """The Host names served, lower-case and without port; None: any."""
    extra = {h.lower() for h in server.allowed_hosts}
    if server.host in _LOOPBACK_BINDS or server.host.startswith("127."):
        return LOOPBACK_HOSTS | extra
    return frozenset(extra) if extra else None


# RFC 9110's Host: a bracketed IPv6 literal or a name (letters, digits, dots, hyphens),
# then an optional port; anything else (``[::1].evil``, ``127.0.0.1:80@evil``) is no name.
_HOST = re.compile(r"(?:\[(?P<ip6>[0-9a-f:.]+)\]|(?P<name>[a-z0-9_.-]+))(?::[0-9]{1,5})?")


def _host_name(header: str) -> str | None:
    """The name in a Host header, lower-case and without its port; None if malformed."""
    m = _HOST.fullmatch(header.strip().lower())
    return None if m is None else m["ip6"] or m["name"]


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def request_guard(server: ServerSettings) -> Callable[[ASGIApp], ASGIApp]:
    """Litestar middleware: the Host and Content-Type checks. Errors raised here are
    rendered by the route's own exception handlers, in its wire format."""
    hosts = allowed_hosts(server)

    def factory(app: ASGIApp) -> ASGIApp:
        async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http":
                headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
                if hosts is not None and _host_name(headers.get("host", "")) not in hosts:
                    raise ForbiddenError(
                        "this server does not answer to that Host name (add it to server.allowed_hosts)",
                        code="host_not_allowed")
                if scope.get("method") == "POST" and not _is_json(headers.get("content-type", "")):
                    raise UnsupportedMediaTypeError("request body must be JSON: send Content-Type: application/json")
            await app(scope, receive, send)

        return guarded

    return factory


# The name of ``server.api_key``, the one key of a single-user set-up.
DEFAULT_KEY = "default"


def api_keys(server: ServerSettings) -> dict[str, bytes]:
    """Every configured key by its name (``api_key`` alone is named "default")."""
    keys = {name: entry.key.get_secret_value().encode() for name, entry in server.api_keys.items()}
    if server.api_key is not None:
        keys.setdefault(DEFAULT_KEY, server.api_key.get_secret_value().encode())
    return keys


def admin_keys(server: ServerSettings) -> frozenset[str]:
    """The names of the admin keys: ``api_key``'s and every named key with ``role: admin``."""
    admins = {name for name, entry in server.api_keys.items() if entry.role == "admin"}
    if server.api_key is not None:
        admins.add(DEFAULT_KEY)
    return frozenset(admins)


def sees_everything(server: ServerSettings) -> bool:
    """Whether this request may act as an admin: each one when no key is set (one user), else
    one that presented an admin key (read after ``api_key_guard`` has named the client)."""
    return not (server.api_key or server.api_keys) or CLIENT.get() in admin_keys(server)


async def admin_only(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """A Litestar guard for the admin routes, run after ``api_key_guard``: 403 for a key
    without the admin role."""
    server: ServerSettings = connection.app.state.tandem.settings
    if not sees_everything(server):
        raise ForbiddenError(f"the key {CLIENT.get()!r} has the role user; the admin endpoints need an admin key "
                             "(server.api_keys: {name: {key: ..., role: admin}})", code="admin_key_required")


def presented_key(connection: ASGIConnection[Any, Any, Any, Any]) -> str:
    """The key a request presents: ``Authorization: Bearer <key>``, else ``x-api-key``."""
    scheme, _, token = connection.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return connection.headers.get("x-api-key", "").strip()


def key_name(keys: dict[str, bytes], presented: str) -> str | None:
    """The name of the key presented, comparing every key in constant time."""
    found = None
    for name, key in keys.items():
        if hmac.compare_digest(presented.encode(), key):
            found = name
    return found


def api_key_guard(
    server: ServerSettings,
) -> Callable[[ASGIConnection[Any, Any, Any, Any], BaseRouteHandler], Awaitable[None]]:
    """A Litestar guard: a valid key, whose name becomes the request's client. Async, so it
    runs in the handler's context (a sync guard runs in a thread, and the name would not reach it)."""
    keys = api_keys(server)

    async def guard(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
        name = key_name(keys, presented_key(connection))
        if name is None:
            raise AuthenticationError("missing or invalid API key (Authorization: Bearer <key>, or x-api-key)",
                                      headers={"WWW-Authenticate": "Bearer"})
        CLIENT.set(name)

    return guard
