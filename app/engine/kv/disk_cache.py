"""The prefix cache's disk tier: caches that survive restarts, idle unloads and memory evictions.

    <root>/<model name>-<identity>/<key digest>-<tokens>-<token digest>.safetensors

``root`` is ``prompt_cache_disk_dir``, else ``$TANDEM_PROMPT_CACHE_DIR``, else
``<cache dir>/prompt-cache``. The identity (``kv_identity``) hashes what the KV
depends on: the weights (their files' path, size and mtime, and a sample of every
tensor), the dtypes, ``kv_cache_bits``, the file format and the mlx / mlx-lm versions;
so a file never feeds a cache to a different model or format. The key digest hashes
the prefix cache's partition (model and ``cache_namespace``), so namespaces never
share a file either.

Each file holds one sequence's cache, every layer kind (``kv_snapshot``, ``kv_layout``),
and is restored exactly where the memory tier would restore it: at its end, and at each
of its checkpoints (their positions and token digests are in its metadata: the rows of
a model with sliding windows or recurrent state keep one where each prompt and segment
ended). A file without checkpoints restores only the exact prefix it stored. The index
(``disk_index``) files every restore point under the digest of the tokens up to it, and
a lookup finds the longest one that is a prefix of the prompt, short of its last token
where a layer cannot trim (a row always feeds at least its last prompt token; where
every layer trims, the caller cuts one back). Bytes on disk stay within the
model's budget (``prompt_cache_disk_mb``): files of a key over its share
(``prompt_cache_key_share``) first, then least recently used first, files a client
pinned (a cache breakpoint) last while within ``prompt_cache_pin_share``; the model's
directories for other identities count against it too, and go first. Pins survive a
restart in ``pins.json`` beside the files (file name -> until when, wall-clock time),
which the writer thread rewrites when they change.

Threads: ``lookup`` and ``load`` run on the MLX thread (a load replaces a much
longer prefill). A load's file is read and checked on a reader thread that the MLX
thread waits for, a bounded time (``READ_TIMEOUT_S``): the file must be a regular one
(no link, no FIFO), the size its header says, hold exactly the tensors of the
model's ``KVLayout`` for its tokens and checkpoints, the identity, key and tokens asked
for, a valid checksum and finite values; a file that fails is removed, with one warning.
Only then are its bytes copied into MLX arrays on the MLX thread. ``offer`` runs there
too: it evaluates the arrays and exports their buffers without copying, and
queues them (bounded; a full queue drops the write, it never waits). One writer
thread writes, fsyncs, renames and evicts. The arrays it wrote are handed back
and dropped on the MLX thread (``collect``), so MLX memory is only ever freed
there. ``close`` finishes the queued writes (graceful shutdown, an unload).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import re
import shutil
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from app.engine.kv.disk_index import DiskEntry, DiskIndex, format_points, parse_points
from app.engine.kv.kv_files import TMP_PREFIX, DamagedFileError, Tensor, read_file, read_meta, write_file
from app.engine.kv.kv_layout import KVLayout, LayoutError
from app.engine.kv.kv_snapshot import check_finite, export_cache, restore_cache
from app.engine.kv.layers import SeqCache
from app.engine.types import CacheTierStats

log = logging.getLogger("tandem.engine")

_NAME = re.compile(r"([0-9a-f]{16})-(\d+)-([0-9a-f]{32})\.safetensors")
# Temporary files older than this are a crash's leftovers; younger ones may be another process's write.
STALE_TMP_S = 3600.0
# The pins of the directory's files, by file name (``DiskEntry.pinned_until``).
PINS_FILE = "pins.json"
# How long the MLX thread waits for a file to be read and checked: this, plus a second per 64 MiB.
# Past it (a hung filesystem), the load is a miss, and the tier is skipped until that read ends.
READ_TIMEOUT_S = 10.0

__all__ = ["DiskEntry", "DiskTier", "disk_root", "open_disk_tier"]


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _tokens_bytes(tokens: list[int]) -> bytes:
    return array("i", tokens).tobytes()


@dataclass
class _Job:
    entry: DiskEntry
    meta: dict[str, str]
    tensors: list[Tensor]
    size: int
    # The exported MLX arrays: alive until the MLX thread drops them (collect).
    arrays: list[Any] = field(default_factory=list)


class DiskTier:
    """One model's directory of cached sequences, its index, and the writer thread."""

    def __init__(self, directory: Path, budget_bytes: int, identity: str, queue_bytes: int, layout: KVLayout, *,
                 key_share: float = 1.0, pin_share: float = 0.5) -> None:
        self.dir = directory
        self.budget_bytes = budget_bytes
        self.identity = identity
        self.queue_bytes = queue_bytes
        self.layout = layout
        self._reading: Future[tuple[dict[str, Tensor], list[int]]] | None = None
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._cv = threading.Condition()
        self._index = DiskIndex(budget_bytes, key_share, pin_share)
        # Pins by file name, of files written or queued; rewritten to PINS_FILE when dirty.
        self._pins: dict[tuple[str, int, str], float] = {}
        self._pins_dirty = False
        self._queue: deque[_Job] = deque()
        self._queued_bytes = 0
        self._done: deque[_Job] = deque()
        self._closing = False
        self._unsupported_logged = False
        self._stuck_logged = False
        self.counts = CacheTierStats(budget_bytes=budget_bytes)
        self._scan()
        # The reader thread lives as long as the tier: a load never starts a thread (the MLX
        # thread would wait for it to start, and a thread's start is a moment signals and
        # asynchronous exceptions can go astray).
        self._reader = _Reader("tandem-kv-reader")
        self._thread = threading.Thread(target=self._run, name="tandem-kv-writer", daemon=True)
        self._thread.start()

    @property
    def key_share(self) -> float:
        """The share of the budget one partition's files may hold before they go first."""
        return self._index.key_share

    # ---- the index ------------------------------------------------------------------

    def _scan(self) -> None:
        now = time.time()
        self._pins = {name: until for name, until in _read_pins(self.dir / PINS_FILE).items() if until > now}
        with os.scandir(self.dir) as found:
            items = list(found)
        for item in items:
            path = Path(item.path)
            if item.name.startswith(TMP_PREFIX):
                try:  # a write a crash cut short: never read, removed once surely abandoned
                    if now - item.stat(follow_symlinks=False).st_mtime > STALE_TMP_S:
                        _remove(path)
                except OSError:
                    pass
                continue
            match = _NAME.fullmatch(item.name)
            if match is None:
                continue
            try:
                if not item.is_file(follow_symlinks=False):
                    log.warning("prompt cache: %s is not a regular file (a link, a directory or a FIFO); "
                                "it is removed", item.name)
                    _remove(path)
                    continue
                st = item.stat(follow_symlinks=False)
            except OSError:
                continue
            n = int(match[2])
            self._index.add(DiskEntry(match[1], n, match[3], path, st.st_size, st.st_mtime, self._points(path, n),
                                      self._pins.get((match[1], n, match[3]), 0.0)))
        with self._cv:
            self._evict_over_budget()

    def _points(self, path: Path, n: int) -> dict[int, str]:
        """A stored file's checkpoints, from its header. Not trusted: a load checks the whole
        file; a header unreadable now is indexed at its end only, and judged when read."""
        try:
            return parse_points(read_meta(path).get("checkpoints", ""), n)
        except (DamagedFileError, OSError):
            return {}

    def _evict_over_budget(self) -> None:
        while (victim := self._index.victim()) is not None:
            self._index.forget(victim)
            victim.path.unlink(missing_ok=True)
            self.counts.evictions += 1

    # ---- the MLX thread ---------------------------------------------------------------

    def lookup(self, key: str, tokens: list[int], longer_than: int = 0) -> tuple[DiskEntry, int] | None:
        """The file and length of the longest restore point that is a prefix of ``tokens`` in
        ``key``'s partition, longer than ``longer_than`` tokens: at most all of them where every
        layer trims (the caller cuts one back), else at most all but the last."""
        ns = _digest(key.encode())[:16]
        most = len(tokens) if self.layout.trims else len(tokens) - 1
        with self._cv:
            lengths = self._index.lengths(ns, longer_than, most)
        if not lengths:
            return None
        data = _tokens_bytes(tokens[: lengths[-1]])
        hasher = hashlib.sha256()
        done = 0
        best = None
        for n in lengths:  # one pass over the prompt: hash each stored length's prefix on the way
            hasher.update(data[done * 4 : n * 4])
            done = n
            with self._cv:
                entry = self._index.at(ns, n, hasher.copy().hexdigest()[:32])
            if entry is not None:
                best = (entry, n)
        return best

    def load(self, entry: DiskEntry, n: int, tokens: list[int]) -> SeqCache | None:
        """The cache ``entry`` holds for ``tokens[:n]`` (its end or a checkpoint), with its
        checkpoints before ``n``; None when its file is gone, fails a check (removed, with a
        warning) or takes too long to read."""
        if self._reading is not None and not self._reading.done():
            return None  # an earlier read hangs (a stuck filesystem): a miss, never a wait
        want = _tokens_bytes(tokens[:n])
        self._reading = self._reader.submit(lambda: self._read(entry, want))
        timeout = READ_TIMEOUT_S + entry.size / 2**26
        try:
            tensors, points = self._reading.result(timeout)
            cache = restore_cache(self.layout, tensors, entry.n_tokens, points, n)
        except FutureTimeout:
            if not self._stuck_logged:
                self._stuck_logged = True
                log.warning("prompt cache: reading %s takes over %.0f s; the disk tier is skipped until "
                            "it ends", entry.path, timeout)
            return None
        except FileNotFoundError:
            with self._cv:
                self._index.forget(entry)
            return None
        except (DamagedFileError, OSError, KeyError, ValueError, TypeError) as exc:
            self._discard(entry, exc)
            return None
        entry.last_used = time.time()
        try:
            os.utime(entry.path, follow_symlinks=False)  # the LRU order survives a restart
        except OSError:
            pass
        with self._cv:
            self.counts.hits += 1
            self.counts.tokens += n
        return cache

    def _read(self, entry: DiskEntry, prefix: bytes) -> tuple[dict[str, Tensor], list[int]]:
        """``entry``'s tensors and checkpoint positions, once the file proved to be what the
        index says, starting with ``prefix`` (reader thread)."""
        points: dict[int, str] = {}

        def expected(meta: dict[str, str]) -> dict[str, tuple[str, tuple[int, ...]]]:
            points.update(parse_points(meta.get("checkpoints", ""), entry.n_tokens))
            return self.layout.tensors(entry.n_tokens, sorted(points))

        meta, tensors = read_file(entry.path, expected)
        want = {"identity": self.identity, "key": entry.key, "tokens": str(entry.n_tokens),
                "digest": entry.digest, **self.layout.meta}
        wrong = [k for k, v in want.items() if meta.get(k) != v]
        if wrong:
            raise DamagedFileError(f"written for another {', '.join(wrong)}")
        stored = bytes(tensors["tokens"].data)
        if _digest(stored)[:32] != entry.digest or stored[: len(prefix)] != prefix:
            raise DamagedFileError("its tokens are not this prompt's")
        if any(_digest(stored[: p * 4])[:32] != d for p, d in points.items()):
            raise DamagedFileError("a checkpoint's tokens are not its own")
        check_finite(tensors)
        return tensors, sorted(points)

    def _discard(self, entry: DiskEntry, why: Exception) -> None:
        """Drop a file that failed a check: out of the index (no lookup finds it again) and off disk."""
        log.warning("prompt cache: ignoring damaged file %s (%s); it is removed", entry.path.name, why)
        with self._cv:
            if self._index.forget(entry):
                self.counts.damaged += 1
        _remove(entry.path)

    def pin(self, key: str, tokens: list[int], until: float) -> None:
        """Keep the file of exactly ``tokens`` (written, queued, or offered later) ahead of
        unpinned ones until ``until`` (``time.time()``)."""
        data = _tokens_bytes(tokens)
        name = (_digest(key.encode())[:16], len(tokens), _digest(data)[:32])
        with self._cv:
            self._pin(name, until)

    def _pin(self, name: tuple[str, int, str], until: float) -> None:
        if until <= self._pins.get(name, 0.0):
            return
        self._pins[name] = until
        entry = self._index.get(name)
        if entry is not None:
            entry.pinned_until = until
        self._pins_dirty = True
        self._cv.notify()

    def offer(self, key: str, tokens: list[int], cache: list[Any], pinned_until: float = 0.0) -> None:
        """Queue ``cache`` (one sequence's at exactly ``tokens``; a ``SeqCache`` with its
        checkpoints) to be written, unless it is on disk already, or the queue is full
        (dropped and counted: the MLX thread never waits); ``pinned_until``: a pin (``pin``)."""
        n = len(tokens)
        data = _tokens_bytes(tokens)
        ns, digest = _digest(key.encode())[:16], _digest(data)[:32]
        if pinned_until > 0:
            with self._cv:
                self._pin((ns, n, digest), pinned_until)
        with self._cv:
            if self._closing or (ns, n, digest) in self._index or any(
                    j.entry.name == (ns, n, digest) for j in self._queue):
                return
        try:
            exported = export_cache(self.layout, cache, n)
            tensors = [Tensor("tokens", "I32", (n,), memoryview(data).cast("B")), *exported.tensors]
            if {t.name: (t.dtype, t.shape) for t in tensors} != self.layout.tensors(n, exported.points):
                raise LayoutError(f"its tensors are not those of {self.layout}")
        except LayoutError as exc:  # it would be refused when read: the cache is not as the model's
            if not self._unsupported_logged:
                self._unsupported_logged = True
                log.info("prompt cache: a cache of this model is not written to disk: %s", exc)
            return
        points = {p: _digest(data[: p * 4])[:32] for p in exported.points}
        size = sum(t.data.nbytes for t in tensors)
        entry = DiskEntry(ns, n, digest, self.dir / f"{ns}-{n}-{digest}.safetensors", size, time.time(), points,
                          pinned_until)
        meta = {**exported.meta, "identity": self.identity, "key": ns, "tokens": str(n), "digest": digest,
                "checkpoints": format_points(points)}
        with self._cv:
            if size > self.budget_bytes or (self._queue and self._queued_bytes + size > self.queue_bytes):
                self.counts.write_drops += 1
                return
            self._queue.append(_Job(entry, meta, tensors, size, exported.arrays))
            self._queued_bytes += size
            self._cv.notify()

    def collect(self) -> None:
        """Drop the arrays of finished writes (MLX thread: only it frees MLX memory)."""
        if not self._done:
            return
        with self._cv:  # the writer hands a job over and lets go of it under this lock
            done = list(self._done)
            self._done.clear()
        del done

    # ---- the writer thread --------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing and not self._pins_dirty:
                    self._cv.wait()
                pins = self._take_pins()
            if pins is not None:
                self._write_pins(pins)
            with self._cv:
                if not self._queue:
                    if self._closing and not self._pins_dirty:
                        return
                    continue
            self._write_head()
            with self._cv:
                job = self._queue.popleft()
                self._queued_bytes -= job.size
                self._done.append(job)
                del job  # the MLX thread drops the last reference (collect)
                self._cv.notify_all()

    def _take_pins(self) -> dict[str, float] | None:
        """The pins to write, when they changed (lock held): unexpired ones, by file name."""
        if not self._pins_dirty:
            return None
        self._pins_dirty = False
        now = time.time()
        self._pins = {name: until for name, until in self._pins.items() if until > now}
        return {f"{ns}-{n}-{digest}": until for (ns, n, digest), until in self._pins.items()}

    def _write_pins(self, pins: dict[str, float]) -> None:
        """``PINS_FILE`` replaced whole (a crash leaves the old one or the new one)."""
        path = self.dir / PINS_FILE
        tmp = self.dir / f"{TMP_PREFIX}{PINS_FILE}"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(pins))
            os.replace(tmp, path)
        except OSError as exc:
            log.warning("prompt cache: could not write %s: %s", path, exc)

    def _write_head(self) -> None:
        """Write the job at the head of the queue (it stays there, referenced, meanwhile)."""
        job = self._queue[0]
        try:
            self.dir.mkdir(parents=True, exist_ok=True)  # someone may have cleared the cache meanwhile
            size = write_file(self.dir, job.entry.path.name, job.meta, job.tensors)
        except Exception as exc:  # noqa: BLE001 - a failed write is counted; the writer goes on
            log.warning("prompt cache: could not write %s: %s", job.entry.path.name, exc)
            with self._cv:
                self.counts.write_errors += 1
            return
        job.entry.size = size
        with self._cv:
            self._index.add(job.entry)
            self.counts.writes += 1
            self._evict_over_budget()

    def close(self, timeout: float = 30.0) -> bool:
        """Finish the queued writes and stop the writer; whether it finished in time."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stats(self) -> CacheTierStats:
        """A snapshot of the counters, the bytes and entries on disk, and the writes queued."""
        with self._cv:
            return replace(self.counts, bytes=self._index.bytes, entries=len(self._index), pending=len(self._queue))


def _read_pins(path: Path) -> dict[tuple[str, int, str], float]:
    """The pins ``PINS_FILE`` holds; none when it is missing or not what Tandem writes."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    pins = {}
    for name, until in raw.items() if isinstance(raw, dict) else ():
        match = re.fullmatch(r"([0-9a-f]{16})-(\d+)-([0-9a-f]{32})", str(name))
        if match is not None and isinstance(until, (int, float)):
            pins[(match[1], int(match[2]), match[3])] = float(until)
    return pins


def _remove(path: Path) -> None:
    """Remove what is at ``path``: a file, a link (not its target), a FIFO, an empty directory."""
    try:
        path.unlink()
    except (IsADirectoryError, PermissionError):  # a directory (EISDIR on Linux, EPERM on macOS)
        try:
            path.rmdir()
        except OSError:
            pass
    except OSError:
        pass


class _Reader:
    """A daemon thread that runs what it is given, one at a time (a read that may hang must not
    hold up the exit; while it hangs, the tier asks nothing more of it)."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self._jobs.put((fn, future))
        return future

    def _run(self) -> None:
        while True:
            fn, future = self._jobs.get()
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                future.set_exception(exc)


def disk_root(configured: str | None) -> Path:
    """Where disk tiers live: the configured directory, $TANDEM_PROMPT_CACHE_DIR, or the cache dir's."""
    if configured:
        return Path(configured).expanduser()
    if env := os.environ.get("TANDEM_PROMPT_CACHE_DIR"):
        return Path(env).expanduser()
    from app.engine.paths import cache_root

    return cache_root() / "prompt-cache"


def open_disk_tier(root: Path, model_name: str, identity: str, budget_bytes: int, queue_bytes: int,
                   layout: Callable[[], KVLayout], *, key_share: float = 1.0,
                   pin_share: float = 0.5) -> DiskTier | None:
    """The model's disk tier, for the caches ``layout()`` describes (``kv_layout.model_layout``);
    None, with a warning, when its directory cannot be used or its caches cannot be stored.
    ``key_share``: the share of the budget one partition may hold before its files go first;
    ``pin_share``: the share pinned files may hold ahead of the rest.

    The model's directories for other identities (older weights, other settings, perhaps
    another server's) count against its budget: beyond it they are removed, oldest first.
    """
    slug = re.sub(r"[^A-Za-z0-9._]+", "_", model_name)[:64]
    directory = root / f"{slug}-{identity}"
    try:
        shape = layout()
    except LayoutError as exc:
        log.warning("prompt cache: disk tier off for %s: its caches cannot be stored (%s)", model_name, exc)
        return None
    try:
        tier = DiskTier(directory, budget_bytes, identity, queue_bytes, shape, key_share=key_share,
                        pin_share=pin_share)
    except OSError as exc:
        log.warning("prompt cache: disk tier off, cannot use %s: %s", directory, exc)
        return None
    others = []
    for old in root.iterdir():
        if old != directory and re.fullmatch(re.escape(slug) + r"-[0-9a-f]{20}", old.name):
            try:
                files = [f.stat() for f in old.iterdir() if f.is_file()]
            except OSError:
                continue  # gone meanwhile, or not ours to read
            others.append((max((st.st_mtime for st in files), default=0.0), sum(st.st_size for st in files), old))
    total = tier.stats().bytes + sum(size for _, size, _ in others)
    for _, size, old in sorted(others):
        if total <= budget_bytes:
            break
        log.info("prompt cache: removing %s (written for other weights or settings) to stay within %d MB",
                 old, budget_bytes // 2**20)
        shutil.rmtree(old, ignore_errors=True)
        total -= size
    return tier
