"""Soak: huge tool definitions against a real `python -m app serve` process.

Four requests at once, each with a 5 MB ``tools[].function.description``, used to
take 2.6 GB (peak 4.6 GB, 4.0 GB kept) and seconds of tokenizer CPU before their
400. Every text that reaches the template now counts against the prompt-size
pre-check, so they are refused before tokenizing: the peak stays near the bodies'
own size and RSS settles back. Prints its figures; kept out of the default run:

    .venv/bin/python -m pytest tests/api/test_tool_soak.py -m slow -s
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.api.serving import server_process
from tests.vision.test_image_soak import MB, PeakRss

pytestmark = pytest.mark.slow


def tool_request(i: int) -> dict:
    description = f"tool {i}: " + "lorem ipsum dolor sit amet " * 190_000  # ~5 MB
    return {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}],
            "tools": [{"type": "function", "function": {"name": f"t{i}", "description": description}}]}


async def post_all(base: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        return await asyncio.gather(*(client.post("/v1/chat/completions", json=b) for b in bodies))


def test_huge_tool_descriptions_are_refused_before_they_cost_memory(tmp_path, tiny_model_dir):
    models = {"server": {"shutdown_grace_s": 1},
              "models": [{"name": "tiny", "local_path": str(tiny_model_dir), "params": {"mem": 16, "max_tokens": 2}}]}
    with server_process(tmp_path, models) as (proc, base):
        assert httpx.post(base + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}).status_code == 200
        bodies = [tool_request(i) for i in range(4)]
        size = len(json.dumps(bodies[0])) // MB
        time.sleep(1)
        with PeakRss(proc.pid) as rss:
            before = rss.now()
            started = time.monotonic()
            answers = asyncio.run(post_all(base, bodies))
            took = time.monotonic() - started
            time.sleep(3)
            after = rss.now()
    figures = {"body_mb": size, "before_mb": before // MB, "peak_mb": rss.peak // MB, "after_mb": after // MB,
               "took_s": round(took, 2)}
    print("\n4 x 5 MB tool descriptions:", figures)
    for r in answers:
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:200]
    assert took < 10, figures
    assert rss.peak - before < 600 * MB, figures
    assert after - before < 200 * MB, figures
