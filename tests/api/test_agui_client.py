"""/v1/agui through AG-UI's official client: ``@ag-ui/client``'s ``HttpAgent`` under node.

The client reads SSE its own way (it splits on ``\\n\\n``, so it read nothing of the
``\\r\\n`` frames Tandem once sent); a Python reader would not notice. Each run goes
through ``tests/fixtures/agui_client/run.mjs``, which prints every event the client
hands its subscriber; the same request read raw over HTTP must give the same events.

The client is installed once, from the pinned ``package-lock.json`` beside the script,
into ``<tandem cache>/node/agui-client-<version>`` (``$TANDEM_CACHE_DIR`` moves it),
under a lock so parallel runs do not race. Without node or npm, or with no registry on
the first install, the tests skip and say why.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.api.serving import serving, tiny_yaml
from tests.api.sse_frames import parse_frames, read_stream
from tests.api.test_tools_e2e import FEW_SHOT, TOOLS
from tests.conftest import REPO

FIXTURE = REPO / "tests" / "fixtures" / "agui_client"
VERSION = json.loads((FIXTURE / "package.json").read_text())["dependencies"]["@ag-ui/client"]
Q = "What is the capital of France?"


def _install(target: Path) -> None:
    """``npm ci`` the pinned client into ``target``, atomically: a half-done install is never seen."""
    from app.engine.models.demo_model import exclusive_lock

    lock = (FIXTURE / "package-lock.json").read_bytes()
    stamp = hashlib.sha256(lock).hexdigest()
    marker = target / ".installed"
    if marker.is_file() and marker.read_text() == stamp:
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(target.parent / f".{target.name}.lock", None, what="@ag-ui/client"):
        if marker.is_file() and marker.read_text() == stamp:
            return  # another process installed it while this one waited
        partial = target.with_name(target.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        for name in ("package.json", "package-lock.json"):
            shutil.copy(FIXTURE / name, partial / name)
        cmd = ["npm", "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--cache", str(target.parent / "npm-cache")]
        try:
            done = subprocess.run(cmd, cwd=partial, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired:
            shutil.rmtree(partial, ignore_errors=True)
            pytest.skip(f"npm ci @ag-ui/client@{VERSION} took over 300 s: is the npm registry reachable?")
        if done.returncode != 0:
            shutil.rmtree(partial, ignore_errors=True)
            why = "\n".join([line for line in done.stderr.splitlines() if line.startswith("npm error")][:3])
            pytest.skip(f"could not install @ag-ui/client@{VERSION} (is the npm registry reachable?):\n{why}")
        (partial / ".installed").write_text(stamp)
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)


@pytest.fixture(scope="session")
def agui_client() -> Path:
    """The directory holding the pinned ``@ag-ui/client``'s node_modules."""
    from app.engine import cache_root

    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed: driving /v1/agui with @ag-ui/client needs node >= 18 and npm")
    major = subprocess.run(["node", "-p", "process.versions.node.split('.')[0]"], capture_output=True, text=True)
    if major.returncode != 0 or int(major.stdout) < 18:
        pytest.skip(f"@ag-ui/client needs node >= 18 (fetch); this node says {major.stdout.strip() or major.stderr}")
    target = cache_root() / "node" / f"agui-client-{VERSION}"
    _install(target)
    return target


def start_client(client_dir: Path, url: str, body: dict[str, Any]) -> subprocess.Popen[str]:
    """``run.mjs`` started on ``body``'s input; it prints a JSON line per event as the client sees it."""
    spec = {"url": url, **{k: body[k] for k in ("threadId", "runId", "messages", "tools", "forwardedProps")}}
    proc = subprocess.Popen(["node", str(FIXTURE / "run.mjs"), str(client_dir)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(spec))
    proc.stdin.close()
    return proc


def finish_client(proc: subprocess.Popen[str], seen: list[dict] | None = None) -> tuple[list[dict], dict]:
    """The events the client's subscriber saw (``seen`` already read), then ``{"result": ...}``
    (what ``runAgent`` resolved to) or ``{"failed": ...}`` (why it rejected)."""
    assert proc.stdout is not None and proc.stderr is not None
    # Read through the same buffered pipes as any readline() before (communicate() would skip
    # what they hold); the timer stands in for a timeout. stderr is a stack trace at most.
    killer = threading.Timer(120, proc.kill)
    killer.start()
    try:
        out, err = proc.stdout.read(), proc.stderr.read()
    finally:
        killer.cancel()
    assert proc.wait() == 0, err
    lines = [*(seen or []), *(json.loads(line) for line in out.splitlines())]
    return [line["event"] for line in lines[:-1]], lines[-1]


def run_client(client_dir: Path, url: str, body: dict[str, Any]) -> tuple[list[dict], dict]:
    """One whole ``HttpAgent.runAgent``: see ``finish_client``."""
    return finish_client(start_client(client_dir, url, body))


def run_to_result(client_dir: Path, url: str, body: dict[str, Any]) -> tuple[list[dict], dict]:
    """``run_client`` for a run that must succeed: its events and ``runAgent``'s result."""
    events, outcome = run_client(client_dir, url, body)
    assert "result" in outcome, outcome
    return events, outcome["result"]


def agui_input(messages: list[dict], tools: list[dict], max_tokens: int) -> dict[str, Any]:
    return {"threadId": "thread-1", "runId": "run-1", "state": {}, "context": [], "tools": tools,
            "forwardedProps": {"max_tokens": max_tokens, "temperature": 0},
            "messages": [{"id": f"m{i}", **m} for i, m in enumerate(messages)]}


def ag_ui_tools() -> list[dict]:
    """test_tools_e2e's tools, as AG-UI writes them."""
    functions: list[Any] = [t["function"] for t in TOOLS]
    return [{k: fn[k] for k in ("name", "description", "parameters")} for fn in functions]


def same_run(client_events: list[dict], raw: bytes) -> None:
    """The client delivered every event on the wire, in order, with the same content (ids aside:
    every run draws new message and tool call ids)."""
    wire = [f.json() for f in parse_frames(raw)]

    def strip(ev: dict) -> dict:
        return {k: v for k, v in ev.items() if k not in ("messageId", "toolCallId")}

    assert [strip(e) for e in client_events] == [strip(e) for e in wire]


def test_the_official_client_reads_a_whole_run(agui_client, demo_server):
    url = demo_server.base_url + "/v1/agui"
    body = agui_input([{"role": "user", "content": Q}], [], max_tokens=8)
    events, result = run_to_result(agui_client, url, body)
    assert result["version"] == VERSION
    types = [e["type"] for e in events]
    assert types[0] == "RUN_STARTED" and types[-1] == "RUN_FINISHED" and "RUN_ERROR" not in types, types
    text = "".join(e["delta"] for e in events if e["type"] == "TEXT_MESSAGE_CONTENT")
    assert text and types.count("TEXT_MESSAGE_START") == types.count("TEXT_MESSAGE_END") == 1
    # The client assembled the same text into its own message list.
    assert [(m["role"], m["content"]) for m in result["newMessages"]] == [("assistant", text)]
    same_run(events, read_stream(demo_server.base_url, "/v1/agui", body))


@pytest.mark.slow  # a sibling in the default suite covers the path
def test_the_official_client_reads_a_tool_call(agui_client, demo_server):
    body = agui_input(FEW_SHOT, ag_ui_tools(), max_tokens=40)
    events, result = run_to_result(agui_client, demo_server.base_url + "/v1/agui", body)
    types = [e["type"] for e in events]
    assert types[0] == "RUN_STARTED" and types[-1] == "RUN_FINISHED" and "RUN_ERROR" not in types, types
    start = types.index("TOOL_CALL_START")
    assert types[start + 1] == "TOOL_CALL_ARGS" and "TOOL_CALL_END" in types[start:], types
    assert events[start]["toolCallName"] == "get_weather"
    args = "".join(e["delta"] for e in events if e["type"] == "TOOL_CALL_ARGS")
    assert json.loads(args) == {"city": "Paris"}
    # The client turned the events into an assistant message carrying the call.
    calls = [tc for m in result["newMessages"] for tc in m.get("toolCalls", [])]
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (events[start]["toolCallId"], "get_weather", args)]
    same_run(events, read_stream(demo_server.base_url, "/v1/agui", body))


def test_the_official_client_reads_an_error_after_the_start(agui_client, tmp_path, tiny_model_dir):
    """The engine dies mid-run (a broken step on its thread, as in test_faults): the client gets
    every event up to it, then RUN_ERROR."""
    with serving(tmp_path, tiny_yaml(tiny_model_dir)) as srv:
        proc = start_client(agui_client, srv.base_url + "/v1/agui",
                            agui_input([{"role": "user", "content": Q}], [], max_tokens=1500))
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())  # the run has started, and the client read it
        assert first.get("event", {}).get("type") == "RUN_STARTED", first

        def broken_step() -> bool:
            raise RuntimeError("injected fault")

        srv.state.worker.add_stepper(broken_step, lambda exc: None)
        events, _ = finish_client(proc, [first])
    types = [e["type"] for e in events]
    assert types[-1] == "RUN_ERROR" and "RUN_FINISHED" not in types, types
    assert events[-1]["code"] == "engine_unavailable" and "injected fault" in events[-1]["message"]
    # Every block the run opened was closed before the error.
    assert types.count("TEXT_MESSAGE_START") == types.count("TEXT_MESSAGE_END")


def test_the_official_client_sees_a_refused_run_as_an_http_error(agui_client, demo_server):
    """A client mistake is a 4xx before any event, which the client reports with our error body."""
    body = agui_input([{"role": "user", "content": Q}], [], max_tokens=8)
    body["forwardedProps"]["temperature"] = 7
    events, outcome = run_client(agui_client, demo_server.base_url + "/v1/agui", body)
    assert events == [] and outcome["failed"].startswith("Error: HTTP 400: ")
    assert '"param":"forwardedProps.temperature"' in outcome["failed"]
