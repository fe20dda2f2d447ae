"""``tandem serve`` as one rank of a distributed launch (``mlx.launch ... -- python -m app serve``).

Rank 0 serves HTTP as ``tandem serve`` always does, over its shard of the default chat
model (``app.main.build_state`` with the ``Distributed`` part); every other rank loads its
shard and follows rank 0's batch steps (``follow``) until rank 0 says stop.

Served distributed: the default chat model, split over every rank; embedding and rerank
models, and a proxy-mode vision model, on rank 0 alone (they run between batch steps);
other chat entries are not served. A native VLM is refused at start-up (mlx-lm cannot
split it), as are load-time quantization and a model whose heads do not divide by the
world size.

Ending: SIGTERM or SIGINT to rank 0 drains it as usual, then it tells the followers to
stop. A follower that gets a signal waits for that (rank 0 may still be finishing
streams), exiting on its own only if rank 0 never says. mlx.launch dies of a SIGTERM
without passing it on, leaving its ranks behind: each rank watches for its launcher to
go and takes that as SIGTERM. A rank that loses its peers exits non-zero.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any, NoReturn, TypeVar

from app.config.loader import ResolvedConfig
from app.engine import (
    Distributed,
    DistributedInfo,
    MLXWorker,
    check_params,
    check_splittable,
    join,
    load_shard,
    read_config,
)
from app.engine import model_source as source_path
from app.errors import ConfigError
from app.specs import load_params, model_source

log = logging.getLogger("tandem.distributed")
T = TypeVar("T")

# How often each rank looks whether its launcher is still there.
LAUNCHER_POLL_S = 0.5


def join_launch(config: ResolvedConfig) -> tuple[MLXWorker, Distributed | None]:
    """Start the MLX thread and join the launch (None: a launch of one rank). On every rank,
    refuses (ConfigError) a default model that cannot be served split."""
    entry = config.primary
    params = load_params(entry.params)

    def check(info: DistributedInfo) -> None:
        if entry.capabilities.vision_mode == "native":
            raise ConfigError(f"model {entry.name!r} is a native VLM, which mlx-lm cannot split over ranks; serve a "
                              "text model (vision_mode: proxy captions images on rank 0)")
        check_params(entry.name, params)
        check_splittable(entry.name, read_config(source_path(model_source(entry))), info.world_size, info.mode)

    worker = MLXWorker()
    worker.start()
    try:
        dist = join(worker, mode=params.distributed, timeout_s=config.server.distributed_timeout_s, check=check)
    except BaseException as exc:
        worker.stop()
        if isinstance(exc, ConfigError):
            rank = os.environ.get("MLX_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or "?"
            raise ConfigError(f"rank {rank}: {exc.message}") from exc
        raise
    if dist is not None:
        _watch_launcher(dist.info.rank)
        log.info("distributed: %s", dist.info.as_dict())
    return worker, dist


def follow(config: ResolvedConfig, worker: MLXWorker, dist: Distributed) -> int:
    """A follower's life: load the shard, replay rank 0's steps until it says stop; the exit status."""
    entry = config.primary
    deadline: list[float] = []

    def on_signal(signum: int, _: Any) -> None:
        if not deadline:  # rank 0 drains first (it may still need this rank), then says stop
            grace = config.server.shutdown_grace_s + config.server.distributed_timeout_s + 10
            deadline.append(time.monotonic() + grace)
            log.info("rank %d: %s; waiting up to %.0fs for rank 0 to say stop", dist.info.rank,
                     signal.Signals(signum).name, grace)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    def wait(job: Future[T]) -> T | None:
        """The job's result; None when rank 0 is gone (or silent past the signal's deadline)
        first. The MLX thread may be stuck in a collective for good: this thread watches."""
        while not job.done():
            lost = dist.rank_zero_lost()
            if lost or (deadline and time.monotonic() > deadline[0]):
                log.error("rank %d stops: %s", dist.info.rank, lost or "rank 0 did not say stop in time")
                return None
            time.sleep(0.2)
        return job.result()

    try:
        loaded = wait(worker.submit(lambda: load_shard(model_source(entry), load_params(entry.params),
                                                       dist.info.world_size)))
        if loaded is None:
            return 1
        following = worker.submit(lambda: dist.follow(loaded.model, loaded.tokenizer))
        wait(following)
        return 0 if following.done() else 1  # done: rank 0 said stop
    except ConfigError as exc:
        if dist.client is not None:
            dist.client.report_error(exc.message)
        log.error("rank %d: %s", dist.info.rank, exc.message)
        return 2
    except Exception as exc:  # noqa: BLE001 - the reason goes to the log; the status says it failed
        log.error("rank %d stops: %s", dist.info.rank, exc)
        return 1
    finally:
        dist.close()


def _watch_launcher(rank: int) -> None:
    """When this rank's parent (mlx.launch, or an ssh session) goes away, its pipes go with it:
    send output nowhere, and stop as if by SIGTERM (rank 0 drains and stops the others)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(LAUNCHER_POLL_S)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.dup2(devnull, sys.stderr.fileno())
        log.info("rank %d: the launcher is gone; stopping", rank)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="tandem-launcher-watch", daemon=True).start()
    if rank == 0:  # a closed ssh session hangs up: the same as SIGTERM
        signal.signal(signal.SIGHUP, lambda *_: os.kill(os.getpid(), signal.SIGTERM))


def exit_now(code: int) -> NoReturn:
    """Leave without Python's shutdown: an MLX thread stuck in a collective whose peer hung
    would hold the interpreter's exit forever."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
