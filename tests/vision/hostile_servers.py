"""Hostile image servers on loopback, for the remote-fetch tests.

``TrickleServer`` answers a GET one byte at a time, each byte well inside any
per-read socket timeout, so only a deadline on the whole fetch stops it:

    /headers   trickles the status line and headers themselves
    /body      sends headers at once, then trickles a 10 MB body

It counts the connections it is still feeding, so a test can see a fetch was
really abandoned (the client hung up), not left running in some thread.
"""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator

from typing_extensions import Self

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: 10000000\r\n\r\n"


class _Trickle(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        self.server.opened(+1)
        try:
            sock.settimeout(5)
            request = b""
            while b"\r\n\r\n" not in request:
                chunk = sock.recv(4096)
                if not chunk:
                    return
                request += chunk
            path = request.split(b" ", 2)[1]
            if path == b"/body":
                sock.sendall(HEAD)
            for byte in self._payload(path):
                sock.sendall(byte)
                time.sleep(self.server.interval)
        except OSError:
            pass  # the client hung up: what a bounded fetch does
        finally:
            self.server.opened(-1)

    def _payload(self, path: bytes) -> Iterator[bytes]:
        stop = time.monotonic() + self.server.for_s
        source = HEAD if path == b"/headers" else b"\x89PNG" + b"\0" * 10_000_000
        for i in range(len(source)):
            if time.monotonic() > stop:
                return
            yield source[i : i + 1]


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    interval: float
    for_s: float

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Trickle)
        self.active = 0
        self._lock = threading.Lock()

    def opened(self, delta: int) -> None:
        with self._lock:
            self.active += delta


class TrickleServer:
    """A loopback server that sends a byte every ``interval`` s for up to ``for_s`` s."""

    def __init__(self, interval: float = 0.2, for_s: float = 10.0) -> None:
        self._server = _Server()
        self._server.interval = interval
        self._server.for_s = for_s
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def url(self, path: str) -> str:
        """The http:// URL of ``path`` (``/headers`` or ``/body``) on this server."""
        return f"http://127.0.0.1:{self.port}{path}"

    @property
    def active(self) -> int:
        """Connections the server is still trickling into."""
        return self._server.active

    def wait_idle(self, timeout: float) -> bool:
        """Whether every client hung up within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self.active and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.active == 0

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


class NotHttpServer:
    """A loopback server that answers every connection with an SSH banner and hangs up."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port = self._sock.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._sock.close()
