"""Remote images: one GET over asyncio streams, under one deadline.

Only when ``ImagePolicy.allow_remote``. In order:

    1. host allow-list   exact names or "*.example.com", before any lookup
    2. one DNS lookup    every address must be public: not loopback, private,
                         link-local, ..., nor an IPv6 address that carries such
                         an IPv4 (NAT64 64:ff9b::/96, 6to4 2002::/16, IPv4-mapped
                         or -compatible), unless ``allow_private_remote``
    3. one GET           HTTP/1.1 (h11) to the address checked in 2, not a second
                         lookup (DNS rebinding); TLS checked against the host
                         name; no redirects; the byte cap applied while streaming

``remote_timeout_s`` bounds 2 and 3 together, so a server that trickles a byte
at a time, in its headers or its body, is cut off there and its connection
closed. The socket work runs on the event loop, not in a thread: stuck fetches
cannot use up the loop's default thread pool (which every ``to_thread`` in the
process shares), and a cancelled request or a server shutting down ends its
fetch at once. ``getaddrinfo`` cannot be cancelled, so it runs in a daemon
thread of its own that the exit never waits for.

Network failures of every kind (refused, unreachable, timed out, TLS, not HTTP,
a name that does not resolve, a name that resolves to a non-public address) give
the client one message, so the server is no port-scan oracle and tells no one how
a name resolves from inside; the cause goes to the log. Only an address written
in the URL itself is refused by name, as that tells the caller nothing new.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import ssl
import threading
from typing import TYPE_CHECKING
from urllib.parse import quote, urlsplit

import h11

from app.errors import ImageError

if TYPE_CHECKING:
    from app.vision.images import ImagePolicy

logger = logging.getLogger("tandem.vision")

_READ_SIZE = 64 * 1024
# Status line plus headers; an image server needs far less.
_MAX_HEAD_BYTES = 16 * 1024
# Characters a request target may carry as they are; the rest is percent-encoded.
_TARGET_SAFE = "/:@!$&'()*+,;=?%~"
# The well-known NAT64 prefix carries an IPv4 address in its last 32 bits;
# the local-use one (RFC 8215) is private by definition.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
_IPV4_COMPATIBLE = ipaddress.ip_network("::/96")
# Whatever goes wrong on the network, the client reads this (see the docstring).
_NETWORK_ERRORS = (OSError, asyncio.TimeoutError, h11.ProtocolError, UnicodeError)


async def fetch_image(url: str, policy: ImagePolicy, *, param: str) -> bytes:
    """The body of a GET of ``url`` under ``policy``; ``ImageError`` naming ``param``."""
    if not policy.allow_remote:
        raise ImageError(
            f"{param}: remote image URLs are disabled; send the image as a data: URL",
            param=param,
        )
    scheme, host, port, target = _split(url, param)
    if not host or not _host_allowed(host, policy.remote_allow_hosts):
        raise ImageError(f"{param}: image host {host!r} is not allowed", param=param)
    limit = min(policy.remote_max_bytes, policy.max_image_bytes)
    get = _get(scheme, host, port, target, policy.allow_private_remote, limit, param)
    try:
        return await asyncio.wait_for(get, policy.remote_timeout_s)
    except ImageError:
        raise
    except _NETWORK_ERRORS as exc:
        logger.info("%s: fetching an image from %s failed: %r", param, host, exc)
        raise ImageError(f"{param}: could not fetch image", param=param) from exc


def is_public_address(address: str) -> bool:
    """Whether ``address`` is globally routable, counting an IPv4 carried inside IPv6."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone ("%eth0")
    if not ip.is_global:
        return False
    if isinstance(ip, ipaddress.IPv4Address):
        return True
    if ip in _NAT64_LOCAL:
        return False
    embedded = _embedded_ipv4(ip)
    return embedded is None or embedded.is_global


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address a translation or tunnel prefix routes ``ip`` to, if any."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if ip.teredo is not None:
        return ip.teredo[1]
    if ip in _NAT64 or ip in _IPV4_COMPATIBLE:
        return ipaddress.IPv4Address(int(ip) & 0xFFFF_FFFF)
    return None


def _split(url: str, param: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, request target) of an http(s) URL."""
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    except ValueError as exc:  # a bad port or a broken [IPv6] literal
        raise ImageError(f"{param}: malformed image URL ({exc})", param=param) from exc
    target = quote(parts.path or "/", safe=_TARGET_SAFE)
    if parts.query:
        target += "?" + quote(parts.query, safe=_TARGET_SAFE)
    return parts.scheme.lower(), (parts.hostname or "").lower(), port, target


def _host_allowed(host: str, allowed: tuple[str, ...] | list[str]) -> bool:
    if not allowed:
        return True
    for pattern in allowed:
        pattern = pattern.lower()
        if pattern.startswith("*.") and host.endswith(pattern[1:]):
            return True
        if host == pattern:
            return True
    return False


async def _get(
    scheme: str, host: str, port: int, target: str, allow_private: bool, limit: int, param: str
) -> bytes:
    address = await _resolve(host, port, allow_private, param)
    tls = ssl.create_default_context() if scheme == "https" else None
    reader, writer = await asyncio.open_connection(
        address, port, ssl=tls, server_hostname=host if tls else None
    )
    try:
        name = f"[{host}]" if ":" in host else host  # an IPv6 literal
        default_port = 443 if tls else 80
        host_header = name if port == default_port else f"{name}:{port}"
        return await _exchange(reader, writer, host_header, target, limit, param)
    finally:
        # No goodbye to a server that may be hostile, and nothing to await on cancel.
        writer.transport.abort()


async def _exchange(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    host_header: str,
    target: str,
    limit: int,
    param: str,
) -> bytes:
    """Send the GET, read the response; the body if it is a 200 within ``limit`` bytes."""
    conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=_MAX_HEAD_BYTES)
    headers = [
        ("Host", host_header),
        ("Accept", "image/*"),
        ("User-Agent", "Tandem"),
        ("Connection", "close"),
    ]
    writer.write(conn.send(h11.Request(method="GET", target=target, headers=headers)) or b"")
    writer.write(conn.send(h11.EndOfMessage()) or b"")
    await writer.drain()
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await reader.read(_READ_SIZE))
        elif isinstance(event, h11.Response):
            _check_response(event, limit, param)
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > limit:
                raise _too_large(limit, param)
        elif isinstance(event, h11.EndOfMessage):
            return bytes(body)
        elif isinstance(event, h11.ConnectionClosed):
            raise ConnectionError("the server closed the connection before a response")


def _check_response(response: h11.Response, limit: int, param: str) -> None:
    # The status is what any web client would see, so it is no scan oracle: say it.
    if 300 <= response.status_code < 400:
        raise ImageError(f"{param}: image URL redirects; redirects are not followed", param=param)
    if response.status_code != 200:
        raise ImageError(
            f"{param}: image server answered HTTP {response.status_code}", param=param
        )
    for name, value in response.headers:
        if name == b"content-length" and int(value) > limit:  # h11 checked it is a number
            raise _too_large(limit, param)


def _too_large(limit: int, param: str) -> ImageError:
    return ImageError(
        f"{param}: image is over the limit of {limit} bytes", param=param, code="image_too_large"
    )


async def _resolve(host: str, port: int, allow_private: bool, param: str) -> str:
    """One address for ``host``; ``ImageError`` if any of its addresses is not public."""
    try:
        addresses = [str(ipaddress.ip_address(host))]  # a literal: nothing to look up
    except ValueError:
        addresses = await _getaddrinfo(host, port)
        literal = False
    else:
        literal = True
    if not allow_private and not all(is_public_address(a) for a in addresses):
        if literal:
            raise ImageError(f"{param}: image address {host} is a non-public address", param=param)
        # The network failures' message (fetch_image): the caller learns nothing of the lookup.
        logger.info("%s: image host %s resolves to a non-public address (%s): refused", param, host,
                    ", ".join(addresses))
        raise ImageError(f"{param}: could not fetch image", param=param)
    return addresses[0]


async def _getaddrinfo(host: str, port: int) -> list[str]:
    """``socket.getaddrinfo`` in a daemon thread: cancellable here, never joined at exit."""
    loop = asyncio.get_running_loop()
    found: asyncio.Future[list[str]] = loop.create_future()

    def settle(addresses: list[str] | None, error: BaseException | None) -> None:
        if found.done():  # the fetch was cancelled or timed out meanwhile
            return
        if error is not None:
            found.set_exception(error)
        elif not addresses:
            found.set_exception(OSError(f"no address for {host!r}"))
        else:
            found.set_result(addresses)

    def lookup() -> None:
        addresses, error = None, None
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            addresses = [str(info[4][0]) for info in infos]
        except Exception as exc:  # noqa: BLE001 - handed to the waiting coroutine
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed while we looked
            loop.call_soon_threadsafe(settle, addresses, error)

    threading.Thread(target=lookup, name="tandem-image-dns", daemon=True).start()
    return await found
