"""`tandem service` under a real `systemd --user`, as a new user would meet it.

A machine's own user manager is never used: installing into it would touch the real ~/.config.
Instead the test starts a private one, for an unprivileged user (nobody) whose HOME is a temporary
directory. systemd only runs as a user manager on a machine booted with systemd, and only in a
cgroup it may write to, so the set-up needs root: a mount namespace in which /run/systemd/system
exists (only this test's processes see it), and a cgroup delegated to that user (removed at the
end); an interpreter under a closed directory (pyenv's under /root) is made reachable in that
namespace. Everything Tandem does then runs as that user, with no capability left: the commands,
the unit, the server.
Where this cannot be set up (not root, no unshare, no cgroup v2), the test is skipped and says why.
The transcript (tests/service/systemd_scenario.py) is printed; `pytest -s` shows it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, free_port

NOBODY = 65534
SCENARIO = Path(__file__).with_name("systemd_scenario.py")
INJECTOR = REPO / "tests" / "fixtures" / "engine_fault"


def cgroup2_dir() -> Path | None:
    """The cgroup v2 directory this process is in, if there is one."""
    mount = next((line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()
                  if line.split()[2] == "cgroup2"), None)
    own = next((line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines()
                if line.startswith("0::")), None)
    return Path(mount + own) if mount and own is not None else None


def why_not() -> str | None:
    if not sys.platform.startswith("linux"):
        return "systemd is Linux's"
    if os.geteuid() != 0:
        return "a private systemd --user needs root to set up (a mount namespace, a delegated cgroup)"
    if not all(shutil.which(t) for t in ("unshare", "setpriv", "systemctl")):
        return "needs unshare, setpriv and systemctl"
    if not any(Path(p).exists() for p in ("/usr/lib/systemd/systemd", "/lib/systemd/systemd")):
        return "systemd is not installed"
    if cgroup2_dir() is None:
        return "no cgroup v2 hierarchy to delegate"
    return None


@pytest.mark.slow
@pytest.mark.skipif(why_not() is not None, reason=why_not() or "")
def test_a_new_user_installs_the_service_and_it_heals_itself(tiny_model_dir):
    base = Path(tempfile.mkdtemp(prefix="tandem-systemd-user-"))
    cgroup = cgroup2_dir() / f"tandem-test-{os.getpid()}"  # type: ignore[operator]
    try:
        base.chmod(0o755)
        home, runtime, model = base / "home", base / "runtime", base / "tiny-model"
        shutil.copytree(tiny_model_dir, model)
        home.mkdir()
        runtime.mkdir(mode=0o700)
        port = free_port()
        models = home / "models.yaml"
        models.write_text(yaml.safe_dump({"server": {"port": port, "shutdown_grace_s": 2}, "models": [
            {"name": "tiny", "local_path": str(model), "params": {"mem": 16, "max_tokens": 3}}]}))
        for path in (base, home, runtime, model, models, *model.iterdir()):
            os.chown(path, NOBODY, NOBODY)
        before = {str(p.relative_to(home)) for p in home.rglob("*")}

        env = {"HOME": str(home), "XDG_RUNTIME_DIR": str(runtime), "PATH": "/usr/bin:/bin:/usr/sbin:/sbin",
               "LANG": "C.UTF-8", "TANDEM_URL": ""}
        setup = " && ".join([
            "mount -t tmpfs tmpfs /run/systemd", "mkdir -p /run/systemd/system",
            *_reachable_interpreter(base / "held"),
            f"mkdir {cgroup}", f"chown -R {NOBODY}:{NOBODY} {cgroup}", f"echo $$ > {cgroup}/cgroup.procs",
            # No capability survives: from here on, a plain unprivileged user.
            f"exec setpriv --reuid {NOBODY} --regid {NOBODY} --clear-groups --inh-caps=-all --bounding-set=-all "
            "env -i " + " ".join(f"{k}={v}" for k, v in env.items())
            + f" {sys.executable} {SCENARIO} {models} {port} {INJECTOR}"])
        done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", setup],
                              capture_output=True, text=True, timeout=900)
        print(done.stdout, done.stderr)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "all steps passed" in done.stdout
        assert {str(p.relative_to(home)) for p in home.rglob("*")} == before
    finally:
        _remove_cgroup(cgroup)
        shutil.rmtree(base, ignore_errors=True)


def _reachable_interpreter(held: Path) -> list[str]:
    """Shell commands that let the unprivileged user run this Python, in the namespace only: an
    interpreter under a closed directory (pyenv's under /root) is bind-mounted back into a
    world-readable tmpfs laid over that directory."""
    prefix = Path(sys.base_prefix).resolve()
    closed = next((p for p in reversed(prefix.parents) if not p.stat().st_mode & 0o001), None)
    if closed is None:
        return []
    rel = prefix.relative_to(closed)
    return [f"mkdir -p {held}", f"mount --bind {closed} {held}", f"mount -t tmpfs -o mode=755 tmpfs {closed}",
            f"mkdir -p {closed / rel}", f"mount --bind {held / rel} {closed / rel}"]


def _remove_cgroup(cgroup: Path) -> None:
    """Kill what is left in the delegated cgroup (nothing, when the scenario ended well), then
    remove it, deepest first."""
    if not cgroup.exists():
        return
    for procs in cgroup.rglob("cgroup.procs"):
        for pid in procs.read_text().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    time.sleep(0.5)
    for folder in sorted((p for p in cgroup.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
        folder.rmdir()
    cgroup.rmdir()
