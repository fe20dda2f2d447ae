"""A Hugging Face hub on loopback, for `tandem pull` without the internet.

Serves the few endpoints ``huggingface_hub`` uses to download a model, over a real socket:

    GET  /api/models/<owner>/<name>[/revision/<rev>]     model_info (files_metadata: sizes, blob ids, LFS)
    GET  /api/models/<owner>/<name>/tree/<rev>           list_repo_tree (what snapshot_download records)
    HEAD /<owner>/<name>/resolve/<rev>/<file>            file metadata: X-Repo-Commit, ETag / X-Linked-Etag, size
    GET  /<owner>/<name>/resolve/<rev>/<file>            the bytes; `Range: bytes=N-` answers 206 (resume)

``*.safetensors`` files are LFS files (etag = sha256), the others plain git blobs (etag = git oid),
as on the real hub. ``rate`` (bytes/s) slows file bodies down so a test can interrupt a download.
Every request is recorded in ``requests`` as (method, path, Range header).

A hostile mirror, for the tests that `tandem pull` refuses it: ``etags`` replaces a file's hash
everywhere the hub names it (listing, tree, ETag headers; "" leaves it out), ``commit`` is the
commit id it answers, ``info_patch`` replaces fields of its listing, and ``add_file`` serves a
file under any name (``../../x.json``).
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class RepoFile:
    name: str
    data: bytes

    @property
    def lfs(self) -> bool:
        return self.name.endswith(".safetensors")

    @property
    def git_oid(self) -> str:
        return hashlib.sha1(b"blob %d\0" % len(self.data) + self.data).hexdigest()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_oid


@dataclass
class FakeHub:
    repos: dict[str, dict[str, RepoFile]] = field(default_factory=dict)
    rate: float | None = None  # bytes per second for file bodies; None: as fast as it goes
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)
    etags: dict[str, str] = field(default_factory=dict)  # file name -> the hash it claims instead
    commit: str = COMMIT
    info_patch: dict = field(default_factory=dict)  # merged into model_info's answer

    def add_repo(self, repo_id: str, folder: Path) -> None:
        self.repos[repo_id] = {p.name: RepoFile(p.name, p.read_bytes()) for p in sorted(folder.iterdir())
                               if p.is_file()}

    def add_file(self, repo_id: str, name: str, data: bytes) -> None:
        self.repos[repo_id][name] = RepoFile(name, data)

    def _hash(self, f: RepoFile, real: str) -> str:
        return self.etags.get(f.name, real)

    def serve(self) -> tuple[ThreadingHTTPServer, str]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                hub.handle(self, head=False)

            def do_HEAD(self) -> None:
                hub.handle(self, head=True)

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server, f"http://127.0.0.1:{server.server_address[1]}"

    # ---- routing ---------------------------------------------------------------------------

    def handle(self, h: BaseHTTPRequestHandler, *, head: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append((h.command, path, h.headers.get("Range")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 4:
            repo, kind = "/".join(parts[2:4]), (parts[4:5] or ["revision"])[0]
            if repo not in self.repos:
                return self._json(h, 404, {"error": "Repository not found"}, {"X-Error-Code": "RepoNotFound"})
            if kind == "revision":
                return self._json(h, 200, self._info(repo))
            if kind == "tree":
                return self._json(h, 200, self._tree(repo))
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, filename = "/".join(parts[:2]), "/".join(parts[4:])
            file = self.repos.get(repo, {}).get(filename)
            if file is None:
                return self._json(h, 404, {"error": "Entry not found"}, {"X-Error-Code": "EntryNotFound"})
            return self._file(h, file, head=head)
        self._json(h, 404, {"error": "not served by the fake hub"})

    def _info(self, repo: str) -> dict:
        siblings = []
        for f in self.repos[repo].values():
            entry: dict = {"rfilename": f.name, "size": len(f.data), "blobId": f.git_oid}
            if f.lfs:
                entry["lfs"] = {"sha256": self._hash(f, f.sha256), "size": len(f.data), "pointerSize": 134}
            else:
                entry["blobId"] = self._hash(f, f.git_oid)
            siblings.append({k: v for k, v in entry.items() if v != ""})
        return {"_id": repo, "id": repo, "modelId": repo, "sha": self.commit, "private": False, "gated": False,
                "disabled": False, "downloads": 0, "likes": 0, "tags": [], "library_name": "mlx",
                "lastModified": "2026-01-01T00:00:00.000Z", "siblings": siblings, **self.info_patch}

    def _tree(self, repo: str) -> list[dict]:
        out = []
        for f in self.repos[repo].values():
            entry: dict = {"type": "file", "path": f.name, "size": len(f.data), "oid": f.git_oid}
            if f.lfs:
                entry["lfs"] = {"oid": self._hash(f, f.sha256), "size": len(f.data), "pointerSize": 134}
            else:
                entry["oid"] = self._hash(f, f.git_oid)
            out.append(entry)
        return out

    @staticmethod
    def _json(h: BaseHTTPRequestHandler, status: int, body: object, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        h.send_response(status)
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), **(headers or {})}.items():
            h.send_header(k, v)
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)

    def _file(self, h: BaseHTTPRequestHandler, f: RepoFile, *, head: bool) -> None:
        size, start = len(f.data), 0
        rng = h.headers.get("Range")
        if rng and rng.startswith("bytes=") and not head:
            start = int(rng.removeprefix("bytes=").split("-")[0])
        h.send_response(206 if start else 200)
        h.send_header("Content-Length", str(size - start))
        h.send_header("Accept-Ranges", "bytes")
        h.send_header("X-Repo-Commit", self.commit)
        h.send_header("ETag", f'"{f.git_oid if f.lfs else self._hash(f, f.git_oid)}"')
        if f.lfs:
            h.send_header("X-Linked-Etag", f'"{self._hash(f, f.sha256)}"')
            h.send_header("X-Linked-Size", str(size))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{size - 1}/{size}")
        h.end_headers()
        if head:
            return
        chunk = 64 * 1024
        try:
            for offset in range(start, size, chunk):
                h.wfile.write(f.data[offset:offset + chunk])
                if self.rate:
                    time.sleep(chunk / self.rate)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client was interrupted: what the resume test does
