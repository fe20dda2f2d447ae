"""Serving one model across machines on MLX distributed, launched the MLX way:

    mlx.launch --backend ring -n 2 --hosts 127.0.0.1 -- python -m app serve ...

Every rank loads its shard of the chat model (``sharding``). Rank 0 serves HTTP and
decides everything; the other ranks ("followers") replay its decisions on their own
batch and prompt cache (``mirror``), which reach them over a TCP control channel
(``control``), and every rank runs the same batch steps in lockstep.

Failure: a peer whose process ends is noticed at once (its control connection closes,
and the ring backend raises in the step); a peer that hangs is noticed by rank 0's
watchdog: a step or a ping unanswered for ``timeout_s``. Either way the engine is
declared dead (``MLXWorker.kill``): requests fail, /health and new requests say 503,
nothing waits forever. A follower whose rank 0 is gone exits.

Start-up order, the same on every rank (collectives must match): init the group, check
the model can be split (refused on every rank, with the numbers), share the control
channel's port and secret, connect, load the shard (``sharded_load`` ends in a barrier).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from app.engine.batch.engine import TextEngine
from app.engine.distributed.control import ControlClient, ControlError, ControlServer
from app.engine.distributed.sharding import load_shard
from app.engine.params import ModelSpec
from app.engine.step.mirror import DesyncError, Follower, MirrorOps
from app.engine.worker import MLXWorker
from app.errors import ConfigError, EngineDeadError

log = logging.getLogger("tandem.distributed")

# Seconds between rank 0's pings to each follower.
HEARTBEAT_S = 1.0
# Seconds a follower's MLX thread gets to end on its own once rank 0's connection is gone.
GONE_GRACE_S = 3.0
# Seconds the followers get to connect to rank 0's control channel at start-up.
CONNECT_TIMEOUT_S = 120.0
# The control channel's port and secret, as bytes shared by one all_sum at start-up.
_SHARED_BYTES = 2 + 32


@dataclass(frozen=True)
class DistributedInfo:
    """This process's place in a distributed launch."""

    world_size: int
    rank: int
    backend: str  # ring | jaccl | mpi | nccl
    mode: str  # tensor | pipeline

    def as_dict(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "rank": self.rank, "backend": self.backend, "mode": self.mode}


def launched_backend() -> str | None:
    """The backend mlx.launch (or mpirun) started this process for, from its environment;
    None when it was started on its own."""
    env = os.environ
    if "MLX_JACCL_COORDINATOR" in env:
        return "jaccl"
    if "MLX_RANK" in env and env.get("MLX_HOSTFILE"):
        try:  # mlx.launch -n 1 writes an empty hostfile: one process, not a launch
            return "ring" if Path(env["MLX_HOSTFILE"]).read_text().strip() else None
        except OSError:
            return "ring"  # init says what is wrong with it
    if "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env:
        return "mpi"
    if "MLX_WORLD_SIZE" in env and "NCCL_HOST_IP" in env:
        return "nccl"
    return None


def control_host(backend: str) -> str:
    """Where rank 0's control channel listens: its address in the launch's hostfile, or
    TANDEM_CONTROL_HOST."""
    env = os.environ
    if env.get("TANDEM_CONTROL_HOST"):
        return env["TANDEM_CONTROL_HOST"]
    try:
        if backend == "ring":
            with open(env["MLX_HOSTFILE"]) as f:
                return str(json.load(f)[0][0]).rsplit(":", 1)[0]
        if backend == "jaccl":
            return env["MLX_JACCL_COORDINATOR"].rsplit(":", 1)[0]
    except (OSError, ValueError, IndexError, KeyError) as exc:
        raise ConfigError(f"cannot tell rank 0's address from the {backend} launch: {exc}; "
                          "set TANDEM_CONTROL_HOST to an address of rank 0 the other ranks reach") from exc
    raise ConfigError(f"the {backend} backend does not say where rank 0 is: set TANDEM_CONTROL_HOST to an "
                      "address of rank 0 the other ranks reach")


def _init_group(backend: str) -> tuple[int, int]:
    group = mx.distributed.init(strict=True, backend=backend)
    return group.size(), group.rank()


def _count(flag: bool) -> int:
    """How many ranks raise ``flag`` (every rank calls it: a barrier too)."""
    return int(mx.distributed.all_sum(mx.array(int(flag)), stream=mx.cpu).item())  # type: ignore[arg-type]


def _share(port: int, secret: str) -> tuple[int, str]:
    """Rank 0's port and secret on every rank (the others pass 0 and "")."""
    data = [0] * _SHARED_BYTES
    if port:
        data[:2] = divmod(port, 256)
        data[2:] = secret.encode()
    summed = mx.distributed.all_sum(mx.array(data, dtype=mx.uint8), stream=mx.cpu)
    shared = bytes(memoryview(summed))  # type: ignore[arg-type]  # an mx.array is a buffer
    return shared[0] * 256 + shared[1], shared[2:].decode()


class Distributed:
    """This process's part in a distributed launch: rank 0's control server and watchdog,
    or a follower's control client. ``join`` makes one."""

    def __init__(self, info: DistributedInfo, worker: MLXWorker, timeout_s: float,
                 server: ControlServer | None = None, client: ControlClient | None = None) -> None:
        self.info = info
        self.worker = worker
        self.timeout_s = timeout_s
        self.server = server
        self.client = client
        # Why the group is broken (rank 0), once it is.
        self.error: str | None = None
        self._step_started: float | None = None
        self._closed = threading.Event()
        self._ops: MirrorOps | None = None
        if server is not None:
            # Pings from now on, so a follower hears rank 0 while rank 0 still loads (however
            # long a big model takes); silence is judged once the engine exists (mirror_ops).
            threading.Thread(target=self._watch, name="tandem-watchdog", daemon=True).start()

    # ---- rank 0 -----------------------------------------------------------------------------

    def mirror_ops(self) -> MirrorOps:
        """The ops every rank replays (one engine: the sharded model), and the watchdog."""
        assert self.server is not None, "followers replay; only rank 0 records"
        if self._ops is None:
            self._ops = MirrorOps(self.server.send, self)
            self.worker.add_stepper(self._ops.flush_idle, lambda exc: None)
            self.server.on_lost = self._fail
            self.server.start_silence_clocks()  # a slow load on a busy machine is not a hang
        return self._ops

    def load_engine(self, spec: ModelSpec) -> tuple[TextEngine, int]:
        """Rank 0 (the registry's ``load_chat``): this rank's shard of the model, in an engine
        whose every batch and cache call the followers replay. MLX thread only."""
        assert spec.load is not None and spec.engine is not None, "a chat model's spec"
        loaded = load_shard(spec.source, spec.load, self.info.world_size)
        return TextEngine(self.worker, loaded, spec.engine, ops=self.mirror_ops()), loaded.weights_bytes

    def begin_step(self) -> None:
        self._step_started = time.monotonic()

    def end_step(self) -> None:
        self._step_started = None

    def _watch(self) -> None:
        assert self.server is not None
        last_ping = 0.0
        while not self._closed.wait(0.2) and self.error is None:
            now = time.monotonic()
            started = self._step_started
            if started is not None and now - started > self.timeout_s:
                self._fail(f"a batch step has not finished in {self.timeout_s:g}s: a rank is hung or unreachable")
                return
            if now - last_ping >= HEARTBEAT_S:
                self.server.ping()
                last_ping = now
            if self._ops is None:
                continue  # still loading: pings go out, silence is not judged yet
            rank, silent = self.server.silent_for()
            if silent > self.timeout_s:
                self._fail(f"rank {rank} has not answered for {silent:.0f}s (hung or unreachable)")
                return

    def _fail(self, reason: str) -> None:
        if self._closed.is_set() or self.error is not None:
            return
        self.error = reason
        log.error("distributed: %s; the engine stops (503 until Tandem is restarted)", reason)
        self.worker.kill(EngineDeadError(f"distributed serving stopped: {reason}"))

    def health(self) -> dict[str, Any]:
        """/health's ``distributed`` field: the launch, why it broke (if it did), and on rank 0
        every rank with its host and health (``ControlServer.ranks``)."""
        report: dict[str, Any] = {**self.info.as_dict(), "error": self.error}
        if self.server is not None:
            me = {"rank": 0, "host": socket.gethostname(), "address": self.server.address[0],
                  "state": "stopped" if self.error else "ok", "last_heard_s": 0.0, "ping_ms": None, "error": None}
            report["ranks"] = [me, *self.server.ranks()]
        return report

    def close(self) -> None:
        """Rank 0: tell the followers to stop and close the channel. A follower: close it."""
        self._closed.set()
        if self.server is not None:
            self.server.close(stop=True)
        if self.client is not None:
            self.client.close()

    # ---- a follower ---------------------------------------------------------------------------

    def follow(self, model: Any, tokenizer: Any) -> None:
        """Replay rank 0's steps until it says stop. MLX thread only. Raises when rank 0 is
        gone or this rank cannot keep in step (after telling rank 0 why)."""
        assert self.client is not None
        follower = Follower(model, tokenizer)
        try:
            while True:
                try:
                    msg = self.client.recv(timeout_s=HEARTBEAT_S)
                except queue.Empty:  # an idle server (rank_zero_lost watches rank 0's pings)
                    continue
                if msg is None:
                    raise ControlError(self.client.gone or "rank 0 is gone")
                if msg["t"] == "stop":
                    log.info("rank 0 says stop, after %d batch steps", follower.steps)
                    return
                if msg["t"] == "step":
                    follower.apply(msg)
        except (DesyncError, RuntimeError, KeyError, IndexError, TypeError) as exc:
            self.client.report_error(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            follower.close()


    def rank_zero_lost(self) -> str | None:
        """A follower: why rank 0 is to be taken as gone (its connection ended a while ago,
        or it has not pinged for ``timeout_s``), or None. Asked from outside the MLX thread,
        which may be stuck in a collective that rank 0 will never join."""
        assert self.client is not None
        now = time.monotonic()
        if self.client.gone and now - (self.client.gone_at or now) > GONE_GRACE_S:
            return self.client.gone
        silent = now - self.client.last_heard
        if silent > self.timeout_s + HEARTBEAT_S:
            return f"rank 0 has sent nothing, not even a ping, for {silent:.0f}s"
        return None


def join(worker: MLXWorker, *, mode: str, timeout_s: float,
         check: Callable[[DistributedInfo], None]) -> Distributed | None:
    """Join the distributed launch this process belongs to; None when it was not launched
    as one (or with one rank). ``check(info)`` refuses what cannot be split: it runs on every
    rank, and when any rank refuses, every rank stops (after all have checked, so each says why)."""
    backend = launched_backend()
    if backend is None:
        return None
    try:
        world_size, rank = worker.submit(lambda: _init_group(backend)).result()
    except RuntimeError as exc:
        raise ConfigError(f"cannot join the {backend} launch: {exc}") from exc
    if world_size == 1:
        return None
    info = DistributedInfo(world_size, rank, backend, mode)
    refusal: ConfigError | None = None
    try:
        check(info)
    except ConfigError as exc:
        refusal = exc
    # Every rank learns whether any refused (so all stop, each with its reason, and none
    # goes on to collectives the others will not make).
    refused = worker.submit(lambda: _count(refusal is not None)).result()
    if refusal is not None:
        raise refusal
    if refused:
        raise ConfigError(f"{refused} other rank(s) refused to serve the model; see their messages")
    host = control_host(backend)
    if rank == 0:
        secret = secrets.token_hex(16)
        server = ControlServer(host, world_size, secret)
        worker.submit(lambda: _share(server.port, secret)).result()
        server.accept_all(CONNECT_TIMEOUT_S)
        log.info("distributed: rank 0 of %d (%s, %s parallel); control channel on %s:%d", world_size, backend,
                 mode, host, server.port)
        return Distributed(info, worker, timeout_s, server=server)
    port, secret = worker.submit(lambda: _share(0, "")).result()
    client = ControlClient(host, port, rank, secret, timeout_s=CONNECT_TIMEOUT_S)
    log.info("distributed: rank %d of %d (%s, %s parallel) follows rank 0 at %s:%d", rank, world_size, backend,
             mode, host, port)
    return Distributed(info, worker, timeout_s, client=client)
