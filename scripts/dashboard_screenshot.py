"""The docs' screenshot of the dashboard (docs/assets/dashboard.png), made the same way each time.

A server in this process (so a load can be held midway) with the embedded demo model, a
second copy of it loaded quantized, the embedded embedding model and a hub model that is
not downloaded; a minute of traffic (chats that share a system prompt, so the prefix
cache hits, an embedding and a rerank request, the playground); then the second chat
model is loaded from the page and held halfway through its weights while headless
Chromium takes the picture, so the Models panel shows a load in progress.

    .venv/bin/python scripts/dashboard_screenshot.py [--out docs/assets/dashboard.png] [--seconds 60]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SYSTEM = "You are a concise assistant for a team that runs language models on their own Macs. " * 4
QUESTIONS = ["What is a prefix cache?", "Why quantize a model?", "What is TTFT?", "What is a KV cache?",
             "Why batch requests?", "What does unified memory change?"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "docs" / "assets" / "dashboard.png"))
    ap.add_argument("--seconds", type=float, default=60.0, help="how long to send traffic first")
    args = ap.parse_args()

    from playwright.sync_api import expect, sync_playwright

    from app.cli import DrainingServer, uvicorn_config
    from app.config.loader import load_models_file, resolve
    from app.engine.models.builtin_models import ensure_builtin
    from app.main import build_state, create_app

    demo = ensure_builtin("smollm2-135m-instruct", progress=False)
    chat = {"mem": 512, "max_tokens": 24, "temperature": 0.0, "cache_min_tokens": 16}
    models = {"server": {"shutdown_grace_s": 1}, "models": [
        {"name": "smollm2-135m-instruct", "local_path": str(demo), "params": chat},
        {"name": "smollm2-135m-q8", "local_path": str(demo), "params": {**chat, "quantization": "q8"}},
        {"name": "all-minilm-l6-v2", "role": "embedding", "builtin": "all-minilm-l6-v2"},
        {"name": "ministral-3-3b-reasoning", "hf_id": "mistralai/Ministral-3-3B-Reasoning-2512"},
    ]}
    tmp = Path(tempfile.mkdtemp(prefix="tandem-shot-"))
    (tmp / "models.yaml").write_text(yaml.safe_dump(models))
    state = build_state(resolve(load_models_file(tmp / "models.yaml"), source=str(tmp / "models.yaml"),
                                overrides={}))
    settings = state.config.server.model_copy(update={"port": _free_port()})
    server = DrainingServer(uvicorn_config(create_app(state), settings, "warning"), state)
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    base = f"http://127.0.0.1:{settings.port}"
    try:
        traffic(base, args.seconds)
        halfway, release = threading.Event(), threading.Event()

        def hold(name: str, step) -> None:  # type: ignore[no-untyped-def]
            if name == "smollm2-135m-q8" and step.phase == "loading weights" and 0 < step.done < step.total:
                halfway.set()
                release.wait(60)

        state.registry.add_load_listener(hold)
        with sync_playwright() as p:
            chromium = shutil.which("chromium") or shutil.which("chromium-browser")
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
            page = browser.new_page(viewport={"width": 1440, "height": 1200})
            page.goto(base + "/")
            page.locator("#pg-model").select_option("smollm2-135m-instruct")
            page.locator("#pg-temperature").fill("0")
            page.locator("#pg-max-tokens").fill("24")
            page.locator("#pg-input").fill("In one sentence, what is a local inference server?")
            page.locator("#pg-send").click()
            expect(page.locator(".msg.assistant.done")).to_have_count(1, timeout=120_000)
            page.locator('tr[data-model="smollm2-135m-q8"] button[data-action="load"]').click()
            assert halfway.wait(120), "the load did not get halfway"
            expect(page.locator('tr[data-model="smollm2-135m-q8"] .state')).to_contain_text("%", timeout=10_000)
            page.wait_for_timeout(1500)  # one more tick for the charts
            page.screenshot(path=args.out, full_page=True)
            release.set()
            browser.close()
        print(f"wrote {args.out}")
    finally:
        server.should_exit = True
        state.worker.stop()


def traffic(base: str, seconds: float) -> None:
    """Chats that share a system prompt (so the prefix cache hits), an embedding and a rerank."""
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=base, timeout=300) as client:
        client.post("/v1/embeddings", json={"model": "all-minilm-l6-v2", "input": QUESTIONS}).raise_for_status()
        client.post("/v1/rerank", json={"model": "all-minilm-l6-v2", "query": "memory",
                                        "documents": QUESTIONS}).raise_for_status()
        i = 0
        while time.monotonic() < deadline:
            client.post("/v1/chat/completions", json={
                "model": "smollm2-135m-instruct", "max_tokens": 8,
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]}).raise_for_status()
            i += 1


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


if __name__ == "__main__":
    main()
