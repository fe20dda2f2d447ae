"""Image input: turn an ``image_url`` from a chat message into checked pixels.

``read_image_async`` accepts three URL schemes and refuses everything else:

    data:image/png;base64,...   always on (what OpenAI clients and Open WebUI send)
    file:///abs/path.png        only under ``ImagePolicy.allowed_file_dir``
    http(s)://host/a.png        off unless ``allow_remote``; then ``app.vision.fetch``:
                                host allow-list, no private addresses, no
                                redirects, size cap, one deadline for the fetch

``decode_image_async`` decodes PNG, JPEG (MPO too: its first picture), WebP and
GIF (the first frame) into 8-bit RGB, shrunk to the VLM's ``max_pixels`` as
early as the format allows. Decodes take turns on a small pool of their own, so
a burst of big images waits there instead of multiplying memory, and glibc is
asked to give the memory back after a big one.

Every failure is an ``ImageError`` (400) whose ``param`` names the part, e.g.
``messages[1].content[2].image_url``. Pillow, base64, OS and network errors are
translated here (and in ``fetch``), where they enter our code.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import math
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from io import BytesIO
from pathlib import Path
from urllib.parse import unquote, urlsplit

from PIL import ExifTags, Image

from app.errors import ImageError
from app.vision.fetch import fetch_image
from app.vision.memory import release_memory

# Pillow format names we decode; ``Image.open`` is told to try only these.
FORMATS = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp", "GIF": "gif"}
# Pillow's JPEG opener hands back an MPO (iPhone HDR gain-map photos, 3D cameras:
# a JPEG with more pictures after it) as format "MPO"; we read its first picture.
_FORMAT_NAMES = {**FORMATS, "MPO": "jpeg"}
DATA_MIME_TYPES = {"image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif"}
# What to keep of an image no model will look at (no VLM loaded): decoding is the check.
THUMBNAIL_PIXELS = 32 * 32
# Decodes at once. A 40 MP image is up to 160 MB while it decodes. Six 40 MP PNGs
# sent at once raised the server's peak RSS by 0.37 GB with 2 workers, 0.55 GB
# with 3 and 1.1 GB with 6 (tests/vision/test_image_soak.py).
DECODE_WORKERS = 2
# Rows converted to RGB at a time, so only the decoder's own buffer is full size.
_STRIP_ROWS = 256
# Give freed memory back to the OS after a decode of at least this many pixels.
_RELEASE_AFTER_PIXELS = 2_000_000
_decodes = ThreadPoolExecutor(max_workers=DECODE_WORKERS, thread_name_prefix="tandem-image")
# EXIF orientation -> the transpose that shows the picture upright (as ImageOps.exif_transpose).
_UPRIGHT = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


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
    # For the whole fetch: lookup, connect, TLS, headers and body together.
    remote_timeout_s: float = 10.0
    # Bytes read from a remote server before giving up.
    remote_max_bytes: int = 20 * 1024 * 1024


@dataclass(frozen=True)
class LoadedImage:
    """A decoded, checked image and the hash of the bytes it came from."""

    image: Image.Image  # 8-bit RGB, upright (EXIF orientation applied), maybe shrunk
    sha256: str  # of the raw encoded bytes: the caption cache key
    format: str  # "png" | "jpeg" | "webp" | "gif"
    size: tuple[int, int]  # (width, height) of the source picture, upright
    num_bytes: int


def load_image(
    url: str, policy: ImagePolicy, *, param: str, max_pixels: int | None = None
) -> LoadedImage:
    """Fetch, decode and check the image at ``url``; raise ``ImageError`` naming ``param``.

    Blocking, for scripts and tests; async code uses the ``_async`` functions.
    """
    raw = read_image(url, policy, param=param)
    return decode_image(raw, policy, param=param, max_pixels=max_pixels)


async def read_image_async(url: str, policy: ImagePolicy, *, param: str) -> bytes:
    """The encoded bytes at ``url`` (scheme rules and byte caps applied), not yet decoded.

    A remote fetch runs on the event loop under ``remote_timeout_s``; data: and
    file: URLs take a worker thread for moments (base64, a local read).
    """
    if _scheme(url, param) in ("http", "https"):
        raw = await fetch_image(url.strip(), policy, param=param)
    else:
        raw = await asyncio.to_thread(_read_local, url, policy, param)
    _check_bytes(len(raw), policy.max_image_bytes, param)
    return raw


def read_image(url: str, policy: ImagePolicy, *, param: str) -> bytes:
    """``read_image_async`` for code without an event loop."""
    if _scheme(url, param) in ("http", "https"):
        raw = asyncio.run(fetch_image(url.strip(), policy, param=param))
    else:
        raw = _read_local(url, policy, param)
    _check_bytes(len(raw), policy.max_image_bytes, param)
    return raw


async def decode_image_async(
    raw: bytes, policy: ImagePolicy, *, param: str, max_pixels: int | None = None
) -> LoadedImage:
    """``decode_image`` on the decode pool, ``DECODE_WORKERS`` at a time.

    Waiting here holds no thread; a request cancelled while it waits is dropped
    from the queue.
    """
    decode = partial(decode_image, raw, policy, param=param, max_pixels=max_pixels)
    return await asyncio.get_running_loop().run_in_executor(_decodes, decode)


def decode_image(
    raw: bytes, policy: ImagePolicy, *, param: str, max_pixels: int | None = None
) -> LoadedImage:
    """Decode ``raw`` fully (so truncation is caught now) into 8-bit RGB.

    With ``max_pixels`` the picture is shrunk to fit it as early as the format
    allows: a JPEG decodes at 1/2, 1/4 or 1/8 scale (draft mode); other formats
    are reduced strip by strip right after decoding, so the decoder's buffer is
    the only full-size copy. ``size`` stays the source's.
    """
    _check_bytes(len(raw), policy.max_image_bytes, param)
    decoded_pixels = 0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(BytesIO(raw), formats=list(FORMATS)) as img:
                fmt = _FORMAT_NAMES[img.format or ""]
                width, height = img.size
                _check_pixels(img.size, policy.max_pixels, param)
                target = _fit(img.size, max_pixels)
                if target and img.format in ("JPEG", "MPO"):
                    # At least twice the target, as Pillow's thumbnail(reducing_gap=2).
                    img.draft("RGB", (target[0] * 2, target[1] * 2))
                decoded_pixels = img.size[0] * img.size[1]
                img.load()
                orientation = img.getexif().get(ExifTags.Base.Orientation, 1)
                rgb = _shrink_to_rgb(img, target)
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
    finally:
        # The decoder's full-size buffer is freed by now, whether or not it decoded.
        if decoded_pixels >= _RELEASE_AFTER_PIXELS:
            release_memory()
    if orientation in _UPRIGHT:
        rgb = rgb.transpose(_UPRIGHT[orientation])
        if orientation >= 5:  # a quarter turn
            width, height = height, width
    return LoadedImage(
        image=rgb,
        sha256=hashlib.sha256(raw).hexdigest(),
        format=fmt,
        size=(width, height),
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
    new = _fit(image.size, max_pixels, min_pixels)
    return image if new is None else image.resize(new, Image.Resampling.BICUBIC)


def _fit(
    size: tuple[int, int], max_pixels: int | None, min_pixels: int | None = None
) -> tuple[int, int] | None:
    """The size that brings ``size`` within [min_pixels, max_pixels], or None if it is."""
    w, h = size
    pixels = w * h
    if max_pixels and pixels > max_pixels:
        scale = math.sqrt(max_pixels / pixels)
    elif min_pixels and pixels < min_pixels:
        scale = math.sqrt(min_pixels / pixels)
    else:
        return None
    # floor when shrinking so the result never exceeds max_pixels
    size_of = math.floor if scale < 1 else math.ceil
    return max(1, size_of(w * scale)), max(1, size_of(h * scale))


def _shrink_to_rgb(img: Image.Image, target: tuple[int, int] | None) -> Image.Image:
    """8-bit RGB at ``target`` (or full) size, converted and box-reduced a strip at a time.

    The integer reduction keeps at least twice the target, then one bicubic
    resize lands on it: Pillow's own ``reducing_gap`` recipe, without the
    full-size RGB and premultiplied-alpha copies converting the whole image costs.
    """
    w, h = img.size
    factor = 1
    if target:
        factor = max(1, min(w // (2 * target[0]), h // (2 * target[1])))
    out = Image.new("RGB", (-(-w // factor), -(-h // factor)))
    rows = factor * max(1, _STRIP_ROWS // factor)  # whole reduction blocks per strip
    for top in range(0, h, rows):
        strip = _to_rgb(img.crop((0, top, w, min(h, top + rows))))
        out.paste(strip.reduce(factor) if factor > 1 else strip, (0, top // factor))
    if target and out.size != target:
        out = out.resize(target, Image.Resampling.BICUBIC)
    return out


def _to_rgb(img: Image.Image) -> Image.Image:
    if img.mode in ("I;16", "I;16B", "I;16L", "I"):
        # 16-bit grey: scale to 8 bits; convert() would clip everything above 255 to white.
        img = img.point(lambda v: v / 256).convert("L")
    if img.mode in ("RGBA", "LA", "PA") or "transparency" in img.info:
        # Transparent pixels become white, not the black convert("RGB") gives.
        rgba = img.convert("RGBA")
        background = Image.new("RGB", rgba.size, (255, 255, 255))
        background.paste(rgba, mask=rgba.getchannel("A"))
        return background
    return img.convert("RGB")


def check_image_count(params: Sequence[str], limit: int) -> None:
    """``ImageError`` (code ``too_many_images``) naming the first image over ``limit``;
    ``params`` are the request's image parts' params, in order."""
    if len(params) > limit:
        extra = params[limit]
        raise ImageError(
            f"{extra}: this request has {len(params)} images; at most {limit} are accepted",
            param=extra,
            code="too_many_images",
        )


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


def _scheme(url: str, param: str) -> str:
    if not isinstance(url, str) or not url.strip():
        raise ImageError(f"{param}: image URL must be a non-empty string", param=param)
    head, colon, _ = url.strip().partition(":")
    scheme = head.lower() if colon else ""
    if scheme not in ("data", "file", "http", "https"):
        raise ImageError(
            f"{param}: unsupported image URL scheme {scheme or '(none)'!r}; "
            "use a data: URL with base64 image bytes",
            param=param,
        )
    return scheme


def _read_local(url: str, policy: ImagePolicy, param: str) -> bytes:
    """The bytes of a data: or file: URL."""
    url = url.strip()
    if _scheme(url, param) == "data":
        return _read_data_url(url, policy, param)
    return _read_file_url(url, policy, param)


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
