"""Image input: turn an ``image_url`` from a chat message into checked pixels.

``load_image`` accepts three URL schemes and refuses everything else:

    data:image/png;base64,...   always on (what OpenAI clients and Open WebUI send)
    file:///abs/path.png        only under ``ImagePolicy.allowed_file_dir``
    http(s)://host/a.png        off unless ``allow_remote``; then host allow-list,
                                no private addresses, no redirects, size cap

Every failure is an ``ImageError`` (400) whose ``param`` names the part, e.g.
``messages[1].content[2].image_url``. Pillow, base64, OS and network errors are
translated here, where they enter our code.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import http.client
import ipaddress
import math
import socket
import ssl
import time
import warnings
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from urllib.parse import unquote, urlsplit

from PIL import Image, ImageOps

from app.errors import ImageError

# Pillow format names we decode; ``Image.open`` is told to try only these.
FORMATS = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp", "GIF": "gif"}
DATA_MIME_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif"}


@dataclass(frozen=True)
class ImagePolicy:
    """What image input a server accepts. Defaults are safe for a local server."""

    # 20 MB of encoded bytes per image, OpenAI's own limit.
    max_image_bytes: int = 20 * 1024 * 1024
    # Decode-bomb cap: 40 MP is above any phone camera, far below a bomb.
    max_pixels: int = 40_000_000
    # vLLM's default limit_mm_per_prompt is 1; chat UIs resend history, so allow more.
    max_images_per_request: int = 8
    # None: file:// URLs are refused. Otherwise only files under this directory.
    allowed_file_dir: Path | None = None
    # Fetching remote URLs turns the server into an HTTP client: off by default.
    allow_remote: bool = False
    # Host names (exact, or "*.example.com") remote URLs may use; empty: any host.
    remote_allow_hosts: tuple[str, ...] = field(default_factory=tuple)
    # Refuse hosts resolving to loopback/private/link-local addresses (SSRF).
    allow_private_remote: bool = False
    # Per socket operation and for the whole download.
    remote_timeout_s: float = 10.0
    # Bytes read from a remote server before giving up.
    remote_max_bytes: int = 20 * 1024 * 1024


@dataclass(frozen=True)
class LoadedImage:
    """A decoded, checked image and the hash of the bytes it came from."""

    image: Image.Image  # RGB, EXIF orientation applied
    sha256: str  # of the raw encoded bytes: the caption cache key
    format: str  # "png" | "jpeg" | "webp" | "gif"
    size: tuple[int, int]  # (width, height) in pixels
    num_bytes: int


def load_image(url: str, policy: ImagePolicy, *, param: str) -> LoadedImage:
    """Fetch, decode and check the image at ``url``; raise ``ImageError`` naming ``param``."""
    return decode_image(read_image(url, policy, param=param), policy, param=param)


def read_image(url: str, policy: ImagePolicy, *, param: str) -> bytes:
    """The encoded bytes at ``url`` (scheme rules and byte caps applied), not yet decoded."""
    if not isinstance(url, str) or not url.strip():
        raise ImageError(f"{param}: image URL must be a non-empty string", param=param)
    url = url.strip()
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        raw = _read_data_url(url, policy, param)
    elif scheme == "file":
        raw = _read_file_url(url, policy, param)
    elif scheme in ("http", "https"):
        raw = _read_remote_url(url, policy, param)
    else:
        raise ImageError(
            f"{param}: unsupported image URL scheme {scheme or '(none)'!r}; "
            "use a data: URL with base64 image bytes",
            param=param,
        )
    _check_bytes(len(raw), policy.max_image_bytes, param)
    return raw


def decode_image(raw: bytes, policy: ImagePolicy, *, param: str) -> LoadedImage:
    """Decode ``raw`` fully (so truncation is caught now) into an RGB image."""
    _check_bytes(len(raw), policy.max_image_bytes, param)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(BytesIO(raw), formats=list(FORMATS))
            _check_pixels(img.size, policy.max_pixels, param)
            img.load()
            fmt = FORMATS[img.format]
            rgb = _to_rgb(img)
    except ImageError:
        raise
    except Image.DecompressionBombError as exc:
        raise _too_many_pixels(param, policy.max_pixels) from exc
    except Image.UnidentifiedImageError as exc:
        raise ImageError(
            f"{param}: not a supported image (PNG, JPEG, WebP or GIF)", param=param
        ) from exc
    except Exception as exc:
        # Pillow's plugins raise many types on hostile bytes (OSError, SyntaxError,
        # struct.error, ...); all of them mean the client sent a broken image.
        raise ImageError(
            f"{param}: image data is truncated or corrupt ({exc})", param=param
        ) from exc
    return LoadedImage(
        image=rgb,
        sha256=hashlib.sha256(raw).hexdigest(),
        format=fmt,
        size=rgb.size,
        num_bytes=len(raw),
    )


def downscale(
    image: Image.Image, max_pixels: int | None, min_pixels: int | None = None
) -> Image.Image:
    """Resize keeping aspect ratio so width*height lies in [min_pixels, max_pixels].

    Mostly shrinks big photos before the VLM sees them (the VLM's EngineParams
    carry max_pixels/min_pixels); a tiny image is lifted to ``min_pixels``.
    Returns ``image`` itself when it already fits.
    """
    w, h = image.size
    pixels = w * h
    if max_pixels and pixels > max_pixels:
        scale = math.sqrt(max_pixels / pixels)
    elif min_pixels and pixels < min_pixels:
        scale = math.sqrt(min_pixels / pixels)
    else:
        return image
    # floor when shrinking so the result never exceeds max_pixels
    size_of = math.floor if scale < 1 else math.ceil
    new = (max(1, size_of(w * scale)), max(1, size_of(h * scale)))
    return image.resize(new, Image.Resampling.BICUBIC)


def _to_rgb(img: Image.Image) -> Image.Image:
    img = ImageOps.exif_transpose(img) or img
    if img.mode in ("RGBA", "LA") or (img.mode == "P" and "transparency" in img.info):
        # Transparent pixels become white, not the black convert("RGB") gives.
        rgba = img.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return img.convert("RGB")


def _check_bytes(n: int, limit: int, param: str) -> None:
    if n > limit:
        raise ImageError(
            f"{param}: image is {n} bytes, over the limit of {limit} bytes",
            param=param,
            code="image_too_large",
        )


def _check_pixels(size: tuple[int, int], limit: int, param: str) -> None:
    if size[0] * size[1] > limit:
        raise _too_many_pixels(param, limit, size)


def _too_many_pixels(param: str, limit: int, size: tuple[int, int] | None = None) -> ImageError:
    dims = f"{size[0]}x{size[1]} " if size else ""
    return ImageError(
        f"{param}: image {dims}has more than {limit} pixels",
        param=param,
        code="image_too_large",
    )


def _read_data_url(url: str, policy: ImagePolicy, param: str) -> bytes:
    header, sep, payload = url[5:].partition(",")
    if not sep:
        raise ImageError(f"{param}: malformed data URL (no comma)", param=param)
    mime, *options = header.split(";")
    mime = mime.strip().lower()
    if mime not in DATA_MIME_TYPES:
        raise ImageError(
            f"{param}: unsupported image type {mime or '(none)'!r}; "
            "use image/png, image/jpeg, image/webp or image/gif",
            param=param,
        )
    if "base64" not in (o.strip().lower() for o in options):
        raise ImageError(f"{param}: data URL must be base64-encoded", param=param)
    payload = "".join(payload.split())  # some clients wrap base64 lines
    # 4 base64 chars carry 3 bytes: refuse before decoding a huge payload.
    _check_bytes(len(payload) // 4 * 3, policy.max_image_bytes, param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"{param}: image data is not valid base64", param=param) from exc


def _read_file_url(url: str, policy: ImagePolicy, param: str) -> bytes:
    if policy.allowed_file_dir is None:
        raise ImageError(f"{param}: file:// image URLs are disabled", param=param)
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ImageError(f"{param}: file:// URL must name a local path", param=param)
    # One message for "outside", "missing" and "unreadable", so a client cannot
    # probe which files exist elsewhere on the machine.
    refused = ImageError(
        f"{param}: no readable image file at that path under the allowed directory",
        param=param,
    )
    try:
        root = Path(policy.allowed_file_dir).resolve()
        # resolve() follows symlinks and "..", so the check sees the real path.
        path = Path(unquote(parts.path)).resolve()
        if not (path.is_relative_to(root) and path.is_file()):
            raise refused
        _check_bytes(path.stat().st_size, policy.max_image_bytes, param)
        with path.open("rb") as f:
            return f.read(policy.max_image_bytes + 1)
    except (OSError, RuntimeError, ValueError) as exc:
        raise refused from exc


def _read_remote_url(url: str, policy: ImagePolicy, param: str) -> bytes:
    if not policy.allow_remote:
        raise ImageError(
            f"{param}: remote image URLs are disabled; send the image as a data: URL",
            param=param,
        )
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:  # a bad port or a broken [IPv6] literal
        raise ImageError(f"{param}: malformed image URL ({exc})", param=param) from exc
    host = (parts.hostname or "").lower()
    if not host or not _host_allowed(host, policy.remote_allow_hosts):
        raise ImageError(f"{param}: image host {host!r} is not allowed", param=param)
    address = _resolve_public(host, port, policy, param)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    try:
        return _fetch(parts.scheme, host, address, port, target, policy, param)
    except (OSError, http.client.HTTPException) as exc:
        raise ImageError(f"{param}: could not fetch image: {exc}", param=param) from exc


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


def _resolve_public(host: str, port: int, policy: ImagePolicy, param: str) -> str:
    """Resolve ``host`` once; refuse it if any address is private (unless allowed)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        raise ImageError(f"{param}: cannot resolve image host {host!r}", param=param) from exc
    addresses = [info[4][0] for info in infos]
    if not policy.allow_private_remote:
        for addr in addresses:
            if not ipaddress.ip_address(addr.split("%", 1)[0]).is_global:
                raise ImageError(
                    f"{param}: image host {host!r} resolves to a non-public address",
                    param=param,
                )
    # Connect to the address we checked, not a second lookup (DNS rebinding).
    return addresses[0]


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """HTTPS to a fixed IP address, with SNI and certificate checks for the host name."""

    def __init__(self, host: str, address: str, **kw) -> None:
        super().__init__(host, **kw)
        self._address = address

    def connect(self) -> None:
        sock = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


def _fetch(
    scheme: str, host: str, address: str, port: int, target: str, policy: ImagePolicy, param: str
) -> bytes:
    timeout = policy.remote_timeout_s
    if scheme == "https":
        conn: http.client.HTTPConnection = _PinnedHTTPSConnection(
            host, address, port=port, timeout=timeout, context=ssl.create_default_context()
        )
    else:
        conn = http.client.HTTPConnection(address, port, timeout=timeout)
    deadline = time.monotonic() + timeout
    try:
        name = f"[{host}]" if ":" in host else host  # IPv6 literal
        default_port = 443 if scheme == "https" else 80
        host_header = name if port == default_port else f"{name}:{port}"
        conn.request("GET", target, headers={"Host": host_header, "Accept": "image/*"})
        resp = conn.getresponse()
        if 300 <= resp.status < 400:
            raise ImageError(
                f"{param}: image URL redirects; redirects are not followed", param=param
            )
        if resp.status != 200:
            raise ImageError(f"{param}: image server answered HTTP {resp.status}", param=param)
        limit = min(policy.remote_max_bytes, policy.max_image_bytes)
        length = resp.getheader("Content-Length")
        if length and length.isdigit():
            _check_bytes(int(length), limit, param)
        chunks, total = [], 0
        while chunk := resp.read(64 * 1024):
            total += len(chunk)
            _check_bytes(total, limit, param)
            if time.monotonic() > deadline:
                raise ImageError(f"{param}: image download timed out", param=param)
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        conn.close()
