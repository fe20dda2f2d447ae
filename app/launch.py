"""``tandem launch``: MLX's launcher, exiting with the status of the rank that failed.

``mlx.launch`` (MLX 0.32) starts every rank, ends the others once one exits
non-zero, and then exits 0 whatever happened: its ``main`` returns nothing, and
each rank's status only reaches its log (``Node with rank 1 exited with code 2``).
A service manager (launchd's KeepAlive, systemd's ``Restart=on-failure``) then
never restarts a distributed server whose rank failed: a refused model, a lost
rank, rank 0 exiting 70 after its engine died. Our ranks do exit non-zero; the
launcher drops it.

``tandem launch`` runs the same launcher in this process, with the same flags,
and records each rank's exit status as the launcher reads it. Its own status:

    0        every rank exited 0
    N        the first rank to fail exited N (the launcher then ends the others)
    128+S    the first rank to fail died of signal S (as a shell reports it)

It relies on one private name, ``mlx._distributed_utils.launch._launch_with_io(
command_class, arguments, verbose)``, through which the ring, jaccl and nccl
backends start their ranks, each a ``command_class(rank, ...)`` whose
``exit_status`` is ``(returncode, killed)``; tests/test_launch.py runs two real
ranks through it, so an MLX upgrade that moves it fails there. The mpi backend
runs ``mpirun``, whose own status is dropped the same way: run ``mpirun`` directly.
"""

from __future__ import annotations

import sys
import threading
from typing import Any


class RankStatuses:
    """Each rank's exit status, in the order the ranks ended."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ended: list[tuple[int, int]] = []  # (rank, returncode)

    def record(self, rank: int, returncode: int | None) -> None:
        with self._lock:
            if returncode is not None and all(r != rank for r, _ in self.ended):
                self.ended.append((rank, returncode))

    def exit_code(self) -> int:
        """The first failure's status (128 + the signal for a rank killed by one), else 0."""
        for _, code in self.ended:
            if code != 0:
                return code if code > 0 else 128 - code
        return 0

    def recording(self, command_class: type) -> type:
        """``command_class`` whose ``exit_status``, once the rank has ended, is recorded here."""
        statuses = self

        class Recorded(command_class):
            def __init__(self, rank: int, *args: Any, **kwargs: Any) -> None:
                super().__init__(rank, *args, **kwargs)
                self._tandem_rank = rank

            @property
            def exit_status(self) -> Any:
                status = super().exit_status
                statuses.record(self._tandem_rank, status[0])
                return status

        return Recorded


def launch(argv: list[str]) -> int:
    """Run mlx.launch with ``argv`` (its flags, ``--``, the rank command); the exit status above.
    A wrong flag exits 2, from mlx.launch's own parser."""
    from mlx._distributed_utils import launch as mlx_launch

    statuses = RankStatuses()
    start_ranks = mlx_launch._launch_with_io

    def launch_with_io(command_class: type, arguments: Any, verbose: bool) -> Any:
        return start_ranks(statuses.recording(command_class), arguments, verbose)

    saved_argv = sys.argv
    sys.argv = ["tandem launch", *argv]
    mlx_launch._launch_with_io = launch_with_io
    try:
        mlx_launch.main()
    finally:
        mlx_launch._launch_with_io = start_ranks
        sys.argv = saved_argv
    code = statuses.exit_code()
    if code:
        rank = next(r for r, c in statuses.ended if c != 0)
        print(f"tandem launch: rank {rank} failed (status {code}); exiting {code}", file=sys.stderr)
    return code
