"""The control channel's view of the ranks, on loopback without MLX: each follower's host (its
hello says it), its ping round trip, and which one was lost and why; rank 0's
``Distributed.health()`` puts itself first (what /health and the dashboard show)."""

from __future__ import annotations

import socket
import threading
import time

from app.engine.distributed.control import ControlClient, ControlServer
from app.engine.distributed.distributed import Distributed, DistributedInfo
from app.engine.worker import MLXWorker


def until(check, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_rank_zero_reports_every_rank_with_its_host_and_health() -> None:
    server = ControlServer("127.0.0.1", 3, "secret")
    clients: dict[int, ControlClient] = {}
    joining = [threading.Thread(target=lambda r=r: clients.__setitem__(
        r, ControlClient("127.0.0.1", server.port, r, "secret", timeout_s=10))) for r in (1, 2)]
    for t in joining:
        t.start()
    server.accept_all(10)
    for t in joining:
        t.join()
    dist = Distributed(DistributedInfo(3, 0, "ring", "tensor"), MLXWorker(), timeout_s=30, server=server)
    try:
        # The watchdog pings every second; each follower's reader answers.
        until(lambda: all(r["ping_ms"] is not None for r in server.ranks()))
        report = dist.health()
        assert {k: report[k] for k in ("world_size", "rank", "backend", "mode", "error")} == {
            "world_size": 3, "rank": 0, "backend": "ring", "mode": "tensor", "error": None}
        ranks = report["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1, 2]
        assert all(r["host"] == socket.gethostname() and r["state"] == "ok" for r in ranks), ranks
        assert all(r["address"] == "127.0.0.1" and r["error"] is None for r in ranks)
        assert all(0 <= r["ping_ms"] < 1000 and r["last_heard_s"] < 3 for r in ranks[1:])

        # Rank 2's process ends: its connection closes, it is shown lost with the reason.
        clients[2].close()
        until(lambda: server.ranks()[1]["state"] == "lost")
        one, two = server.ranks()
        assert one["state"] == "ok" and one["error"] is None
        assert two["error"] == "rank 2 closed its control connection (its process ended)"
        assert server.lost == two["error"]
    finally:
        dist.close()
        for c in clients.values():
            c.close()


def test_a_follower_that_stops_answering_is_shown_silent() -> None:
    from app.engine.distributed import control

    server = ControlServer("127.0.0.1", 2, "secret")
    # A follower as a bare socket: it says hello (no host: an older Tandem) and never answers a ping.
    sock = socket.create_connection(("127.0.0.1", server.port))
    control.send_frame(sock, {"t": "hello", "rank": 1, "secret": "secret"})
    server.accept_all(10)
    try:
        (rank,) = server.ranks(silent_s=0.3)
        assert rank["host"] is None and rank["state"] == "ok"
        server.ping()
        until(lambda: server.ranks(silent_s=0.3)[0]["state"] == "silent")
        assert server.ranks()[0]["ping_ms"] is None
    finally:
        server.close(stop=False)
        sock.close()
