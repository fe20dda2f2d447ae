"""The service definitions, generated and validated: the systemd --user unit with
`systemd-analyze verify` (where installed) and a parse of every line; the launchd plist with
plistlib against the keys and types launchd.plist(5) defines. Nothing is installed here, and HOME
is a temporary directory whenever the CLI runs."""

from __future__ import annotations

import os
import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from app.errors import CommandError
from app.service import units
from tests.conftest import REPO

# launchd.plist(5): the keys this service uses, and their types.
LAUNCHD_TYPES: dict[str, type | tuple[type, ...]] = {
    "Label": str, "ProgramArguments": list, "WorkingDirectory": str, "EnvironmentVariables": dict,
    "RunAtLoad": bool, "KeepAlive": (bool, dict), "ThrottleInterval": int, "ExitTimeOut": int, "ProcessType": str,
    "StandardOutPath": str, "StandardErrorPath": str,
}
KEEPALIVE_TYPES = {"SuccessfulExit": bool, "Crashed": bool, "NetworkState": bool, "PathState": dict,
                   "OtherJobEnabled": dict, "AfterInitialDemand": dict}
PROCESS_TYPES = {"Background", "Standard", "Adaptive", "Interactive"}
# systemd.unit(5), systemd.service(5), systemd.exec(5): the keys the unit may use, by section.
SYSTEMD_KEYS = {
    "Unit": {"Description", "Documentation", "StartLimitIntervalSec", "StartLimitBurst", "After", "Wants"},
    "Service": {"Type", "ExecStart", "WorkingDirectory", "Environment", "Restart", "RestartSec",
                "RestartPreventExitStatus", "TimeoutStopSec", "StandardOutput", "StandardError"},
    "Install": {"WantedBy"},
}


def spec(tmp_path: Path, **kw) -> units.ServiceSpec:
    values = dict(python=sys.executable, workdir=str(REPO), models_file=str(REPO / "models.yaml"),
                  host="127.0.0.1", port=8000, log_path=tmp_path / "logs" / "tandem.log",
                  env={"TANDEM_CACHE_DIR": str(tmp_path / "cache")})
    return units.ServiceSpec(**{**values, **kw})


HOSTILE = {"models_file": '/tmp/my models/100% "real" $HOME \\ models.yaml', "model": "a b", "no_vision": True}


@pytest.mark.parametrize("extra", [{}, HOSTILE], ids=["plain", "spaces-percent-dollar-quotes"])
def test_the_systemd_unit_parses_and_runs_what_was_asked(tmp_path, extra):
    s = spec(tmp_path, **extra)
    text = units.systemd_unit(s)
    sections = units.parse_unit(text)
    assert set(sections) == set(SYSTEMD_KEYS)
    for name, keys in sections.items():
        assert set(keys) <= SYSTEMD_KEYS[name], f"unknown keys in [{name}]: {set(keys) - SYSTEMD_KEYS[name]}"
        assert all(len(v) == 1 for v in keys.values())
    service = {k: v[0] for k, v in sections["Service"].items()}
    assert units.argv_from_unit(text) == s.argv  # the quoting round-trips
    assert s.argv[:4] == [sys.executable, "-m", "app", "serve"] and "--port" in s.argv
    assert service["Restart"] == "on-failure" and service["RestartPreventExitStatus"] == "2"
    assert service["StandardOutput"] == f"append:{tmp_path}/logs/tandem.log" and service["StandardError"] == "inherit"
    assert units.systemd_split(service["Environment"], expand_vars=False) == [
        "PYTHONUNBUFFERED=1", f"TANDEM_CACHE_DIR={tmp_path}/cache"]
    assert sections["Install"]["WantedBy"] == ["default.target"]
    assert "User" not in service and "Group" not in service  # a --user unit runs as its user


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
@pytest.mark.parametrize("extra", [{}, HOSTILE], ids=["plain", "spaces-percent-dollar-quotes"])
def test_systemd_analyze_verify_accepts_the_unit(tmp_path, extra):
    unit_dir = tmp_path / "unit"
    unit_dir.mkdir()
    path = unit_dir / units.UNIT_NAME
    path.write_text(units.systemd_unit(spec(tmp_path, **extra)))
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    r = subprocess.run(["systemd-analyze", "--user", "verify", str(path)], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "XDG_RUNTIME_DIR": str(runtime), "HOME": str(tmp_path)})
    # verify exits 0 even for unknown keys and bad values: it only warns, so any output is a failure.
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


def test_systemd_analyze_would_catch_a_mistake(tmp_path):
    """The check above is not vacuous: a misspelt key and a bad value are reported."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed")
    path = tmp_path / units.UNIT_NAME
    path.write_text(units.systemd_unit(spec(tmp_path)).replace("Restart=", "Restrt=").replace("Type=exec", "Type=x"))
    r = subprocess.run(["systemd-analyze", "--user", "verify", str(path)], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "XDG_RUNTIME_DIR": str(tmp_path)})
    assert "Unknown key 'Restrt'" in r.stderr and "Failed to parse service type" in r.stderr


def test_a_newline_never_reaches_a_unit_file(tmp_path):
    with pytest.raises(CommandError, match="line break"):
        units.systemd_unit(spec(tmp_path, models_file="/tmp/a\nExecStartPre=/bin/rm -rf ~"))


def test_a_line_break_in_a_passed_variable_is_one_line_naming_it_not_its_value(tmp_path):
    """It was a ValueError traceback quoting the value (HF_TOKEN-like values are secrets)."""
    with pytest.raises(CommandError) as err:
        units.systemd_unit(spec(tmp_path, env={"HF_HOME": "/tmp/secret\rExecStartPre=/bin/true"}))
    assert "HF_HOME" in err.value.message and "secret" not in err.value.message
    r = subprocess.run([sys.executable, "-m", "app", "service", "install", "--dry-run"], cwd=REPO, timeout=120,
                       capture_output=True, text=True, env={**os.environ, "HF_HOME": "/tmp/x\nExecStartPre=/bin/true"})
    if sys.platform == "darwin":  # a plist holds any text: launchd installs it
        return
    assert r.returncode == 1 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr and "HF_HOME" in r.stderr, r.stderr


@pytest.mark.parametrize("extra", [{}, HOSTILE], ids=["plain", "spaces-percent-dollar-quotes"])
def test_the_launchd_plist_has_the_keys_launchd_requires_with_their_types(tmp_path, extra):
    s = spec(tmp_path, **extra)
    data = units.launchd_plist(s)
    assert data.startswith(b'<?xml version="1.0" encoding="UTF-8"?>\n<!DOCTYPE plist')
    plist = plistlib.loads(data)
    # Required by launchd: a Label, and Program or ProgramArguments.
    assert plist["Label"] == units.LABEL == units.launch_agent_path(tmp_path).stem
    assert plist["ProgramArguments"] == s.argv and "Program" not in plist
    for key, value in plist.items():
        assert key in LAUNCHD_TYPES, f"{key} is not a key this service should use"
        assert isinstance(value, LAUNCHD_TYPES[key]), f"{key}: {type(value).__name__}"
    assert all(isinstance(a, str) for a in plist["ProgramArguments"])
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in plist["EnvironmentVariables"].items())
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}  # restarted after a failure only
    assert all(isinstance(v, KEEPALIVE_TYPES[k]) for k, v in plist["KeepAlive"].items())
    assert plist["ProcessType"] in PROCESS_TYPES
    for key in ("WorkingDirectory", "StandardOutPath", "StandardErrorPath"):
        assert Path(plist[key]).is_absolute()
    assert Path(plist["ProgramArguments"][0]).is_absolute() and os.access(plist["ProgramArguments"][0], os.X_OK)
    assert units.argv_from_plist(data) == s.argv
    if shutil.which("plutil"):  # on a Mac
        path = tmp_path / "agent.plist"
        path.write_bytes(data)
        assert subprocess.run(["plutil", "-lint", str(path)], capture_output=True).returncode == 0


def test_the_paths_are_the_users_own(tmp_path):
    home = tmp_path
    assert units.launch_agent_path(home) == home / "Library/LaunchAgents/com.tandem.server.plist"
    assert units.launchd_log_path(home) == home / "Library/Logs/Tandem/tandem.log"
    assert units.systemd_unit_path(home, {}) == home / ".config/systemd/user/tandem.service"
    assert units.systemd_log_path(home, {}) == home / ".local/state/tandem/tandem.log"
    xdg = {"XDG_CONFIG_HOME": "/x/config", "XDG_STATE_HOME": "/x/state"}
    assert units.systemd_unit_path(home, xdg) == Path("/x/config/systemd/user/tandem.service")
    assert units.systemd_log_path(home, xdg) == Path("/x/state/tandem/tandem.log")
    assert units.url_from_argv(["py", "--host", "0.0.0.0", "--port", "8123"]) == "http://127.0.0.1:8123"
    assert units.url_from_argv(["py", "--host", "::1", "--port", "9"]) == "http://[::1]:9"


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HOME": str(tmp_path / "home")}
    env.pop("XDG_CONFIG_HOME", None)
    env.pop("XDG_STATE_HOME", None)
    return subprocess.run([sys.executable, "-m", "app", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the systemd unit is Linux's")
def test_install_dry_run_pins_the_models_file_and_port_and_writes_nothing(tmp_path):
    models = tmp_path / "models.yaml"
    models.write_text("server: {port: 8123}\nmodels:\n  - name: a\n    builtin: smollm2-135m-instruct\n")
    (tmp_path / "home").mkdir()
    r = run_cli(tmp_path, "service", "install", "--dry-run", "--models-file", str(models))
    assert r.returncode == 0, r.stderr
    first, unit = r.stdout.split("\n", 1)
    assert first == f"# {tmp_path}/home/.config/systemd/user/tandem.service"
    argv = units.argv_from_unit(unit)
    assert argv[argv.index("--models-file") + 1] == str(models) and argv[argv.index("--port") + 1] == "8123"
    assert f"append:{tmp_path}/home/.local/state/tandem/tandem.log" in unit
    assert list((tmp_path / "home").iterdir()) == []

    models.write_text("models:\n  - name: a\n    builtin: smollm2-135m-instruct\n    params: {memm: 1}\n")
    bad = run_cli(tmp_path, "service", "install", "--models-file", str(models))
    assert bad.returncode == 2 and "models[0].params.memm" in bad.stderr and "Traceback" not in bad.stderr
    assert list((tmp_path / "home").iterdir()) == []
