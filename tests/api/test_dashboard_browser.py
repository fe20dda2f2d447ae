"""The dashboard in a real browser: headless Chromium (Debian's ``chromium``, driven by
Playwright for Python; ``scripts/test.sh`` installs it when missing) against the demo
model and the embedded embedding model. The page shows the models, streams a playground
answer through /v1/chat/completions, loads and unloads the embedding model with its
buttons, and breaks no rule of its Content-Security-Policy. The screenshot is kept under
``test-artifacts/``."""

from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.api.serving import Served, serving
from tests.conftest import REPO

ARTIFACTS = REPO / "test-artifacts"


# Where a Mac keeps Chromium or Chrome (no apt there).
MAC_BROWSERS = ("/Applications/Chromium.app/Contents/MacOS/Chromium",
                "/Applications/Google Chrome.app/Contents/MacOS/Google Chrome")


def chromium() -> str | None:
    """The system's Chromium: $TANDEM_CHROMIUM, else ``chromium`` / ``chromium-browser`` on PATH,
    else a Mac's Chromium or Chrome."""
    found = (os.environ.get("TANDEM_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
             or next((p for p in MAC_BROWSERS if Path(p).exists()), None))
    return found if found and Path(found).exists() else None


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -e '.[test]')")
    path = chromium()
    if path is None:
        pytest.skip("no Chromium found (apt-get install chromium, or set TANDEM_CHROMIUM); scripts/test.sh installs it")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path, minilm_dir: Path) -> Iterator[Served]:
    models = {"server": {"shutdown_grace_s": 1}, "models": [
        {"name": "demo", "local_path": str(demo_model_dir),
         "params": {"mem": 64, "max_model_len": 2048, "temperature": 0.0, "max_tokens": 8}},
        {"name": "minilm", "role": "embedding", "local_path": str(minilm_dir)},
    ]}
    with serving(tmp_path_factory.mktemp("dashboard-browser"), yaml.safe_dump(models)) as s:
        yield s


def test_dashboard_in_chromium(browser, served: Served) -> None:  # type: ignore[no-untyped-def]
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": 1400, "height": 1200})
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(served.base_url + "/")

    demo, minilm = page.locator('tr[data-model="demo"]'), page.locator('tr[data-model="minilm"]')
    expect(demo.locator(".state")).to_have_text("loaded", timeout=10_000)
    expect(minilm.locator(".state")).to_have_text("on disk")
    expect(page.locator("#status")).to_have_text("live")

    # The playground: a streamed answer through the public API.
    page.locator("#pg-model").select_option("demo")
    page.locator("#pg-max-tokens").fill("3")
    page.locator("#pg-input").fill("Say hello.")
    page.locator("#pg-send").click()
    answer = page.locator(".msg.assistant.done")
    expect(answer).to_have_count(1, timeout=60_000)
    assert answer.locator(".answer").inner_text().strip(), answer.inner_text()
    expect(answer.locator(".meta")).to_contain_text("3 out")

    # The buttons: load the embedding model (held midway by a load listener on the MLX
    # thread, so the page shows the load in progress), then unload it.
    reading, release = threading.Event(), threading.Event()

    def hold(name: str, step) -> None:  # type: ignore[no-untyped-def]
        if name == "minilm" and step.phase == "loading weights" and not reading.is_set():
            reading.set()
            release.wait(30)

    served.state.registry.add_load_listener(hold)
    minilm.locator('button[data-action="load"]').click()
    try:
        assert reading.wait(30)
        expect(minilm.locator(".state .progress")).to_have_text("loading weights", timeout=10_000)
        expect(minilm.locator(".state")).to_contain_text("loading")
        expect(minilm.locator('button[data-action="load"]')).to_be_disabled()
    finally:
        release.set()
    expect(minilm.locator(".state")).to_have_text("loaded", timeout=60_000)
    assert served.state.registry.loaded("minilm") is not None
    minilm.locator('button[data-action="unload"]').click()
    expect(minilm.locator(".state")).to_have_text("on disk", timeout=30_000)
    assert served.state.registry.loaded("minilm") is None

    # The playground's request reached the request log over the event stream.
    expect(page.locator("#requests tbody tr", has_text="/v1/chat/completions")).to_have_count(1, timeout=10_000)
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
    assert not [p for p in problems if "Content Security Policy" in p or "Refused" in p], problems
    assert not problems, problems
    page.close()


def test_dashboard_asks_for_the_key_when_one_is_set(browser, tmp_path: Path, tiny_model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    from playwright.sync_api import expect

    models = {"server": {"shutdown_grace_s": 1, "api_key": "page-key"}, "models": [
        {"name": "tiny", "local_path": str(tiny_model_dir), "params": {"mem": 16, "max_tokens": 2}}]}
    with serving(tmp_path, yaml.safe_dump(models)) as s:
        page = browser.new_page()
        page.goto(s.base_url + "/ui")
        expect(page.locator("#status")).to_have_text("API key needed")
        expect(page.locator('tr[data-model="tiny"]')).to_have_count(0)
        page.locator("#key").fill("page-key")
        page.locator("#keyform button").click()
        expect(page.locator('tr[data-model="tiny"] .state')).to_have_text("loaded", timeout=10_000)
        expect(page.locator("#status")).to_have_text("live")
        assert page.evaluate("sessionStorage.getItem('tandem-api-key')") == "page-key"
        page.close()


def test_the_distributed_panel_shows_each_rank_host_and_health(browser, served: Served) -> None:  # type: ignore[no-untyped-def]
    # What rank 0 reports (a real control channel on loopback: rank 1 connected and
    # answering, rank 2 gone), drawn by the page's own renderer. A launch of three ranks
    # serving HTTP is tests/api/test_distributed_e2e.py's; its /health carries the same report.
    from app.engine.distributed.control import ControlClient, ControlServer
    from app.engine.distributed.distributed import Distributed, DistributedInfo
    from app.engine.worker import MLXWorker

    server = ControlServer("127.0.0.1", 3, "secret")
    clients: dict[int, ControlClient] = {}
    joining = [threading.Thread(target=lambda r=r: clients.__setitem__(
        r, ControlClient("127.0.0.1", server.port, r, "secret", timeout_s=10))) for r in (1, 2)]
    for t in joining:
        t.start()
    server.accept_all(10)
    for t in joining:
        t.join()
    dist = Distributed(DistributedInfo(3, 0, "ring", "tensor"), MLXWorker(), timeout_s=30, server=server)
    try:
        clients[2].close()
        deadline = time.monotonic() + 10
        while server.ranks()[1]["state"] != "lost" or server.ranks()[0]["ping_ms"] is None:
            assert time.monotonic() < deadline, server.ranks()
            time.sleep(0.05)
        report = json.loads(json.dumps(dist.health()))
    finally:
        dist.close()
        for c in clients.values():
            c.close()
    page = browser.new_page()
    page.goto(served.base_url + "/")
    page.locator('tr[data-model="demo"]').wait_for()
    # Drawn and read in one go: the next tick (no launch here) hides the panel again.
    shown = page.evaluate("""(d) => { renderDistributed(d);
        return { panel: !document.querySelector('#distributed-panel').classList.contains('hidden'),
                 launch: document.querySelector('#distributed-launch').innerText,
                 rows: [...document.querySelectorAll('#distributed tbody tr')].map((tr) =>
                   [...tr.children].map((td) => td.innerText)) }; }""", report)
    host = socket.gethostname()
    assert shown["panel"] and shown["launch"] == "3 ranks, ring backend, tensor parallel", shown
    assert [row[:4] for row in shown["rows"]] == [
        ["0", host, "127.0.0.1", "ok"], ["1", host, "127.0.0.1", "ok"],
        ["2", host, "127.0.0.1", "lost: rank 2 closed its control connection (its process ended)"]], shown
    assert shown["rows"][0][4] == "serves HTTP" and shown["rows"][1][5].endswith(" ms")
    page.close()
