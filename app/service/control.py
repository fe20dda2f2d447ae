"""``tandem service install | uninstall | start | stop | status | logs``.

One ``ServiceManager`` per platform drives the per-user service manager (``launchctl`` on macOS,
``systemctl --user`` on Linux); the commands are the same on both. Nothing here needs root: the
unit, its log and the commands are the user's own. ``install`` is idempotent (an unchanged unit is
left alone, a changed one is rewritten and the server restarted) and ``uninstall`` removes the unit,
its enablement and its log.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol, TextIO

from app.errors import CommandError
from app.service import units
from app.service.status import fetch_health


@dataclass
class UnitState:
    """What the service manager says about the service."""

    installed: bool
    running: bool
    summary: str  # "active (running)", "not loaded", ...
    pid: int | None = None
    restarts: int | None = None
    last_exit: int | None = None
    enabled: str | None = None


class ServiceManager(Protocol):
    """A per-user service manager: where the unit and log live, and how to drive it."""

    kind: str
    unit_path: Path
    log_path: Path

    def render(self, spec: units.ServiceSpec) -> bytes:
        """The unit file's bytes."""

    def installed_argv(self) -> list[str] | None:
        """The server command of the installed unit, or None."""

    def activate(self, changed: bool) -> None:
        """Enable at login and start; restart when the unit ``changed``."""

    def deactivate(self) -> None:
        """Stop and disable, before the unit file is removed."""

    def forget(self) -> None:
        """After the unit file is removed: drop what the manager remembers of it."""

    def start(self) -> None:
        """Start the installed service."""

    def stop(self) -> None:
        """Stop it (it starts again at the next login)."""

    def state(self) -> UnitState:
        """The service's state now."""


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=120)
    except FileNotFoundError as exc:
        raise CommandError(f"{argv[0]} not found: tandem service needs it on PATH") from exc
    if check and done.returncode != 0:
        raise CommandError(f"`{' '.join(argv)}` failed ({done.returncode}): {(done.stderr or done.stdout).strip()}")
    return done


class SystemdUser:
    """systemd's per-user instance (``systemctl --user``)."""

    kind = "systemd --user"

    def __init__(self, home: Path, environ: Mapping[str, str]) -> None:
        self.unit_path = units.systemd_unit_path(home, environ)
        self.log_path = units.systemd_log_path(home, environ)

    def _ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = _run(["systemctl", "--user", *args], check=False)
        if "Failed to connect to bus" in done.stderr or "No medium found" in done.stderr:
            raise CommandError(
                "systemctl --user cannot reach your user service manager "
                f"({done.stderr.strip()}): log in to a systemd session (or `loginctl enable-linger $USER`)")
        if check and done.returncode != 0:
            raise CommandError(f"`systemctl --user {' '.join(args)}` failed: {done.stderr.strip()}")
        return done

    def render(self, spec: units.ServiceSpec) -> bytes:
        return units.systemd_unit(spec).encode()

    def installed_argv(self) -> list[str] | None:
        if not self.unit_path.is_file():
            return None
        return units.argv_from_unit(self.unit_path.read_text(encoding="utf-8"))

    def activate(self, changed: bool) -> None:
        self._ctl("daemon-reload")
        self._ctl("enable", units.UNIT_NAME)
        self._ctl("reset-failed", units.UNIT_NAME, check=False)  # a stopped crash loop may start again
        self._ctl("restart" if changed else "start", units.UNIT_NAME)

    def deactivate(self) -> None:
        self._ctl("disable", "--now", units.UNIT_NAME, check=False)

    def forget(self) -> None:
        self._ctl("daemon-reload")
        self._ctl("reset-failed", units.UNIT_NAME, check=False)

    def start(self) -> None:
        self._ctl("start", units.UNIT_NAME)

    def stop(self) -> None:
        self._ctl("stop", units.UNIT_NAME)

    def state(self) -> UnitState:
        props = "LoadState,ActiveState,SubState,MainPID,NRestarts,ExecMainStatus,UnitFileState"
        shown = self._ctl("show", units.UNIT_NAME, f"--property={props}", check=False).stdout
        p = dict(line.partition("=")[::2] for line in shown.splitlines())
        if not (self.unit_path.is_file() and p.get("LoadState") == "loaded"):
            return UnitState(installed=False, running=False, summary="not installed")
        pid = int(p.get("MainPID") or 0)
        return UnitState(
            installed=True, running=p.get("ActiveState") == "active",
            summary=f"{p.get('ActiveState', 'unknown')} ({p.get('SubState', '?')})",
            pid=pid or None, restarts=int(p["NRestarts"]) if p.get("NRestarts", "").isdigit() else None,
            last_exit=int(p["ExecMainStatus"]) if p.get("ExecMainStatus", "").isdigit() else None,
            enabled=p.get("UnitFileState") or None)


class Launchd:
    """launchd's per-user GUI domain (``launchctl … gui/$UID``)."""

    kind = "launchd"

    def __init__(self, home: Path) -> None:
        self.unit_path = units.launch_agent_path(home)
        self.log_path = units.launchd_log_path(home)
        self.domain = f"gui/{os.getuid()}"
        self.target = f"{self.domain}/{units.LABEL}"

    def render(self, spec: units.ServiceSpec) -> bytes:
        return units.launchd_plist(spec)

    def installed_argv(self) -> list[str] | None:
        return units.argv_from_plist(self.unit_path.read_bytes()) if self.unit_path.is_file() else None

    def _loaded(self) -> bool:
        return _run(["launchctl", "print", self.target], check=False).returncode == 0

    def _bootout(self, *, check: bool) -> None:
        _run(["launchctl", "bootout", self.target], check=check)
        deadline = time.monotonic() + 60  # the drain; a bootstrap before the job is gone fails
        while self._loaded() and time.monotonic() < deadline:
            time.sleep(0.2)

    def activate(self, changed: bool) -> None:
        _run(["launchctl", "enable", self.target])  # undoes an earlier `launchctl disable`
        if self._loaded() and changed:
            self._bootout(check=False)
        if self._loaded():
            _run(["launchctl", "kickstart", self.target])  # starts it if it is not running
        else:
            _run(["launchctl", "bootstrap", self.domain, str(self.unit_path)])

    def deactivate(self) -> None:
        if self._loaded():
            self._bootout(check=False)

    def forget(self) -> None:
        """launchd forgets a booted-out job with its plist."""

    def start(self) -> None:
        self.activate(changed=False)

    def stop(self) -> None:
        # Booted out: stopped until `tandem service start` or the next login (RunAtLoad).
        if self._loaded():
            self._bootout(check=True)

    def state(self) -> UnitState:
        if not self.unit_path.is_file():
            return UnitState(installed=False, running=False, summary="not installed")
        printed = _run(["launchctl", "print", self.target], check=False)
        if printed.returncode != 0:
            return UnitState(installed=True, running=False, summary="not loaded (stopped)")
        fields: dict[str, str] = {}
        for line in printed.stdout.splitlines():
            key, sep, value = line.strip().partition(" = ")
            if sep and key in ("state", "pid", "last exit code", "runs"):
                fields.setdefault(key, value.strip())
        pid = int(fields["pid"]) if fields.get("pid", "").isdigit() else None
        runs = int(fields["runs"]) if fields.get("runs", "").isdigit() else None
        last = fields.get("last exit code", "")
        return UnitState(installed=True, running=fields.get("state") == "running",
                         summary=fields.get("state", "loaded"), pid=pid,
                         restarts=max(runs - 1, 0) if runs else None,
                         last_exit=int(last) if last.lstrip("-").isdigit() else None, enabled="loaded")


def current_manager(environ: Mapping[str, str] | None = None) -> ServiceManager:
    """The service manager of this platform, for the user whose ``$HOME`` this is."""
    environ = os.environ if environ is None else environ
    home = units.home_dir(environ)
    if sys.platform == "darwin":
        return Launchd(home)
    if sys.platform.startswith("linux"):
        return SystemdUser(home, environ)
    raise CommandError(f"tandem service runs on macOS (launchd) and Linux (systemd --user), not {sys.platform}")


# ---- the commands ----------------------------------------------------------------------------

def install(manager: ServiceManager, spec: units.ServiceSpec, *, wait_s: float) -> int:
    """Write the unit (when it differs), enable it at login, start it, wait for ``/health``."""
    url = units.server_url(spec.host, spec.port)
    if not manager.state().running and fetch_health(url, timeout=1.0).reachable:
        raise CommandError(f"something already answers at {url} (a `tandem serve` in a terminal?): "
                           "stop it first, or install with another --port")
    data = manager.render(spec)
    changed = not manager.unit_path.is_file() or manager.unit_path.read_bytes() != data
    if changed:
        manager.unit_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = manager.unit_path.with_name(f".{manager.unit_path.name}.tmp")
        tmp.write_bytes(data)
        tmp.replace(manager.unit_path)
    spec.log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"{'wrote' if changed else 'unchanged:'} {manager.unit_path}")
    manager.activate(changed)
    print(f"{manager.kind}: enabled at login and started; log: {spec.log_path}")
    return wait_until_up(url, wait_s) if wait_s > 0 else 0


def wait_until_up(url: str, wait_s: float) -> int:
    """Poll ``/health`` until it answers 200 (the model is loaded), or ``wait_s`` passes."""
    print(f"waiting for {url}/health (the model loads first) ...", flush=True)
    started = time.monotonic()
    while time.monotonic() - started < wait_s:
        health = fetch_health(url, timeout=2.0)
        if health.status == 200:
            print(f"up in {time.monotonic() - started:.1f}s: {url}/v1 serves {health.default_model}")
            return 0
        time.sleep(0.5)
    print(f"not answering after {wait_s:.0f}s; `tandem service logs` shows why", file=sys.stderr)
    return 1


def uninstall(manager: ServiceManager) -> int:
    """Stop, disable and remove the unit and its log; prune the directories left empty."""
    removed: list[Path] = []
    if manager.unit_path.is_file():
        manager.deactivate()
        manager.unit_path.unlink()
        removed.append(manager.unit_path)
        manager.forget()
    if manager.log_path.parent.is_dir():
        shutil.rmtree(manager.log_path.parent)
        removed.append(manager.log_path.parent)
    home = units.home_dir()
    for folder in (manager.unit_path.parent / "default.target.wants", manager.log_path.parent):
        _prune_empty(folder, home=home)
    for path in removed:
        print(f"removed {path}")
    if not removed:
        print("tandem service is not installed: nothing to remove")
    return 0


# Folders the system owns, kept even when empty.
_KEPT = frozenset({"Library", "LaunchAgents", "Logs"})


def _prune_empty(folder: Path, *, home: Path) -> None:
    """Remove ``folder`` and its parents while they are empty (what install created:
    ~/.config/systemd/user, ~/.local/state/...), up to ``home``; never the system's own folders."""
    for candidate in (folder, *folder.parents):
        if candidate == home or home not in candidate.parents or candidate.name in _KEPT:
            return
        try:
            candidate.rmdir()
        except FileNotFoundError:
            continue
        except OSError:  # not empty
            return


def start(manager: ServiceManager, *, wait_s: float) -> int:
    argv = _require_installed(manager)
    manager.start()
    print(f"{manager.kind}: started")
    return wait_until_up(units.url_from_argv(argv), wait_s) if wait_s > 0 else 0


def stop(manager: ServiceManager) -> int:
    _require_installed(manager)
    manager.stop()
    print(f"{manager.kind}: stopped (running requests were drained); it starts again at login "
          "or with `tandem service start`")
    return 0


def _require_installed(manager: ServiceManager) -> list[str]:
    argv = manager.installed_argv()
    if argv is None:
        raise CommandError(f"tandem service is not installed ({manager.unit_path} is missing): "
                           "run `tandem service install`", exit_code=3)
    return argv


def status(manager: ServiceManager, *, as_json: bool) -> int:
    """The unit's state and the server's ``/health``. Exit 0: up and healthy; 1: running but not
    healthy; 3: not installed or not running (as LSB init scripts do)."""
    state = manager.state()
    argv = manager.installed_argv()
    url = units.url_from_argv(argv) if argv else None
    health = fetch_health(url, timeout=3.0) if url and state.running else None
    code = 3 if not state.running else 0 if health and health.status == 200 else 1
    if as_json:
        print(json.dumps({"manager": manager.kind, "unit": str(manager.unit_path), "log": str(manager.log_path),
                          "url": url, "state": asdict(state), "health": health.body if health else None}, indent=2))
        return code
    last_exit = None if state.running else state.last_exit  # a running one's is its current process's
    print(f"service  {manager.kind}: {state.summary}" + "".join(
        f", {label} {value}" for label, value in (("pid", state.pid), ("restarts", state.restarts),
                                                  ("last exit", last_exit), ("at login", state.enabled))
        if value is not None))
    print(f"unit     {manager.unit_path}{'' if argv else ' (missing)'}")
    print(f"log      {manager.log_path}")
    if url:
        print(f"server   {url}: {health.describe() if health else 'not running'}")
    return code


def logs(manager: ServiceManager, *, lines: int, follow: bool) -> int:
    """Print the last ``lines`` lines of the log, then follow it (Ctrl-C ends)."""
    path = manager.log_path
    if not path.is_file():
        raise CommandError(f"no log yet at {path}: is the service installed (`tandem service status`)?")
    try:
        follow_file(path, lines=lines, follow=follow, out=sys.stdout)
    except KeyboardInterrupt:
        pass
    return 0


def follow_file(path: Path, *, lines: int, follow: bool, out: TextIO, poll_s: float = 0.3,
                stop: threading.Event | None = None) -> None:
    """``tail -n lines [-F] path``: reopens the file when it is replaced or truncated; ends on
    Ctrl-C, or when ``stop`` is set."""
    write, flush = out.write, out.flush
    handle = open(path, "rb")  # reopened below when the file is replaced
    try:
        tail = handle.read().splitlines(keepends=True)[-lines:] if lines > 0 else []
        handle.seek(0, os.SEEK_END)
        write(b"".join(tail).decode("utf-8", "replace"))
        flush()
        while follow and not (stop and stop.is_set()):
            chunk = handle.read()
            if chunk:
                write(chunk.decode("utf-8", "replace"))
                flush()
                continue
            time.sleep(poll_s)
            try:
                st = path.stat()
            except FileNotFoundError:
                continue
            if st.st_ino != os.fstat(handle.fileno()).st_ino or st.st_size < handle.tell():
                handle.close()
                handle = open(path, "rb")
    finally:
        handle.close()
