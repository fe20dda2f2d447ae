"""The disk tier's file format: one cached prefix's KV in one safetensors file, checksummed.

    <u64 little-endian header length> <JSON header, space-padded> <tensor bytes, in header order>

The header is safetensors' own (``dtype``, ``shape``, ``data_offsets`` per tensor,
string ``__metadata__``), so ``mx.load`` reads a file as it is. Tandem's metadata
says what the file holds (``format``, the model's identity, the cache key's digest,
the token count, the cache class) and carries ``crc32``: a CRC-32 of the header
without it (canonical JSON) followed by every data byte. A damaged or truncated
file fails that check, or the layout checks before it, and is never used: CRC-32
catches every burst under 32 bits and all but 1 in 4 billion other damage, at
several GB/s; the directory is the user's own, so this guards against bit rot and
torn writes, not against an attacker.

A file is written under a temporary name (``.tmp-...``), fsynced, renamed into
place and its directory fsynced: after a crash there is either the whole file
under its final name or a temporary one, which is never read. Pure Python: no
MLX here (``disk_cache`` turns arrays into buffers and back on the MLX thread).
"""

from __future__ import annotations

import json
import os
import struct
import uuid
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

FORMAT = "tandem-kv/1"
TMP_PREFIX = ".tmp-"
# safetensors dtype names -> bytes per element.
ITEM_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4,
              "F32": 4, "I64": 8, "U64": 8, "F64": 8}
# A header larger than this is damage, not a prefix cache (ours are a few KB).
MAX_HEADER_BYTES = 16 * 1024 * 1024


class DamagedFileError(Exception):
    """A file that is not a whole, intact Tandem KV file; the message says why."""


@dataclass(frozen=True)
class Tensor:
    """One tensor's bytes, C-contiguous, in safetensors' terms."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: memoryview


def _canonical(header: dict) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode()


def _header(meta: dict[str, str], tensors: Sequence[Tensor]) -> dict:
    header: dict = {"__metadata__": dict(meta)}
    offset = 0
    for t in tensors:
        if t.dtype not in ITEM_SIZES:
            raise ValueError(f"unknown dtype {t.dtype}")
        size = t.data.nbytes
        expected = ITEM_SIZES[t.dtype]
        for dim in t.shape:
            expected *= dim
        if size != expected:
            raise ValueError(f"tensor {t.name}: {size} bytes for shape {t.shape} {t.dtype}")
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    return header


def write_file(directory: Path, name: str, meta: dict[str, str], tensors: Sequence[Tensor]) -> int:
    """Write ``tensors`` to ``directory/name`` atomically; returns the file's size.

    Raises OSError (disk full, permissions); the temporary file is removed then.
    """
    header = _header({**meta, "format": FORMAT}, tensors)
    crc = zlib.crc32(_canonical(header))
    for t in tensors:
        crc = zlib.crc32(t.data, crc)
    header["__metadata__"]["crc32"] = f"{crc:08x}"
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
    tmp = directory / f"{TMP_PREFIX}{uuid.uuid4().hex}"
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for t in tensors:
                f.write(t.data)
            f.flush()
            os.fsync(f.fileno())
            size = f.tell()
        os.replace(tmp, directory / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(directory)
    return size


def _fsync_dir(directory: Path) -> None:
    """Make the rename itself durable (POSIX: fsync the directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the data is already synced
    finally:
        os.close(fd)


def read_file(path: Path) -> tuple[dict[str, str], dict[str, Tensor]]:
    """The metadata and tensors of an intact file.

    Raises FileNotFoundError when it is gone (evicted meanwhile), DamagedFileError when
    it is truncated, malformed or fails its checksum.
    """
    with open(path, "rb") as f:
        buf = f.read()
    if len(buf) < 8:
        raise DamagedFileError("shorter than a header")
    (n,) = struct.unpack_from("<Q", buf)
    if n > MAX_HEADER_BYTES or 8 + n > len(buf):
        raise DamagedFileError(f"header length {n} does not fit a file of {len(buf)} bytes")
    try:
        header = json.loads(bytes(buf[8 : 8 + n]))
        meta = header["__metadata__"]
        crc = meta.pop("crc32")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DamagedFileError(f"unreadable header ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DamagedFileError(f"not a {FORMAT} file")
    view = memoryview(buf)[8 + n :]
    tensors = _layout(header, view)
    check = zlib.crc32(_canonical(header))
    for t in tensors.values():
        check = zlib.crc32(t.data, check)
    if f"{check:08x}" != crc:
        raise DamagedFileError("checksum mismatch")
    return meta, tensors


def _layout(header: dict, data: memoryview) -> dict[str, Tensor]:
    """Tensors laid end to end from offset 0 to the end of the file, each the size its shape says."""
    tensors: dict[str, Tensor] = {}
    offset = 0
    try:
        entries = sorted(((k, v) for k, v in header.items() if k != "__metadata__"),
                         key=lambda kv: kv[1]["data_offsets"][0])
        for name, spec in entries:
            begin, end = spec["data_offsets"]
            shape = tuple(int(d) for d in spec["shape"])
            size = ITEM_SIZES[spec["dtype"]]
            for dim in shape:
                size *= dim
            if begin != offset or end - begin != size or any(d < 0 for d in shape):
                raise DamagedFileError(f"tensor {name}: bad layout")
            tensors[name] = Tensor(name, spec["dtype"], shape, data[begin:end])
            offset = end
    except (KeyError, TypeError, ValueError) as exc:
        raise DamagedFileError(f"bad tensor table ({exc})") from exc
    if offset != len(data):
        raise DamagedFileError(f"{len(data)} data bytes, the header describes {offset}")
    return tensors
