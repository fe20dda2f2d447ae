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


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png16_rgba(width: int, height: int, seed: int = 0) -> bytes:
    """A 16-bit RGBA PNG of vertical stripes: ``width * height * 8`` bytes of pixels
    in a few hundred KB (6300x6300 is ~365 KB), the red team's memory multiplier."""
    first = bytearray([0])  # filter "None", then a seed-dependent gradient
    for x in range(width):
        v = (x * 37 + seed * 101) % 65536
        first += struct.pack(">HHHH", v, 65535 - v, (v * 3) % 65536, 65535)
    same_as_above = bytes([2]) + bytes(width * 8)  # filter "Up" with zero differences
    deflate = zlib.compressobj(9)
    idat = [deflate.compress(bytes(first))]
    idat += [deflate.compress(same_as_above) for _ in range(height - 1)]
    idat.append(deflate.flush())
    ihdr = struct.pack(">IIBBBBB", width, height, 16, 6, 0, 0, 0)  # 16-bit, RGBA
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", ihdr)
        + _png_chunk(b"IDAT", b"".join(idat))
        + _png_chunk(b"IEND", b"")
    )


def png16_gray(value: int, size: tuple[int, int] = (16, 12)) -> bytes:
    """A 16-bit greyscale PNG (Pillow mode ``I;16``) of one ``value`` in 0..65535."""
    buf = BytesIO()
    Image.new("I;16", size, value).save(buf, format="PNG")
    return buf.getvalue()


def mpo_bytes(
    first: tuple[int, int, int], second: tuple[int, int, int], size: tuple[int, int] = (40, 30)
) -> bytes:
    """A two-picture MPO (a JPEG with an MP index), as iPhone HDR and 3D cameras write."""
    buf = BytesIO()
    Image.new("RGB", size, first).save(
        buf, format="MPO", save_all=True, append_images=[Image.new("RGB", size, second)]
    )
    return buf.getvalue()
