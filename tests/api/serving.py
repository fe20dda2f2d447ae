"""A private server for one test module: the tiny model, its own limits, `tandem serve`'s uvicorn set-up.

Tests of limits, security and metrics each need their own ``server`` settings,
so each builds its own state on the seeded tiny model (under a second) and
serves it exactly as ``tandem serve`` does: ``uvicorn_config`` (limits, backlog,
log routing) and ``DrainingServer`` (the shutdown drain), on a free loopback port.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.conftest import free_port, resolved_config


def tiny_yaml(model_dir: Path, server: dict | None = None, params: dict | None = None,
              vision: dict | None = None) -> str:
    """models.yaml for the tiny model; ``vision`` (the VLM's params) adds a proxy to a VLM that is
    not there: images are still read and checked, then replaced by a placeholder."""
    chat: dict[str, Any] = {"name": "tiny", "local_path": str(model_dir),
                            "params": {"mem": 16, "max_tokens": 2, "temperature": 0.0, **(params or {})}}
    models = [chat]
    if vision is not None:
        chat["capabilities"] = {"vision_mode": "proxy", "vision_proxy": {"model": "vlm"}}
        models.append({"name": "vlm", "role": "vision", "local_path": str(model_dir.parent / "no-such-vlm"),
                       "params": vision})
    # A short grace, so a test that leaves a request running does not hold teardown for 30 s.
    return yaml.safe_dump({"server": {"shutdown_grace_s": 1, **(server or {})}, "models": models})


@dataclass
class Served:
    base_url: str
    state: Any  # app.api.state.AppState
    server: Any  # app.cli.DrainingServer

    def post(self, path: str, json: Any = None, **kw: Any) -> httpx.Response:
        return httpx.post(self.base_url + path, json=json, timeout=kw.pop("timeout", 60), **kw)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return httpx.get(self.base_url + path, timeout=kw.pop("timeout", 60), **kw)


@contextlib.contextmanager
def serving(tmp_path: Path, yaml_text: str, log_level: str = "warning") -> Iterator[Served]:
    from app.cli import DrainingServer, uvicorn_config
    from app.main import build_state, create_app

    state = build_state(resolved_config(yaml_text, tmp_path))
    settings = state.config.server.model_copy(update={"port": free_port()})
    server = DrainingServer(uvicorn_config(create_app(state), settings, log_level), state)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
            time.sleep(0.02)
        yield Served(f"http://{settings.host}:{settings.port}", state, server)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        state.worker.stop()


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    """``r`` is ``status`` with OpenAI's error body (and ``code``, when given)."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if code is not None:
        assert err["code"] == code, err
    return err


@contextlib.contextmanager
def server_process(tmp: Path, models: dict, *, stop: str = "kill") -> Iterator[tuple[Any, str]]:
    """A real ``python -m app serve`` process on ``models`` (a models.yaml as a dict), for
    what only a separate process shows (RSS, signals). Yields the process and its base
    URL once /health answers; ``stop``: "kill" (SIGKILL) or "term" (SIGTERM, expecting exit 0)."""
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import REPO

    (tmp / "models.yaml").write_text(yaml.safe_dump(models))
    port = free_port()
    log = tmp / "server.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "app", "serve", "--models-file", str(tmp / "models.yaml"), "--port", str(port),
         "--log-level", "warning"],
        cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield proc, base
    finally:
        if stop == "term" and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, log.read_text()[-4000:]
        elif proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
