"""The control channel between rank 0 and the other ranks: plain TCP, beside MLX's collectives.

Rank 0 sends each batch step's decisions to every follower here (``app.engine.step.mirror``),
and pings them; followers answer the pings and report their own failure before they exit.
Why not MLX collectives, as mlx_lm.server does: a rank waiting in a ring collective spins
a core (the ring backend polls its sockets), so followers of an idle server would burn a
core each, forever; and a collective has no timeout, so a hung peer hangs the waiter. A
socket blocks without spinning, says at once when a peer's process ends (EOF), and pings
with deadlines tell a hung peer from a slow step.

Frames: a 4-byte big-endian length, then one JSON object (never pickle: nothing a peer
sends is executed). A follower's first frame is ``{"t": "hello", "rank", "secret", "host"}``
(its host name, for /health and the dashboard); the secret reaches the followers through an
MLX collective at start-up, so only the launched ranks can join. ``ControlServer.ranks()``
says how each follower is doing: its host and address, when it last answered a ping and
how long the answer took, and why it was lost, if it was. No MLX calls here: any thread
may use this module.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import logging
import queue
import socket
import struct
import threading
import time
from typing import Any

log = logging.getLogger("tandem.distributed")

_HEADER = struct.Struct(">I")
# A frame larger than this is a protocol error (a prompt of a million tokens is ~7 MB of JSON).
MAX_FRAME = 256 * 2**20
# A follower that has not answered a ping for this long is shown as "silent" (the watchdog
# declares it lost only after ``distributed_timeout_s``).
SILENT_S = 3.0


class ControlError(Exception):
    """The control channel failed: a peer went away, or sent what it must not."""


def send_frame(sock: socket.socket, msg: dict[str, Any]) -> None:
    data = json.dumps(msg, separators=(",", ":")).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def recv_frame(sock: socket.socket) -> dict[str, Any] | None:
    """The next frame, or None at a clean EOF."""
    head = _recv_exactly(sock, _HEADER.size)
    if head is None:
        return None
    (size,) = _HEADER.unpack(head)
    if size > MAX_FRAME:
        raise ControlError(f"a control frame of {size} bytes is over the {MAX_FRAME}-byte limit")
    body = _recv_exactly(sock, size)
    if body is None:
        raise ControlError("the peer closed the connection in the middle of a frame")
    msg = json.loads(body)
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ControlError("a control frame is not an object with a type")
    return msg


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 2**20))
        if not chunk:
            if got:
                raise ControlError("the peer closed the connection in the middle of a frame")
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class _Peer:
    def __init__(self, rank: int, sock: socket.socket, host: str | None, address: str) -> None:
        self.rank = rank
        self.sock = sock
        self.host = host
        self.address = address
        self.send_lock = threading.Lock()
        self.last_pong = time.monotonic()
        self.ping_s: float | None = None  # the last ping's round trip
        self.lost: str | None = None


class ControlServer:
    """Rank 0's side: accepts every follower, sends them frames, watches them.

    ``lost`` is set (once, with the reason) when a follower's connection ends or it
    reports a failure; ``on_lost(reason)`` is called then, from a reader thread.
    """

    def __init__(self, host: str, world_size: int, secret: str) -> None:
        self.world_size = world_size
        self.secret = secret
        self._listener = socket.create_server((host, 0))
        self.address = self._listener.getsockname()[:2]
        self._peers: dict[int, _Peer] = {}
        self.lost: str | None = None
        self.on_lost: Any = None
        self._closing = False
        self._pinged: float | None = None

    @property
    def port(self) -> int:
        return int(self.address[1])

    def accept_all(self, timeout_s: float) -> None:
        """Wait until every follower has connected and said the secret."""
        deadline = time.monotonic() + timeout_s
        while len(self._peers) < self.world_size - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, self.world_size)) - set(self._peers))
                raise ControlError(f"rank(s) {missing} did not connect to rank 0's control channel "
                                   f"({self.address[0]}:{self.port}) within {timeout_s:.0f}s")
            self._listener.settimeout(left)
            try:
                sock, addr = self._listener.accept()
            except TimeoutError:
                continue
            self._greet(sock, addr)
        self._listener.close()
        for peer in self._peers.values():
            threading.Thread(target=self._read, args=(peer,), name=f"tandem-control-{peer.rank}", daemon=True).start()

    def _greet(self, sock: socket.socket, addr: Any) -> None:
        sock.settimeout(10)
        try:
            hello = recv_frame(sock)
        except (OSError, ControlError, ValueError):
            hello = None
        rank = hello.get("rank") if hello and hello.get("t") == "hello" else None
        secret = str(hello.get("secret", "")) if hello else ""
        host = hello.get("host") if hello else None
        if (not isinstance(rank, int) or not 0 < rank < self.world_size or rank in self._peers
                or not hmac.compare_digest(secret, self.secret)):
            log.warning("control channel: refused a connection from %s (not a rank of this launch)", addr)
            sock.close()
            return
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._peers[rank] = _Peer(rank, sock, str(host)[:255] if isinstance(host, str) else None, str(addr[0]))
        log.info("control channel: rank %d (%s) connected from %s", rank, host, addr[0])

    def send(self, msg: dict[str, Any]) -> None:
        """Send ``msg`` to every follower; ControlError if one cannot take it."""
        for peer in self._peers.values():
            try:
                with peer.send_lock:
                    send_frame(peer.sock, msg)
            except OSError as exc:
                reason = f"rank {peer.rank} is unreachable: {exc}"
                self._lose(reason, peer)
                raise ControlError(reason) from exc

    def ping(self) -> None:
        self._pinged = time.monotonic()
        with contextlib.suppress(ControlError):
            self.send({"t": "ping"})

    def ranks(self, silent_s: float = SILENT_S) -> list[dict[str, Any]]:
        """Each follower as /health and the dashboard show it: rank, host, address, state
        ("ok", "silent" past ``silent_s`` without a pong, "lost" with ``error``), seconds
        since it last answered, and its last ping's round trip in ms."""
        now = time.monotonic()
        out = []
        for rank in sorted(self._peers):
            peer = self._peers[rank]
            silent = now - peer.last_pong
            state = "lost" if peer.lost else "silent" if silent > silent_s else "ok"
            out.append({"rank": rank, "host": peer.host, "address": peer.address, "state": state,
                        "last_heard_s": round(silent, 1),
                        "ping_ms": round(peer.ping_s * 1000, 1) if peer.ping_s is not None else None,
                        "error": peer.lost})
        return out

    def start_silence_clocks(self) -> None:
        """Count the followers' silence from now (rank 0's engine exists): pongs that a
        busy machine was slow to send while loading do not count against a follower."""
        now = time.monotonic()
        for peer in self._peers.values():
            peer.last_pong = now

    def silent_for(self) -> tuple[int, float]:
        """The follower that answered last longest ago, and for how many seconds."""
        now = time.monotonic()
        peer = min(self._peers.values(), key=lambda p: p.last_pong)
        return peer.rank, now - peer.last_pong

    def _read(self, peer: _Peer) -> None:
        try:
            while True:
                msg = recv_frame(peer.sock)
                if msg is None:
                    break
                if msg["t"] == "pong":
                    peer.last_pong = time.monotonic()
                    if self._pinged is not None:
                        peer.ping_s = peer.last_pong - self._pinged
                elif msg["t"] == "error":
                    self._lose(f"rank {peer.rank} failed: {msg.get('message', 'no reason given')}", peer)
                    return
        except ConnectionResetError:
            pass  # a killed process resets its connections: the same end as a close
        except (OSError, ControlError, ValueError) as exc:
            if not self._closing:
                self._lose(f"rank {peer.rank}'s control connection broke: {exc}", peer)
            return
        if not self._closing:
            self._lose(f"rank {peer.rank} closed its control connection (its process ended)", peer)

    def _lose(self, reason: str, peer: _Peer | None = None) -> None:
        if peer is not None and peer.lost is None:
            peer.lost = reason
        if self.lost is not None:
            return
        self.lost = reason
        log.error("distributed: %s", reason)
        if self.on_lost is not None:
            self.on_lost(reason)

    def close(self, *, stop: bool) -> None:
        """Tell the followers to stop (when ``stop``), then close every connection."""
        self._closing = True
        if stop and self.lost is None:
            with contextlib.suppress(ControlError):
                self.send({"t": "stop"})
        for peer in self._peers.values():
            with contextlib.suppress(OSError):
                peer.sock.shutdown(socket.SHUT_RDWR)
            peer.sock.close()
        with contextlib.suppress(OSError):
            self._listener.close()


class ControlClient:
    """A follower's side: connects to rank 0, answers pings, queues everything else."""

    def __init__(self, host: str, port: int, rank: int, secret: str, *, timeout_s: float) -> None:
        self.rank = rank
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._sock = socket.create_connection((host, port), timeout=5)
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise ControlError(
                        f"cannot reach rank 0's control channel at {host}:{port}: {exc}; if rank {rank} has no route "
                        "to that address (a Thunderbolt ring of more than two Macs links only neighbours), launch "
                        "with --env TANDEM_CONTROL_HOST=<an address of rank 0 every rank reaches>") from exc
                time.sleep(0.2)
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._send_lock = threading.Lock()
        self._inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.gone: str | None = None
        self.gone_at: float | None = None
        self.last_heard = time.monotonic()
        self._send({"t": "hello", "rank": rank, "secret": secret, "host": socket.gethostname()})
        threading.Thread(target=self._read, name="tandem-control", daemon=True).start()

    def _send(self, msg: dict[str, Any]) -> None:
        with self._send_lock:
            send_frame(self._sock, msg)

    def _read(self) -> None:
        try:
            while True:
                msg = recv_frame(self._sock)
                if msg is None:
                    self.gone = "rank 0 closed the control connection"
                    break
                self.last_heard = time.monotonic()
                if msg["t"] == "ping":
                    self._send({"t": "pong"})
                else:
                    self._inbox.put(msg)
        except (OSError, ControlError, ValueError) as exc:
            self.gone = f"the control connection to rank 0 broke: {exc}"
        self.gone_at = time.monotonic()
        self._inbox.put(None)

    def recv(self, timeout_s: float | None = None) -> dict[str, Any] | None:
        """The next step, stop or other frame from rank 0; None once rank 0 is gone
        (``gone`` says why); raises ``queue.Empty`` after ``timeout_s``."""
        msg = self._inbox.get(timeout=timeout_s)
        if msg is None:
            self._inbox.put(None)  # every later recv sees the end too
        return msg

    def report_error(self, message: str) -> None:
        """Tell rank 0 why this rank is about to stop (best effort)."""
        with contextlib.suppress(OSError):
            self._send({"t": "error", "message": message})

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
