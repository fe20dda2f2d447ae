"""Small images built in memory, and data URLs for them."""

from __future__ import annotations

import base64
import struct
import zlib
from io import BytesIO

from PIL import Image

PIL_FORMAT = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP", "gif": "GIF", "bmp": "BMP"}


def image_bytes(
    color: tuple[int, ...] = (255, 0, 0),
    size: tuple[int, int] = (32, 24),
    fmt: str = "png",
    mode: str = "RGB",
) -> bytes:
    """Encoded bytes of a one-colour image."""
    buf = BytesIO()
    Image.new(mode, size, color).save(buf, format=PIL_FORMAT[fmt])
    return buf.getvalue()


def striped_bytes(seed: int, size: tuple[int, int] = (96, 72)) -> bytes:
    """A PNG with a seed-dependent pattern, so two seeds give visibly different images."""
    img = Image.new("RGB", size)
    img.putdata(
        [
            ((x * 7 + seed * 53) % 256, (y * 5 + seed * 91) % 256, ((x ^ y) * seed) % 256)
            for y in range(size[1])
            for x in range(size[0])
        ]
    )
    buf = BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def png_claiming_size(width: int, height: int) -> bytes:
    """A 1x1 PNG whose header claims ``width`` x ``height``: a decode bomb in 70 bytes."""
    raw = bytearray(image_bytes(size=(1, 1)))
    ihdr = 8 + 8  # signature, then length + b"IHDR"
    raw[ihdr : ihdr + 8] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(raw[ihdr - 4 : ihdr + 13]))
    raw[ihdr + 13 : ihdr + 17] = struct.pack(">I", crc)
    return bytes(raw)
