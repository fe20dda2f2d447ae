"""``tandem launch``: mlx.launch's ranks, and an exit status that says whether they succeeded.

mlx.launch exits 0 whatever its ranks did, so a service manager never restarted a
distributed server whose rank failed. Two real ranks on loopback (the ring backend, as
the distributed tests run ``tandem serve``), each a short script that exits as told.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.api.test_distributed_e2e import ring_port
from tests.conftest import REPO

# Rank r exits with argv[1 + r] ("kill": dies of SIGKILL); a rank told 0 first waits, so the
# launcher ends it when another fails first.
RANK = """
import os, signal, sys, time
told = sys.argv[1 + int(os.environ["MLX_RANK"])]
if told == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if told == "0":
    time.sleep(float(sys.argv[3]))
sys.exit(int(told))
"""
TANDEM_LAUNCH = [sys.executable, "-m", "app", "launch"]
MLX_LAUNCH = [str(REPO / ".venv" / "bin" / "mlx.launch")]


def launch(launcher: list[str], tmp_path, rank0: str, rank1: str, wait_s: float = 20) -> subprocess.CompletedProcess:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    cmd = [*launcher, "--backend", "ring", "-n", "2", "--hosts", "127.0.0.1", "-p", str(ring_port()), "--",
           sys.executable, str(script), rank0, rank1, str(wait_s)]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=60)


@pytest.mark.parametrize("rank0, rank1, status", [
    ("0", "3", 3),  # rank 1 fails: its status, though the launcher then ends rank 0 (SIGTERM)
    ("4", "0", 4),
    ("0", "kill", 137),  # killed by SIGKILL: 128 + 9, as a shell says
    ("0", "0", 0),
], ids=["rank 1 fails", "rank 0 fails", "rank 1 killed", "both succeed"])
def test_the_launch_exits_with_the_first_failed_ranks_status(tmp_path, rank0, rank1, status):
    done = launch(TANDEM_LAUNCH, tmp_path, rank0, rank1, wait_s=20 if status else 0.2)
    assert done.returncode == status, done.stderr
    if status:
        assert f"failed (status {status}); exiting {status}" in done.stderr


def test_mlx_launch_itself_exits_0_when_a_rank_fails(tmp_path):
    """Why ``tandem launch`` exists (MLX 0.32): when this fails, mlx.launch reports its ranks itself."""
    done = launch(MLX_LAUNCH, tmp_path, "0", "3")
    assert "Node with rank 1 exited with code 3" in done.stderr
    assert done.returncode == 0
