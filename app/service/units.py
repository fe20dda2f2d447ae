"""The service definitions: a launchd LaunchAgent (macOS) and a systemd ``--user`` unit (Linux).

Pure text, no commands run: a ``ServiceSpec`` (what ``tandem serve`` command, with which models
file and port) becomes a plist or a unit file, and an installed file gives its command back
(``status`` reads the URL from it). Both are per-user, so nothing needs root:

    macOS  ~/Library/LaunchAgents/com.tandem.server.plist     log ~/Library/Logs/Tandem/tandem.log
    Linux  $XDG_CONFIG_HOME/systemd/user/tandem.service        log $XDG_STATE_HOME/tandem/tandem.log

Both start at login (``RunAtLoad`` / ``WantedBy=default.target``) and restart the server when it
exits with a failure (``KeepAlive.SuccessfulExit=false`` / ``Restart=on-failure``): a dead MLX
engine exits 70 (``server.on_engine_death``). A clean stop (SIGTERM, drained, exit 0) stays stopped.
"""

from __future__ import annotations

import os
import plistlib
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from app.errors import CommandError

LABEL = "com.tandem.server"
UNIT_NAME = "tandem.service"
# Passed from the installing shell to the service, which launchd and systemd start with a bare
# environment: where the converted models and the Hugging Face cache are.
PASSED_ENV = ("TANDEM_CACHE_DIR", "HF_HOME", "HF_HUB_CACHE", "HF_ENDPOINT", "HF_HUB_OFFLINE", "XDG_CACHE_HOME")
# An exit status after which restarting cannot help: models.yaml or the flags are wrong.
EXIT_CONFIG_ERROR = 2


@dataclass(frozen=True)
class ServiceSpec:
    """What the service runs: ``python -m app serve`` with the models file and address it was installed with."""

    python: str
    workdir: str  # the directory the `app` package is imported from, so the service runs this code
    models_file: str
    host: str
    port: int
    log_path: Path
    model: str | None = None
    no_vision: bool = False
    env: Mapping[str, str] = field(default_factory=dict)
    # launchd / systemd wait this long for the drain on stop before SIGKILL.
    stop_timeout_s: int = 45

    @property
    def argv(self) -> list[str]:
        """The server's command line."""
        argv = [self.python, "-m", "app", "serve", "--models-file", self.models_file,
                "--host", self.host, "--port", str(self.port)]
        if self.model:
            argv += ["--model", self.model]
        if self.no_vision:
            argv.append("--no-vision")
        return argv

    @property
    def environment(self) -> dict[str, str]:
        """The service's environment: log lines unbuffered, plus what was passed on."""
        return {"PYTHONUNBUFFERED": "1", **self.env}


def passed_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of ``PASSED_ENV`` set in ``environ``."""
    return {k: environ[k] for k in PASSED_ENV if environ.get(k)}


def url_from_argv(argv: list[str]) -> str:
    """The base URL a ``tandem serve`` command line listens on (a wildcard host is reached on loopback)."""
    from app.config.schema import ServerSettings

    host, port = ServerSettings.model_fields["host"].default, str(ServerSettings.model_fields["port"].default)
    for flag, value in zip(argv, argv[1:]):
        if flag == "--host":
            host = value
        elif flag == "--port":
            port = value
    return server_url(host, int(port))


def server_url(host: str, port: int) -> str:
    """``http://host:port``, with a wildcard bind address replaced by loopback."""
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


# ---- launchd -------------------------------------------------------------------------------

def launch_agent_path(home: Path) -> Path:
    return home / "Library" / "LaunchAgents" / f"{LABEL}.plist"


def launchd_log_path(home: Path) -> Path:
    return home / "Library" / "Logs" / "Tandem" / "tandem.log"


def launchd_plist(spec: ServiceSpec) -> bytes:
    """The LaunchAgent (launchd.plist(5)) as XML."""
    log = str(spec.log_path)
    return plistlib.dumps({
        "Label": LABEL,
        "ProgramArguments": spec.argv,
        "WorkingDirectory": spec.workdir,
        "EnvironmentVariables": spec.environment,
        "RunAtLoad": True,
        # Restarted after a failure (a dead engine exits 70, a crash), not after a clean stop.
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": 10,
        # launchd's default is 20 s before SIGKILL; the drain may take server.shutdown_grace_s.
        "ExitTimeOut": spec.stop_timeout_s,
        # Inference is latency-bound work: not throttled like a background daemon.
        "ProcessType": "Interactive",
        "StandardOutPath": log,
        "StandardErrorPath": log,
    }, fmt=plistlib.FMT_XML)


def argv_from_plist(data: bytes) -> list[str]:
    """The ``ProgramArguments`` of an installed LaunchAgent."""
    return [str(a) for a in plistlib.loads(data).get("ProgramArguments", [])]


# ---- systemd -------------------------------------------------------------------------------

def systemd_unit_path(home: Path, environ: Mapping[str, str]) -> Path:
    config = environ.get("XDG_CONFIG_HOME") or str(home / ".config")
    return Path(config) / "systemd" / "user" / UNIT_NAME


def systemd_log_path(home: Path, environ: Mapping[str, str]) -> Path:
    state = environ.get("XDG_STATE_HOME") or str(home / ".local" / "state")
    return Path(state) / "tandem" / "tandem.log"


_BARE = re.compile(r"[A-Za-z0-9_./:=@+,-]+")


def _no_newline(value: str, what: str) -> str:
    """``value``, which goes on one line of a unit file; a line break would end the setting
    there and start another (``ExecStartPre=``), so it is refused, naming ``what`` holds it
    (not the value: an environment variable may be a secret)."""
    if "\n" in value or "\r" in value:
        raise CommandError(f"{what} holds a line break, which a systemd unit file cannot hold: remove it and "
                           "install again")
    return value


def systemd_quote(arg: str, *, expand_vars: bool = True, what: str = "an argument of the server's command") -> str:
    """One word for ExecStart= / Environment=: ``%`` is a specifier and ``$`` a variable to
    systemd, so both are doubled; anything beyond plain characters is double-quoted."""
    arg = _no_newline(arg, what).replace("%", "%%")
    if expand_vars:
        arg = arg.replace("$", "$$")
    if _BARE.fullmatch(arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _path_value(path: str, what: str) -> str:
    """A path setting (WorkingDirectory=, StandardOutput=append:) is the rest of the line; only
    specifiers are expanded in it."""
    return _no_newline(path, what).replace("%", "%%")


def systemd_unit(spec: ServiceSpec) -> str:
    """The ``systemd --user`` unit (systemd.service(5))."""
    exec_start = " ".join(systemd_quote(a) for a in spec.argv)
    env = " ".join(systemd_quote(f"{k}={v}", expand_vars=False, what=f"the environment variable {k}")
                   for k, v in spec.environment.items())
    log = _path_value(str(spec.log_path), "the log path")
    return f"""\
# Tandem for this user, written by `tandem service install`; `tandem service uninstall` removes it.
[Unit]
Description=Tandem, a local OpenAI-compatible MLX server ({server_url(spec.host, spec.port)}/v1)
# Five failed starts within two minutes stop the restarts: see `tandem service logs`.
StartLimitIntervalSec=120
StartLimitBurst=5

[Service]
Type=exec
ExecStart={exec_start}
WorkingDirectory={_path_value(spec.workdir, "the working directory")}
Environment={env}
# A failure (the MLX engine died: status 70; a crash) starts a fresh process.
Restart=on-failure
RestartSec=2
# Status 2: models.yaml or the flags are wrong, and a restart cannot fix that.
RestartPreventExitStatus={EXIT_CONFIG_ERROR}
# SIGTERM drains: running requests get server.shutdown_grace_s, then their error event.
TimeoutStopSec={spec.stop_timeout_s}
StandardOutput=append:{log}
StandardError=inherit

[Install]
WantedBy=default.target
"""


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """A unit file as ``{section: {key: [values]}}`` (comments and blank lines dropped)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        if current is None or not sep or not key.strip():
            raise ValueError(f"line {number}: not a `Key=value` line inside a [Section]: {raw!r}")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def systemd_split(value: str, *, expand_vars: bool = True) -> list[str]:
    """The words of an ExecStart= / Environment= value written by ``systemd_quote``."""
    words = shlex.split(value, posix=True)
    words = [w.replace("%%", "%") for w in words]
    return [w.replace("$$", "$") for w in words] if expand_vars else words


def argv_from_unit(text: str) -> list[str]:
    """The ``ExecStart=`` command of an installed unit."""
    exec_start = parse_unit(text).get("Service", {}).get("ExecStart", [""])[-1]
    return systemd_split(exec_start)


def home_dir(environ: Mapping[str, str] | None = None) -> Path:
    """``$HOME`` (the user the service is for)."""
    environ = os.environ if environ is None else environ
    return Path(environ.get("HOME") or Path.home())
