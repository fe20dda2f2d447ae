"""A new user's first day with `tandem service`, under a real (private) `systemd --user`.

Run by tests/service/test_systemd_user.py as an unprivileged user, with HOME and
XDG_RUNTIME_DIR in a temporary directory, inside a mount namespace where systemd believes it
was booted (nothing of the machine's own systemd is used or changed). Prints a transcript of
every command and its output; exits non-zero at the first expectation that fails.

    python systemd_scenario.py MODELS_YAML PORT FAULT_INJECTOR_DIR
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HOME = Path(os.environ["HOME"])
SYSTEMD = next(p for p in ("/usr/lib/systemd/systemd", "/lib/systemd/systemd") if Path(p).exists())


def say(text: str) -> None:
    print(text, flush=True)


def run(*argv: str, expect: int | None = 0, shown: str | None = None, quiet: bool = False
        ) -> subprocess.CompletedProcess:
    say(f"$ {shown or ' '.join(argv)}" + (" | grep ' ERROR '" if quiet else ""))
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=300, cwd=REPO)
    out = (done.stdout + done.stderr).rstrip()
    if out and not quiet:
        say(out)
    if expect is not None and done.returncode != expect:
        say(f"!! exit status {done.returncode}, expected {expect}")
        sys.exit(1)
    return done


def tandem(*args: str, expect: int | None = 0, quiet: bool = False) -> subprocess.CompletedProcess:
    return run(sys.executable, "-m", "app", *args, expect=expect, shown="tandem " + " ".join(args), quiet=quiet)


def systemctl(*args: str, expect: int | None = 0) -> subprocess.CompletedProcess:
    return run("systemctl", "--user", *args, expect=expect)


def check(ok: bool, what: str) -> None:
    if not ok:
        say(f"!! expected: {what}")
        sys.exit(1)
    say(f"   ok: {what}")


class Manager:
    """`systemd --user` for this session: started at "login", stopped at "logout"."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def login(self) -> None:
        log = open(HOME.parent / "systemd-user.log", "ab")
        self.proc = subprocess.Popen([SYSTEMD, "--user"], stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 30
        while subprocess.run(["systemctl", "--user", "is-system-running"], capture_output=True,
                             text=True).stdout.strip() not in ("running", "degraded"):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                say("!! systemd --user did not come up")
                sys.exit(1)
            time.sleep(0.2)
        say(f"-- logged in: systemd --user is running (pid {self.proc.pid})")

    def logout(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # stops every unit, as at logout
            self.proc.wait(timeout=90)
            say("-- logged out: systemd --user stopped its services and exited")


def health(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return json.loads(r.read())
    except OSError:
        return None


def wait_health(url: str, *, not_pid: int | None = None, within: float = 120) -> float:
    started = time.monotonic()
    while time.monotonic() - started < within:
        if health(url) and (not_pid is None or main_pid() not in (0, not_pid)):
            return time.monotonic() - started
        time.sleep(0.25)
    say(f"!! {url}/health did not answer within {within:.0f}s")
    sys.exit(1)


def main_pid() -> int:
    shown = subprocess.run(["systemctl", "--user", "show", "tandem.service", "-p", "MainPID", "--value"],
                           capture_output=True, text=True).stdout.strip()
    return int(shown or 0)


def chat(url: str) -> str:
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        answer = json.loads(r.read())
    return f"{r.status} finish_reason={answer['choices'][0]['finish_reason']}"


def tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def main() -> int:
    models, port, injector = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    url = f"http://127.0.0.1:{port}"
    manager = Manager()
    manager.login()
    before = tree(HOME)
    try:
        say("\n## install: enabled at login, started, waits for the model")
        tandem("service", "install", "--models-file", models, "--wait", "120")
        pid = main_pid()
        say("\n## install again: idempotent, the running server is left alone")
        out = tandem("service", "install", "--models-file", models, "--wait", "120").stdout
        check("unchanged:" in out and main_pid() == pid, "the unit is unchanged and the server kept its pid")
        tandem("service", "status")
        tandem("ps", "--url", url)
        say(f"$ curl {url}/v1/chat/completions ...\n{chat(url)}")

        say("\n## stop, then start (the reboot-equivalent within a session)")
        tandem("service", "stop")
        tandem("service", "status", expect=3)
        check(health(url) is None, "nothing answers on the port")
        tandem("service", "start", "--wait", "120")
        say(f"$ curl {url}/v1/chat/completions ...\n{chat(url)}")

        say("\n## log out and log in again: the service starts by itself (WantedBy=default.target)")
        manager.logout()
        check(health(url) is None, "the server stopped with the session")
        manager.login()
        took = wait_health(url)
        say(f"   up {took:.1f}s after login")
        tandem("service", "status")

        say("\n## kill -9 the server: systemd restarts it (Restart=on-failure), clients see the same URL")
        pid = main_pid()
        run("kill", "-9", str(pid))
        took = wait_health(url, not_pid=pid)
        say(f"   a new server answered {took:.1f}s after the kill")
        status = tandem("service", "status").stdout
        check("restarts 1" in status, "systemd counts one restart")
        say(f"$ curl {url}/v1/chat/completions ...\n{chat(url)}")

        say("\n## the MLX engine thread dies: the server drains, exits 70, and is restarted")
        say("   (test only: the fault injector is loaded, and SIGUSR1 kills the MLX thread from outside)")
        systemctl("set-environment", f"PYTHONPATH={injector}:{REPO}")
        systemctl("restart", "tandem.service")
        wait_health(url)
        pid = main_pid()
        run("kill", "-USR1", str(pid))
        took = wait_health(url, not_pid=pid)
        say(f"   a new server answered {took:.1f}s after the engine died")
        log = tandem("service", "logs", "--no-follow", "-n", "200", quiet=True).stdout
        say("\n".join(line for line in log.splitlines() if " ERROR " in line))
        check("exiting with status 70" in log, "the log says why it exited")
        tandem("service", "status")
        say(f"$ curl {url}/v1/chat/completions ...\n{chat(url)}")
        systemctl("unset-environment", "PYTHONPATH")

        say("\n## uninstall: nothing left behind")
        tandem("service", "uninstall")
        systemctl("status", "tandem.service", expect=4)
        check(health(url) is None, "the server is gone")
        left = tree(HOME) - before
        check(not left, f"HOME has nothing new (left: {sorted(left)})")
        tandem("service", "status", expect=3)
    finally:
        manager.logout()
    say("\nall steps passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
