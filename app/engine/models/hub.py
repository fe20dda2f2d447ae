"""Models from the Hugging Face hub into its cache, every name and hash checked: the one fetcher.

Both ``tandem pull`` (``download``, one progress bar on stderr) and the server (``local_snapshot``:
the cache first, else the same download with its progress in the log) come here, and the loaders
(mlx-lm, mlx-vlm, mlx-embeddings) are only ever handed the verified snapshot directory, so none of
them downloads by itself. The files are the ones the loader of a role fetches on first use, laid
out as ``huggingface_hub`` lays out its cache (``blobs/<hash>``, ``snapshots/<commit>/<name>``
links, ``refs/<revision>``). An interrupted download leaves ``.incomplete`` files that the next
one resumes with HTTP Range requests. ``HF_ENDPOINT`` points it at a mirror (or, in the tests, a
fake hub on loopback); ``HF_HUB_OFFLINE=1`` uses the cache only.

The hub is not trusted with paths. huggingface_hub 2.4's own ``hf_hub_download`` and
``snapshot_download`` name a blob after the ETag the server sends and write it there unchecked
(an absolute or ``../`` ETag writes outside the cache), and do not resume across runs; so this
module fetches the files itself, and takes nothing from the hub as a path before checking it: the
commit id must be 40 hex digits, each file's hash a sha256 (LFS files) or git blob id (others) in
hex, each file name a relative path that stays inside the snapshot. Every file is hashed before
it is kept; a file whose hash the hub does not give is refused.

Refusals and hub failures are one-line ``CommandError``s (the CLI prints them, exit 1 or 2); the
server's ``local_snapshot`` turns them into the model's ``ConfigError``, which fails that model's
load (503 ``model_unavailable``), not the server. No mlx import: the CLI stays light.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.engine.models.progress import LoadProgress
from app.errors import CommandError, ConfigError

log = logging.getLogger("tandem.engine")

# What mlx-lm fetches for a model (mlx_lm.utils.DEFAULT_ALLOW_PATTERNS), what mlx-vlm fetches
# (mlx_vlm.utils.get_model_path) and what mlx-embeddings fetches (mlx_embeddings.utils.get_model_path);
# tests/service/test_pull.py checks them against the installed packages.
CHAT_PATTERNS = ["*.json", "model*.safetensors", "*.py", "tokenizer.model", "*.tiktoken", "tiktoken.model",
                 "*.txt", "*.jsonl", "*.jinja"]
VISION_PATTERNS = ["*.json", "*.jsonl", "*.safetensors", "*.py", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
ENCODER_PATTERNS = ["*.json", "*.safetensors", "*.py", "*.tiktoken", "*.txt", "*.model"]

COMMIT_ID = re.compile(r"[0-9a-f]{40}")  # also a git blob id (sha1)
SHA256 = re.compile(r"[0-9a-f]{64}")
# One segment of a file name or revision: no separators, NUL or control characters; not "." or "..".
_SEGMENT = re.compile(r"(?!\.\.?$)[^/\\\x00-\x1f\x7f]+")


def allow_patterns(role: str) -> list[str]:
    """The files the server's loader needs for a model of ``role`` ("vision" for any mlx-vlm model,
    a native VLM chat model included)."""
    if role in ("embedding", "rerank"):
        return ENCODER_PATTERNS
    return VISION_PATTERNS if role == "vision" else CHAT_PATTERNS


@dataclass(frozen=True)
class HubFile:
    """One file to fetch: its name in the repo, where its bytes are, its size, and its hash (a
    sha256 for LFS files, else the git blob id): the cache's blob name, checked before it is kept."""

    name: str
    url: str
    size: int
    etag: str


def safe_relative(name: str) -> bool:
    """``name`` is a relative ``/``-separated path that stays below the folder it is joined to."""
    return bool(name) and len(name) <= 1024 and all(_SEGMENT.fullmatch(part) for part in name.split("/"))


def check_repo_id(repo_id: str, revision: str | None = None) -> None:
    """Refuse (exit 2) a repo id or revision that is not one, before it names a path or a URL."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise CommandError(f"{repo_id!r} is not a Hugging Face repo id (owner/name: letters, digits, "
                           "'-', '_' and '.')", exit_code=2) from exc
    if revision is not None and not safe_relative(revision):
        raise CommandError(f"{revision!r} is not a revision (a branch, tag or commit)", exit_code=2)


def _transport_errors() -> tuple[type[BaseException], ...]:
    # huggingface_hub 2.x talks httpx2, 1.x httpx: whichever is installed raises on no route / DNS.
    errors: list[type[BaseException]] = []
    for module in ("httpx2", "httpx"):
        with contextlib.suppress(ImportError, AttributeError):
            errors.append(importlib.import_module(module).TransportError)
    return tuple(errors)


@contextlib.contextmanager
def hub_errors(repo_id: str) -> Iterator[None]:
    """Translate huggingface_hub's and the network's errors into one line each."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = constants.ENDPOINT
    offline = (f"cannot reach the Hugging Face hub at {endpoint}{{why}}: are you offline? Run `tandem pull` "
               "again when online; it resumes where it stopped")
    try:
        yield
    except OfflineModeIsEnabled as exc:
        raise CommandError(f"offline mode is on (HF_HUB_OFFLINE=1) and {repo_id} is not fully downloaded: "
                           "unset HF_HUB_OFFLINE to pull it") from exc
    except GatedRepoError as exc:
        raise CommandError(f"{repo_id} is gated: accept its terms on {endpoint}/{repo_id}, then log in "
                           "(`hf auth login`)") from exc
    except RevisionNotFoundError as exc:
        raise CommandError(f"{repo_id} has no such revision on {endpoint}", exit_code=2) from exc
    except RepositoryNotFoundError as exc:
        raise CommandError(f"{repo_id}: no such model on {endpoint} (or it is private: `hf auth login`)",
                           exit_code=2) from exc
    except HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        raise CommandError(f"the hub at {endpoint} answered {status} for {repo_id}; try again later") from exc
    except HFValidationError as exc:  # a value huggingface_hub refuses (check_repo_id caught ours)
        raise CommandError(f"{repo_id}: {' '.join(str(exc).split())}", exit_code=2) from exc
    except LocalEntryNotFoundError as exc:  # the hub could not be reached for a file's metadata
        raise CommandError(offline.format(why="")) from exc
    except _transport_errors() as exc:
        raise CommandError(offline.format(why=f" ({exc or type(exc).__name__})")) from exc


def cached_snapshot(repo_id: str, role: str, revision: str | None = None) -> Path | None:
    """The complete cached snapshot of ``repo_id`` (what ``pull`` or the server downloaded), else None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(repo_id, revision=revision, local_files_only=True,
                                      allow_patterns=allow_patterns(role)))
    except (LocalEntryNotFoundError, HFValidationError, OSError, ValueError):  # IncompleteSnapshotError: OSError
        return None
    return path if (path / "config.json").is_file() else None


def download(repo_id: str, *, role: str = "chat", revision: str | None = None, stream: Any = None,
             mininterval: float = 0.2, progress: LoadProgress | None = None) -> Path:
    """Fetch what the loader of ``role`` needs from ``repo_id`` into the Hugging Face cache, with a
    progress bar on ``stream`` (stderr) redrawn at most every ``mininterval`` seconds (and each
    chunk's bytes told to ``progress``: the server's dashboard); returns the snapshot directory."""
    from huggingface_hub import constants

    check_repo_id(repo_id, revision)
    stream = stream or sys.stderr
    if constants.HF_HUB_OFFLINE:
        if (path := cached_snapshot(repo_id, role, revision)) is not None:
            print(f"{repo_id} is already downloaded: {path}", file=stream)
            return path
    with hub_errors(repo_id):
        commit, files = list_files(repo_id, role, revision)
        fetch(repo_id, files, stream=stream, mininterval=mininterval, progress=progress)
        return _record_snapshot(repo_id, role, revision, commit, files)


def local_snapshot(name: str, repo_id: str, role: str, progress: LoadProgress | None = None) -> Path:
    """The server's way to a hub model: the verified snapshot directory of ``repo_id`` for the
    loader of ``role``, from the cache when it is complete there, else downloaded by ``download``
    (progress in the log, a line every few seconds). Anything refused or unreachable is the
    model's ``ConfigError``: its load fails, the server keeps serving."""
    try:
        check_repo_id(repo_id)
        if (path := cached_snapshot(repo_id, role)) is not None:
            return path
        log.info("model %s: downloading %s from %s", name, repo_id, _endpoint())
        return download(repo_id, role=role, stream=_LogLines(name), mininterval=5.0, progress=progress)
    except CommandError as exc:
        raise ConfigError(f"model {name!r}: {exc.message}") from exc


def _endpoint() -> str:
    from huggingface_hub import constants

    return str(constants.ENDPOINT)


class _LogLines:
    """A text stream for ``download``'s messages and progress bar that logs each line (tqdm
    redraws with ``\\r``: each redraw is a line) instead of drawing on a terminal."""

    def __init__(self, name: str) -> None:
        self.name = name

    def write(self, text: str) -> int:
        for line in re.split(r"[\r\n]+", text):
            if line.strip():
                log.info("model %s: %s", self.name, line.strip())
        return len(text)

    def flush(self) -> None:
        pass


def list_files(repo_id: str, role: str, revision: str | None) -> tuple[str, list[HubFile]]:
    """The commit ``revision`` is now, and the files of it the loader of ``role`` needs, with
    their size and hash: all from one listing, each checked (``_hub_file``)."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.utils import filter_repo_objects

    try:
        info = HfApi().model_info(repo_id, revision=revision, files_metadata=True)
        siblings = {s.rfilename: s for s in info.siblings or []}
        if not all(isinstance(name, str) for name in siblings):
            raise TypeError("a file name that is not a string")
    except (KeyError, TypeError, AttributeError) as exc:  # huggingface_hub reads the JSON as it comes
        raise CommandError(f"the hub at {constants.ENDPOINT} answered a listing of {repo_id} that is not one "
                           f"({type(exc).__name__}: {str(exc)[:80]}): refusing it") from exc
    commit = str(info.sha)
    if not COMMIT_ID.fullmatch(commit) or (revision and COMMIT_ID.fullmatch(revision) and commit != revision):
        raise CommandError(f"the hub at {constants.ENDPOINT} named {commit[:80]!r} as the commit of {repo_id}, "
                           "which is not a commit id: refusing it")
    wanted = list(filter_repo_objects(list(siblings), allow_patterns=allow_patterns(role)))
    if not any(name.endswith(".safetensors") for name in wanted):
        raise CommandError(f"{repo_id} has no .safetensors weights for mlx to load (its files: "
                           f"{', '.join(sorted(siblings)[:8])}...)", exit_code=2)
    files = [_hub_file(repo_id, commit, siblings[name]) for name in wanted]
    # Small files first: an interrupted pull then leaves only the weights to resume.
    return commit, sorted(files, key=lambda f: (f.size, f.name))


def _hub_file(repo_id: str, commit: str, sibling: Any) -> HubFile:
    """One listed file, refused unless its name is a safe relative path and its hash can be
    checked: an LFS file's sha256, another file's git blob id."""
    from huggingface_hub import constants, hf_hub_url

    name = str(sibling.rfilename)
    refuse = f"the hub at {constants.ENDPOINT} lists {name[:120]!r} in {repo_id}"
    if not safe_relative(name):
        raise CommandError(f"{refuse}, a name that leads out of the model's folder: refusing it")
    lfs = sibling.lfs
    etag, size = (lfs.sha256, lfs.size) if lfs is not None else (sibling.blob_id, sibling.size)
    if not (SHA256 if lfs is not None else COMMIT_ID).fullmatch(str(etag)):
        kind = "an LFS file without a sha256" if lfs is not None else "without a git blob id"
        raise CommandError(f"{refuse} {kind} (it gives {str(etag)[:80]!r}): refusing a file whose checksum "
                           "cannot be checked")
    if not isinstance(size, int) or size < 0:
        raise CommandError(f"{refuse} without a size: refusing it")
    return HubFile(name, hf_hub_url(repo_id, name, revision=commit), size, str(etag))


def fetch(repo_id: str, files: Sequence[HubFile], *, stream: Any, mininterval: float = 0.2,
          progress: LoadProgress | None = None) -> None:
    """Download ``files`` into the cache's blobs under one bar, resuming partial files.

    A file goes to ``blobs/<hash>.incomplete`` (locked, so a second pull waits), is checked against
    its hash and renamed to ``blobs/<hash>``. (huggingface_hub itself downloads to a process-unique
    temporary file that the next run cannot reuse, so it does not resume.)"""
    from tqdm import tqdm

    blobs = cache_folder(repo_id) / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    todo = [f for f in files if not _complete(blobs / f.etag, f)]
    total = sum(f.size for f in files)
    if not todo:
        print(f"{repo_id}: all {len(files)} files already downloaded ({total / 2**20:.1f} MiB)", file=stream)
        return
    partial = sum(_size(blobs / f"{f.etag}.incomplete") for f in todo)
    done = total - sum(f.size for f in todo) + partial
    resumed = f", resuming at {done / 2**20:.1f} MiB" if partial else ""
    print(f"pulling {repo_id} ({len(files)} files, {total / 2**20:.1f} MiB{resumed})", file=stream, flush=True)
    with tqdm(total=total, initial=done, unit="B", unit_scale=True, unit_divisor=1024, desc=repo_id,
              file=stream, dynamic_ncols=True, mininterval=mininterval) as bar:
        advance = progress.bytes("downloading", total) if progress is not None else None
        if advance is not None:
            advance(done)  # what earlier pulls left
        meter = _Meter(bar, advance)
        for f in todo:
            _fetch_file(f, blobs, meter)


class _Meter:
    """The bar ``_fetch_file`` updates, also telling a load's ``progress`` (bytes, may be negative)."""

    def __init__(self, bar: Any, advance: Callable[[int], None] | None) -> None:
        self.bar, self.advance = bar, advance

    def update(self, n: int) -> None:
        self.bar.update(n)
        if self.advance is not None:
            self.advance(n)


def cache_folder(repo_id: str) -> Path:
    """The repo's folder in the Hugging Face cache (its documented layout: models--owner--name)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"


def _size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


def _complete(blob: Path, f: HubFile) -> bool:
    return blob.is_file() and blob.stat().st_size == f.size


def _fetch_file(f: HubFile, blobs: Path, bar: Any) -> None:
    """One file, from where its partial download stopped (HTTP Range), into ``blobs/<hash>``."""
    import fcntl

    from huggingface_hub import constants
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    blob, partial = blobs / f.etag, blobs / f"{f.etag}.incomplete"
    with open(partial, "ab") as out:
        fcntl.flock(out, fcntl.LOCK_EX)  # held until closed: a concurrent pull of this file waits here
        if _complete(blob, f):  # the other pull finished it meanwhile
            partial.unlink(missing_ok=True)
            return
        offset = os.fstat(out.fileno()).st_size
        headers = build_hf_headers()
        if offset:
            headers["Range"] = f"bytes={offset}-"
        # From the hub's own URL: its redirect to a CDN drops the token (another origin).
        with get_session().stream("GET", f.url, headers=headers, follow_redirects=True,
                                  timeout=constants.HF_HUB_DOWNLOAD_TIMEOUT) as r:
            hf_raise_for_status(r)
            if offset and r.status_code != 206:  # the server ignored the Range: start the file over
                out.truncate(0)
                bar.update(-offset)
            for chunk in r.iter_bytes(chunk_size=1 << 20):
                out.write(chunk)
                bar.update(len(chunk))
        out.flush()
        if not _matches(partial, f):
            partial.unlink()
            raise CommandError(f"{f.name} arrived corrupted (its size or checksum differs from the hub's); "
                               "run `tandem pull` again")
        partial.replace(blob)


def _matches(path: Path, f: HubFile) -> bool:
    """The file has the hub's size and hash: its sha256 (LFS) or git blob id (``_hub_file``
    admits no other kind)."""
    import hashlib

    size = path.stat().st_size
    if size != f.size:
        return False
    digest = hashlib.sha256() if len(f.etag) == 64 else hashlib.sha1(b"blob %d\0" % size)
    with open(path, "rb") as data:
        while chunk := data.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest() == f.etag


def _record_snapshot(repo_id: str, role: str, revision: str | None, commit: str, files: Sequence[HubFile]) -> Path:
    """Link the verified blobs into ``snapshots/<commit>`` and point ``refs/<revision>`` at it, as
    huggingface_hub does (its offline lookup, and mlx-lm's, then find them); only once every file
    is there, so a snapshot is never partial. Nothing the hub says is asked again here."""
    from huggingface_hub import constants

    folder = cache_folder(repo_id)
    snapshot = folder / "snapshots" / commit
    for f in files:
        pointer = snapshot / f.name  # safe_relative: below the snapshot
        pointer.parent.mkdir(parents=True, exist_ok=True)
        tmp = pointer.with_name(f".{pointer.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        os.symlink(os.path.relpath(folder / "blobs" / f.etag, pointer.parent), tmp)
        os.replace(tmp, pointer)
    revision = revision or constants.DEFAULT_REVISION
    if revision != commit:
        ref = folder / "refs" / revision  # check_repo_id: below refs
        ref.parent.mkdir(parents=True, exist_ok=True)
        tmp = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
        tmp.write_text(commit)
        os.replace(tmp, ref)
    path = cached_snapshot(repo_id, role, revision)
    if path is None:
        raise CommandError(f"{repo_id} was downloaded to {snapshot}, but it has no config.json for the loader",
                           exit_code=2)
    return path


def repo_id_like(value: str) -> bool:
    """``owner/name``, as the hub spells repo ids."""
    owner, sep, name = value.partition("/")
    return bool(sep and owner and name and "/" not in name and not os.path.isabs(value))
