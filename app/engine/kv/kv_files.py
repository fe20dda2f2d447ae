"""The disk tier's file format: one cached prefix's KV in one safetensors file, checksummed.

    <u64 little-endian header length> <JSON header, space-padded> <tensor bytes, in header order>

The header is safetensors' own (``dtype``, ``shape``, ``data_offsets`` per tensor,
string ``__metadata__``), so ``mx.load`` reads a file as it is. Tandem's metadata
says what the file holds (``format``, the model's identity, the cache key's digest,
the token count, the cache class) and carries ``crc32``: a CRC-32 of the header
without it (canonical JSON) followed by every data byte. A damaged or truncated
file fails that check, or the layout checks before it, and is never used: CRC-32
catches every burst under 32 bits and all but 1 in 4 billion other damage, at
several GB/s. The CRC guards against bit rot and torn writes; against a file made
to pass it (the directory is 0700, but whoever can write there can forge one), the
reader opens only a regular file, never a link or a FIFO, checks its size against
its header before reading the data, and the caller names the tensors it must hold
(``disk_cache`` checks them against the model, and their values, before use).

A file is written under a temporary name (``.tmp-...``), fsynced, renamed into
place and its directory fsynced: after a crash there is either the whole file
under its final name or a temporary one, which is never read. Pure Python: no
MLX here (``disk_cache`` turns arrays into buffers and back on the MLX thread).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
import uuid
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from io import RawIOBase
from pathlib import Path

# Version 2: every cache kind (rotating windows, recurrent state, lists) and checkpoints; files
# of version 1 are ignored (another identity, and refused by their format).
FORMAT = "tandem-kv/2"
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


# What a file must hold: name -> (dtype, shape), or a function of its metadata that says so
# (a file's checkpoints, named in its metadata, add tensors).
Expected = dict[str, tuple[str, tuple[int, ...]]]


def read_file(path: Path, expected: Expected | Callable[[dict[str, str]], Expected] | None = None
              ) -> tuple[dict[str, str], dict[str, Tensor]]:
    """The metadata and tensors of an intact file; with ``expected`` (name -> dtype, shape, or a
    function of the file's metadata that gives them), only a file that holds exactly those tensors.

    Only a regular file is opened, never through a symbolic link, and without blocking (a FIFO
    in its place is refused, not waited on); its size must be the one its header describes, and
    its tensors the expected ones, before its data is read. Raises FileNotFoundError when it is
    gone (evicted meanwhile), DamagedFileError when it is anything else than what is asked for
    (``expected`` may raise it too, for metadata it cannot read).
    """
    with _open_regular(path) as f:
        size_on_disk = os.fstat(f.fileno()).st_size
        n, header, meta, crc = _read_header(f, size_on_disk)
        table = _table(header)
        size = table[-1][4] if table else 0
        if 8 + n + size != size_on_disk:
            raise DamagedFileError(f"{size_on_disk - 8 - n} data bytes, the header describes {size}")
        if expected is not None:
            want = expected(meta) if callable(expected) else expected
            found = {name: (dtype, shape) for name, dtype, shape, _, _ in table}
            if found != want:
                wrong = sorted(k for k in found.keys() | want.keys() if found.get(k) != want.get(k))
                raise DamagedFileError(f"not this model's KV (tensor {wrong[0]}: {found.get(wrong[0])}, "
                                       f"expected {want.get(wrong[0])})")
        data = memoryview(_read_exact(f, size))
    tensors = {name: Tensor(name, dtype, shape, data[begin:end]) for name, dtype, shape, begin, end in table}
    check = zlib.crc32(_canonical(header))
    for t in tensors.values():
        check = zlib.crc32(t.data, check)
    if f"{check:08x}" != crc:
        raise DamagedFileError("checksum mismatch")
    return meta, tensors


def read_meta(path: Path) -> dict[str, str]:
    """A file's metadata, from its header alone (what the disk tier's index needs at start-up);
    nothing in it is trusted until ``read_file`` has checked the whole file. Opened as
    ``read_file`` opens it; raises as it does."""
    with _open_regular(path) as f:
        return _read_header(f, os.fstat(f.fileno()).st_size)[2]


def _open_regular(path: Path) -> RawIOBase:
    """``path`` opened for reading only when it is a regular file: never through a symbolic link,
    never blocking (a FIFO in its place is refused, not waited on)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DamagedFileError("a symbolic link, not a file") from exc
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise DamagedFileError("not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb", buffering=0)


def _read_header(f: RawIOBase, size: int) -> tuple[int, dict, dict[str, str], str]:
    """(header length, header, metadata without its CRC, the CRC) of a Tandem KV file of ``size`` bytes."""
    if size < 8:
        raise DamagedFileError("shorter than a header")
    (n,) = struct.unpack("<Q", _read_exact(f, 8))
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise DamagedFileError(f"header length {n} does not fit a file of {size} bytes")
    try:
        header = json.loads(_read_exact(f, n))
        meta = header["__metadata__"]
        crc = meta.pop("crc32")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise DamagedFileError(f"unreadable header ({exc})") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DamagedFileError(f"not a {FORMAT} file")
    if not all(isinstance(v, str) for v in meta.values()) or not isinstance(crc, str):
        raise DamagedFileError("metadata that is not text")
    return n, header, meta, crc


def _read_exact(f: RawIOBase, size: int) -> bytes:
    """``size`` bytes from ``f`` (one read, for a regular file under 2 GB: no zero-fill, no copy);
    DamagedFileError when the file ends (or shrinks) first."""
    parts, left = [], size
    while left:
        chunk = f.read(left)
        if not chunk:
            raise DamagedFileError(f"ends after {size - left} of {size} bytes")
        parts.append(chunk)
        left -= len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)  # b"" for size 0


def _table(header: dict) -> list[tuple[str, str, tuple[int, ...], int, int]]:
    """(name, dtype, shape, begin, end) of each tensor, laid end to end from offset 0, each the
    size its shape says."""
    table = []
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
            table.append((name, spec["dtype"], shape, begin, end))
            offset = end
    except (KeyError, TypeError, ValueError) as exc:
        raise DamagedFileError(f"bad tensor table ({exc})") from exc
    return table
