#!/usr/bin/env python
"""Tandem benchmark: ratios measured side by side in one run, on one model.

    .venv/bin/python scripts/bench.py                 # the embedded demo model, CPU-sized
    .venv/bin/python scripts/bench.py --model-path ~/models/ministral-3b-4bit --profile full

It measures, in this order (one server at a time, so they never compete):
  1. raw mlx-lm `stream_generate` decode tokens/s (in this process);
  2. Tandem: single-stream decode tokens/s, aggregate tokens/s at each
     concurrency, p50/p99 inter-token latency at 8 streams, TTFT with a long
     system prompt cold and then cached, and peak RSS under a burst of long
     requests against weights + `mem`;
  3. `python -m mlx_lm.server` on the same model: aggregate tokens/s at the same
     concurrencies;
  4. vision captioning: first image vs the same image again (caption cache),
     on a tiny random Qwen2-VL (the real mlx-vlm path);
  5. priority: the time to first token of a chat while 3 Open WebUI background
     tasks (title, tags, follow-ups) are decoding, against the same chat alone;
  6. models: the time to first token of a model not loaded yet (load and
     prefill) against a loaded one, and the longest gap between the tokens of
     a running stream while another model loads, against its usual gap;
  7. embeddings: all-MiniLM-L6-v2 embeddings/s at batch 1 and 32 (in process);
  8. constrained: decode tokens/s with a JSON schema held by the grammar over
     free decoding, at 1 and 8 streams, and the schema compile time (cold, cached).
  9. disk: the prefix cache's tiers on a ~1,500-token system prompt: TTFT cold,
     from memory, and from disk only (after a restart), and the decode rate of
     running streams while prefixes are written to disk, against no disk tier.
 10. distributed: per-step time and tokens/s of one process against two ranks of
      mlx.launch on this machine, on seeded llamas (scripts/bench_distributed.py).
 11. embedding_jobs: the time to first token of a chat right after a client sent a
      512-input embeddings request (all-MiniLM-L6-v2) and hung up, against the same
      chat alone: an abandoned job must stop, not hold the engine thread.
 12. bodies: RSS after 100 requests whose body carries 0.9 MB of `{}` in a field
     the server ignores, each on its own connection, against RSS after 10: what
     a request leaves behind once answered (a plateau, not a climb).
 13. vision_cache: a native VLM (the tiny random Qwen2-VL, its processor opened to 448x448
     px = 256 image tokens) in process: turn 2's TTFT over turn 1's for a conversation
     that repeats turn 1's image (its KV from the prefix cache), the vision tower's time
     for the same image in a new conversation (another system prompt) over its first
     encode, and decode tok/s with both caches on over both off.
 14. pacing: the longest and the median gap between the tokens of a decoding stream
     while a long prompt is prefilled beside it, with prefill chunks sized by time
     (`prefill_step_ms` 250) against fixed `prefill_chunk_size` chunks (0).
 15. dashboard: the page's first paint on loopback (HTML, script and stylesheet fetched
     one after another, and Chromium's first contentful paint when a browser is found),
     single-stream decode tokens/s with a /ui/events client attached against none (5 s
     windows alternated within one run, the median of their ratios), and the server CPU
     each open page's stream costs.
 16. speculative: decode tokens/s with speculation over without, at 1 and 4 streams, for a
     code edit (prompt lookup), the same edit with the answer as `prediction`, and free
     chat; the acceptance rate per drafter and TTFT (scripts/bench_speculative.py).
 17. vision_native: Ministral 3 with its own eyes against Ministral 3 + a Qwen2-VL captioner
     (proxy), each its own server, on six drawn images: TTFT, memory, answer agreement
     (scripts/bench_vision_native.py; `--profile full`: the real models from the hub; `cpu`:
     tiny random ones, the mechanics only).
 18. engine: Tandem's decode step against mlx-lm's BatchGenerator on this model (single-stream
     decode, 8-stream aggregate, in process); host overhead where the device is fast (tiny
     512-token-vocabulary models streamed over HTTP at 1, 8 and 32 streams against
     BatchGenerator in a loop, and mlx_lm.server); turn 2's TTFT over turn 1's on a hybrid
     model; rows admitted per MB of KV budget on a Qwen3.5-shaped model, by the per-layer
     accounting against the old one (scripts/bench_engine.py).
 19. decisions: 20 predicate questions about one ~1,000-token input against one question
     about it, each request in its own cache scope: the input is read once per request
     (scripts/bench_decisions.py).
 20. breakpoints: an agent's ~3,000-token system prompt marked with cache_control on
     /v1/messages, then unrelated traffic filling the prefix cache twice, then the agent's
     next request: its TTFT over the first one's; unmarked as the control
     (scripts/bench_breakpoints.py).
and prints every ratio with its target. `--only NAME ...` runs some sections. Sizes come from --profile: `cpu`
keeps a 2-core CPU run to minutes; `full` uses the sizes of the targets
(1,500-token system prompt, 16 x 2k-token requests).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PROFILES = {
    "cpu": {"decode_tokens": 32, "concurrency": [1, 4, 8], "stream_tokens": 16, "system_tokens": 300,
            "rss_requests": 8, "rss_prompt_tokens": 256, "rss_max_tokens": 8, "mem": 256,
            "disk_prefix_tokens": 1500, "write_streams": 4, "write_stream_tokens": 96, "write_rounds": 2,
            "pacing_prompt_tokens": 600, "pacing_stream_tokens": 64,
            "spec_file_tokens": 250, "spec_answer_tokens": 160, "spec_chat_tokens": 64,
            "step_tokens": (24, 12), "step_rounds": 4, "host_tokens": 128, "host_rounds": 5, "turn_words": 1700,
            "turn_rounds": 3},
    "full": {"decode_tokens": 256, "concurrency": [1, 4, 8, 16], "stream_tokens": 128, "system_tokens": 1500,
             "rss_requests": 16, "rss_prompt_tokens": 2048, "rss_max_tokens": 64, "mem": 4096,
             "disk_prefix_tokens": 1500, "write_streams": 8, "write_stream_tokens": 512, "write_rounds": 2,
             "pacing_prompt_tokens": 8000, "pacing_stream_tokens": 256,
             "spec_file_tokens": 1500, "spec_answer_tokens": 1200, "spec_chat_tokens": 256,
             "step_tokens": (256, 128), "step_rounds": 5, "host_tokens": 512, "host_rounds": 5, "turn_words": 1700,
             "turn_rounds": 5},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} not ready")


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource  # macOS: no /proc; fall back to ps

    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return int(out or 0) / 1024 if out else float(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024


async def one_stream(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """Streams one chat completion; returns token timings (one SSE content chunk ~ one token)."""
    t0 = time.perf_counter()
    stamps: list[float] = []
    async with client.stream("POST", url, json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            for c in chunk.get("choices", []):
                if (c.get("delta") or {}).get("content"):
                    stamps.append(time.perf_counter())
    ttft = stamps[0] - t0 if stamps else float("nan")
    itl = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"ttft": ttft, "tokens": len(stamps), "itl": itl, "end": time.perf_counter(), "start": t0,
            "stamps": stamps}


async def concurrent(base: str, model: str, n: int, max_tokens: int, prompt: str = "Tell me a long story.",
                     **extra: Any) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0.8, "top_p": 1.0, **extra}
    async with httpx.AsyncClient(timeout=3600) as client:
        url = base + "/v1/chat/completions"
        results = await asyncio.gather(*(one_stream(client, url, body) for _ in range(n)))
    start = min(r["start"] for r in results)
    end = max(r["end"] for r in results)
    tokens = sum(r["tokens"] for r in results)
    itl = [x for r in results for x in r["itl"]]
    return {"tok_s": tokens / (end - start), "tokens": tokens, "itl": itl,
            "decode_tok_s": statistics.mean(1 / statistics.mean(r["itl"]) for r in results if r["itl"])}


def raw_decode(model_path: str, tokens: int) -> float:
    from mlx_lm import load, stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tok = load(model_path)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me a long story."}], add_generation_prompt=True)
    sampler = make_sampler(0.8)
    for _ in stream_generate(model, tok, prompt, max_tokens=4, sampler=sampler):
        pass  # warm up
    last = None
    for response in stream_generate(model, tok, prompt, max_tokens=tokens, sampler=sampler):
        last = response
    assert last is not None
    return last.generation_tps


def start(cmd: list[str], health: str) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    wait_ready(health, proc)
    return proc


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def system_prompt(tokens: int) -> str:
    # ~1 token per word for plain English with this vocabulary; measured below.
    words = ("You are a careful assistant who answers briefly and cites the rules. " * (tokens // 12 + 1)).split()
    return " ".join(words[:tokens])


def bench_ttft(base: str, model: str, sys_tokens: int) -> tuple[float, float, int]:
    sysmsg = system_prompt(sys_tokens)
    body = lambda q: {"model": model, "max_tokens": 1, "temperature": 0,  # noqa: E731
                      "messages": [{"role": "system", "content": sysmsg}, {"role": "user", "content": q}]}
    url = base + "/v1/chat/completions"
    t0 = time.perf_counter()
    httpx.post(url, json=body("What is rule one?"), timeout=3600).raise_for_status()
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    r2 = httpx.post(url, json=body("What is rule two?"), timeout=3600).json()
    warm = time.perf_counter() - t0
    return cold, warm, r2["usage"]["prompt_tokens_details"]["cached_tokens"]


async def rss_burst(base: str, model: str, pid: int, n: int, prompt_tokens: int, max_tokens: int) -> float:
    peak = rss_mb(pid)
    done = asyncio.Event()

    async def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, rss_mb(pid))
            await asyncio.sleep(0.05)

    sampler = asyncio.create_task(sample())
    prompts = [system_prompt(prompt_tokens) + f" Request {i}." for i in range(n)]
    async with httpx.AsyncClient(timeout=7200) as client:
        await asyncio.gather(*(client.post(base + "/v1/chat/completions", json={
            "model": model, "messages": [{"role": "user", "content": p}], "max_tokens": max_tokens}) for p in prompts))
    done.set()
    await sampler
    return peak


def weights_mb(model_path: str) -> float:
    return sum(f.stat().st_size for f in Path(model_path).glob("*.safetensors")) / 2**20


def bench_vision() -> tuple[float, float]:
    from PIL import Image

    sys.path.insert(0, str(REPO / "tests"))
    from concurrent.futures import ThreadPoolExecutor

    from fixtures.tiny_vlm import build_tiny_qwen2_vl

    from app.vision.cache import CaptionCache
    from app.vision.captioner import MlxVlmCaptioner
    from app.vision.images import ImagePolicy
    from app.vision.proxy import VisionProxy

    tmp = Path(tempfile.mkdtemp())
    path = build_tiny_qwen2_vl(tmp / "vlm")
    pool = ThreadPoolExecutor(1)
    captioner = MlxVlmCaptioner(str(path), pool, max_tokens=16)
    captioner.load()
    proxy = VisionProxy(captioner, CaptionCache(64), ImagePolicy())
    import base64
    import io

    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 30, 90)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]

    async def timed():
        t0 = time.perf_counter()
        await proxy.rewrite(msgs)
        return time.perf_counter() - t0

    first = asyncio.run(timed())
    repeat = asyncio.run(timed())
    return first, repeat


def bench_vision_cache(rounds: int = 10, decode_tokens: int = 160) -> dict[str, float]:
    """The prefix cache and the vision-feature cache on a native VLM, in process (section 13's figures)."""
    import numpy as np
    from PIL import Image

    sys.path.insert(0, str(REPO / "tests"))
    from fixtures.tiny_vlm import build_tiny_qwen2_vl

    from app.config.schema import ChatParams
    from app.engine.models.vlm import VlmEngine, load_vlm
    from app.engine.types import GenerationRequest
    from app.engine.worker import MLXWorker
    from app.specs import engine_params, load_params

    side = 448
    path = build_tiny_qwen2_vl(Path(tempfile.mkdtemp()) / "vlm")
    pre = json.loads((path / "preprocessor_config.json").read_text())
    (path / "preprocessor_config.json").write_text(json.dumps({**pre, "max_pixels": side * side}))
    worker = MLXWorker()
    worker.start()
    try:
        loaded = worker.submit(lambda: load_vlm(str(path), load_params(ChatParams()), name="bench-vlm",
                                                max_pixels=side * side, min_pixels=28 * 28, max_images=2)).result()
        # Both caches on (the prefix cache in memory only: a bench writes nothing under the
        # user's cache directory), against neither.
        settings = {"mem": 64, "max_num_seqs": 2, "prefill_chunk_size": 512, "prompt_cache_disk_mb": 0}
        on = VlmEngine(worker, loaded, engine_params(ChatParams(**settings)), feature_cache_bytes=64 * 2**20)
        off = VlmEngine(worker, loaded, engine_params(ChatParams(**settings, prompt_cache="off")),
                        feature_cache_bytes=0)
        rng = np.random.default_rng(0)
        photo = Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8))

        def user(text: str, image: bool = True) -> dict:
            parts = [{"type": "image"}] if image else []
            return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}

        cached: list[int] = []  # each request's cached_tokens, in order

        async def timed(engine: VlmEngine, messages: list[dict], max_tokens: int) -> tuple[float, float, str]:
            """(TTFT, decode tok/s after the first token, text)."""
            n_images = sum(1 for m in messages if isinstance(m["content"], list)
                           for p in m["content"] if p.get("type") == "image")
            prompt = engine.prompts.build(engine.prompts.render(messages), [photo] * n_images)
            t0, first, n, text = time.perf_counter(), None, 0, []
            async for d in engine.stream(GenerationRequest(prompt, max_tokens=max_tokens)):
                if first is None:
                    first = time.perf_counter()
                n += 1
                text.append(d.text)
                if d.finish_reason is not None:
                    cached.append(d.cached_tokens)
            end = time.perf_counter()
            assert first is not None
            return first - t0, (n - 1) / (end - first) if n > 1 else 0.0, "".join(text)

        def encode_s(engine: VlmEngine) -> float:
            return engine.stats().vision_encode_s

        asyncio.run(timed(off, [user("Warm up.")], 2))  # first-call costs out of the figures
        turn1 = [user("What is in this picture?")]
        e0 = encode_s(on)
        ttft1, _, answer = asyncio.run(timed(on, turn1, 8))
        first_encode = encode_s(on) - e0
        turn2 = turn1 + [{"role": "assistant", "content": answer}, user("And what colours are there?", False)]
        ttft2, _, _ = asyncio.run(timed(on, turn2, 8))
        turn2_cached = cached[-1]
        turn2_tokens = len(on.prompts.build(on.prompts.render(turn2), [photo]).tokens)
        e1 = encode_s(on)
        # Another system prompt: the new conversation shares no prefix with turn 1 before the
        # image, so its features come from the vision-feature cache, not its KV from the prefix cache.
        new = [{"role": "system", "content": "You describe images for people who cannot see them."},
               user("Describe this image in detail.")]
        ttft_new, _, _ = asyncio.run(timed(on, new, 8))
        repeat_encode = encode_s(on) - e1
        ttft_new_off, _, _ = asyncio.run(timed(off, new, 8))
        speeds: dict[str, list[float]] = {"on": [], "off": []}
        pair = [("on", on), ("off", off)]
        for r in range(rounds):  # alternated, either first in turn, medians: a busy machine drifts
            for label, engine in pair if r % 2 == 0 else pair[::-1]:
                speeds[label].append(asyncio.run(timed(engine, turn1, decode_tokens))[1])
        image_tokens = next(iter(on.prompts.build(on.prompts.render(turn1), [photo]).images)).length
    finally:
        worker.stop()
    return {"ttft1": ttft1, "ttft2": ttft2, "first_encode": first_encode, "repeat_encode": repeat_encode,
            "ttft_new": ttft_new, "ttft_new_off": ttft_new_off, "image_tokens": image_tokens,
            "turn2_cached": turn2_cached, "turn2_tokens": turn2_tokens,
            "decode_on": statistics.median(speeds["on"]), "decode_off": statistics.median(speeds["off"]),
            # Each round's pair side by side: drift between rounds cancels out.
            "decode_ratio": statistics.median(a / b for a, b in zip(speeds["on"], speeds["off"], strict=True))}


def ask(base: str, model: str, system: str, question: str) -> tuple[float, int]:
    """Seconds to a one-token answer (the time to first token) and the cached prompt tokens."""
    t0 = time.perf_counter()
    r = httpx.post(base + "/v1/chat/completions", timeout=3600, json={
        "model": model, "max_tokens": 1, "temperature": 0,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def disk_tier(base: str) -> dict:
    return httpx.get(base + "/health", timeout=30).json()["engine"]["prompt_cache_tiers"].get("disk", {})


def wait_for_writes(base: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while disk_tier(base).get("pending", 0) and time.monotonic() < deadline:
        time.sleep(0.1)


def bench_disk(serve, model: str, prof: dict) -> list[str]:
    """TTFT from each tier on a long system prompt, and the disk writes' cost on decoding."""
    tokens = prof["disk_prefix_tokens"]
    system = system_prompt(tokens)
    cache_dir = tempfile.mkdtemp(prefix="tandem-bench-disk-")
    disk = {"prompt_cache_disk_mb": 16384, "prompt_cache_disk_dir": cache_dir}
    proc, base = serve(**disk)
    try:
        # A long prefill of its own first, so "cold" is the prefill and not the first use of its kernels.
        ask(base, model, system.replace("careful", "cheerful"), "Hello?")
        wait_for_writes(base)
        cold, _ = ask(base, model, system, "What is rule one?")
        memory, from_memory = ask(base, model, system, "What is rule two?")
        wait_for_writes(base)
    finally:
        stop(proc)  # SIGTERM: queued writes finish first
    proc, base = serve(**disk)
    try:
        ask(base, model, "You are brief.", "Hello?")
        wait_for_writes(base)
        from_disk_s, from_disk = ask(base, model, system, "What is rule three?")
        hits = disk_tier(base).get("hits", 0)
    finally:
        stop(proc)
    print(f"TTFT ~{tokens}-token system prompt: cold {cold:.2f}s, memory tier {memory:.3f}s ({from_memory} cached), "
          f"after a restart from disk {from_disk_s:.3f}s ({from_disk} cached, {hits} disk hit)")
    lines = [f"TTFT from disk after a restart / cold (~{tokens}-token prefix): {from_disk_s:.3f}s / {cold:.2f}s = "
             f"{from_disk_s / cold:.3f}   (target <= 0.1)",
             f"TTFT from memory / cold (~{tokens}-token prefix): {memory:.3f}s / {cold:.2f}s = "
             f"{memory / cold:.3f}"]
    try:
        return lines + bench_disk_writes(serve, model, prof, system, disk)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)  # gigabytes of KV


def bench_disk_writes(serve, model: str, prof: dict, system: str, disk: dict) -> list[str]:
    """Decode tok/s of running streams while other requests each cache a new prefix-long
    conversation: with the disk tier (each one a write) against without, two servers
    measured in turns so that drift on a shared machine hits both."""
    # Room for the streams and a prefix-long request beside them (admission counts each row as wide as the widest).
    mem = max(prof["mem"], 1024)
    servers = {"with": serve(mem=mem, **disk), "without": serve(mem=mem)}
    rates: dict[str, list[float]] = {"with": [], "without": []}
    try:
        for _, base in servers.values():
            ask(base, model, system, "Warm up.")  # the prefix in memory (from disk, where there is one)
        for round_ in range(prof["write_rounds"]):
            for label, (_, base) in servers.items():
                before = disk_tier(base).get("writes", 0)
                rates[label].append(decode_while_caching(base, model, prof, system, f"round {round_}"))
                if label == "with":
                    wait_for_writes(base)
                    print(f"  {disk_tier(base).get('writes', 0) - before} prefixes written meanwhile")
    finally:
        for proc, _ in servers.values():
            stop(proc)
    on, off = statistics.median(rates["with"]), statistics.median(rates["without"])
    print(f"decode tok/s per stream, {prof['write_streams']} streams, while prefixes are cached: with disk writes "
          f"{', '.join(f'{r:.2f}' for r in rates['with'])}; without {', '.join(f'{r:.2f}' for r in rates['without'])}")
    return [f"decode rate while writing prefixes to disk / without: {on:.2f} / {off:.2f} tok/s = {on / off:.3f}"
            "   (target >= 0.95)"]


def decode_while_caching(base: str, model: str, prof: dict, system: str, tag: str) -> float:
    """Mean decode tok/s of streams while, one after another, requests with the cached system
    prompt and a new question (never asked before: ``tag``) each store a new conversation."""
    async def run() -> list[dict]:
        async with httpx.AsyncClient(timeout=3600) as client:
            body = {"model": model, "temperature": 0.8, "max_tokens": prof["write_stream_tokens"],
                    "messages": [{"role": "user", "content": "Tell me a long story."}]}
            url = base + "/v1/chat/completions"
            streams = [asyncio.create_task(one_stream(client, url, body)) for _ in range(prof["write_streams"])]
            i = 0
            while not all(s.done() for s in streams):
                await asyncio.to_thread(ask, base, model, system, f"Question number {i}, {tag}?")
                i += 1
            return await asyncio.gather(*streams)

    results = asyncio.run(run())
    return statistics.mean(1 / statistics.mean(r["itl"]) for r in results if r["itl"])


OPEN_WEBUI_HISTORY = (
    "USER: I am planning a week in Lisbon in May. What neighbourhoods should I stay in, and is it easy "
    "to get around without a car?\nASSISTANT: Alfama, Baixa and Principe Real are central and walkable; "
    "trams, the metro and trains cover the rest, so a car is more trouble than help."
)
# Open WebUI's own task prompts, shortened: each starts "### Task:", which makes it background work.
OPEN_WEBUI_TASKS = [
    "### Task:\nGenerate a concise, 3-5 word title with an emoji summarizing the chat history.\n"
    '### Output:\nJSON format: { "title": "your concise title here" }\n### Chat History:\n<chat_history>\n'
    + OPEN_WEBUI_HISTORY + "\n</chat_history>",
    "### Task:\nGenerate 1-3 broad tags categorizing the main themes of the chat history.\n"
    '### Output:\nJSON format: { "tags": ["tag1", "tag2", "tag3"] }\n### Chat History:\n<chat_history>\n'
    + OPEN_WEBUI_HISTORY + "\n</chat_history>",
    "### Task:\nSuggest 3-5 relevant follow-up questions the user might naturally ask next.\n"
    '### Output:\nJSON format: { "follow_ups": ["Question 1?", "Question 2?"] }\n### Chat History:\n'
    "<chat_history>\n" + OPEN_WEBUI_HISTORY + "\n</chat_history>",
]


async def bench_priority(base: str, model: str) -> tuple[float, float]:
    """TTFT of a chat alone, then of a similar chat while 3 background tasks decode."""
    url = base + "/v1/chat/completions"

    def chat(question: str) -> dict:
        return {"model": model, "max_tokens": 1, "temperature": 0, "messages": [
            {"role": "user", "content": question}]}

    async with httpx.AsyncClient(timeout=3600) as client:
        await one_stream(client, url, chat("Hello, are you there?"))  # warm up
        alone = (await one_stream(client, url, chat("What should I pack for a week of walking in Lisbon?")))["ttft"]
        decoding = [asyncio.Event() for _ in OPEN_WEBUI_TASKS]

        async def task(prompt: str, started: asyncio.Event) -> None:
            # Streamed, so the bench sees when each is decoding; Open WebUI sends these unstreamed,
            # which the engine schedules the same way. No max_tokens: the model's default, as Open WebUI.
            body = {"model": model, "temperature": 0, "stream": True,
                    "messages": [{"role": "user", "content": prompt}]}
            async with client.stream("POST", url, json=body) as r:
                async for line in r.aiter_lines():
                    if '"content":"' in line and '"content":""' not in line:
                        started.set()

        tasks = [asyncio.create_task(task(p, e)) for p, e in zip(OPEN_WEBUI_TASKS, decoding)]
        await asyncio.gather(*(e.wait() for e in decoding))
        busy = (await one_stream(client, url, chat("What should I pack for a week of hiking in Madeira?")))["ttft"]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return alone, busy


async def bench_pacing(base: str, model: str, prof: dict) -> dict[str, float]:
    """Gaps between a decoding stream's tokens while a long prompt is prefilled beside it
    (from that prompt's submission to its first token), and how long that prefill took."""
    url = base + "/v1/chat/completions"

    def chat(content: str, max_tokens: int) -> dict:
        return {"model": model, "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": content}]}

    async with httpx.AsyncClient(timeout=3600) as client:
        await one_stream(client, url, chat("Hello, are you there?", 2))  # warm up
        stamps: list[float] = []
        decoding = asyncio.Event()

        async def stream() -> None:
            body = {**chat("Tell me a long story.", prof["pacing_stream_tokens"]), "stream": True}
            async with client.stream("POST", url, json=body) as r:
                async for line in r.aiter_lines():
                    if '"content":"' in line and '"content":""' not in line:
                        stamps.append(time.perf_counter())
                        decoding.set()

        task = asyncio.create_task(stream())
        await decoding.wait()
        long = await one_stream(client, url, chat(system_prompt(prof["pacing_prompt_tokens"]), 1))
        await task
    begin, end = long["start"], long["start"] + long["ttft"]
    gaps = [b - a for a, b in zip(stamps, stamps[1:]) if b > begin and a < end]
    return {"max_gap": max(gaps), "p50_gap": statistics.median(gaps), "prefill_s": long["ttft"]}


async def bench_models(base: str, loaded: str, cold: str) -> dict[str, float]:
    """TTFT of a loaded model, then of one that must load first; then the gaps of a
    stream on the loaded model while a third copy loads."""
    url = base + "/v1/chat/completions"
    body = lambda m, n=1: {"model": m, "max_tokens": n, "temperature": 0,  # noqa: E731
                           "messages": [{"role": "user", "content": "Name three rivers."}]}
    async with httpx.AsyncClient(timeout=3600) as client:
        await one_stream(client, url, body(loaded))  # warm up
        warm = (await one_stream(client, url, body(loaded)))["ttft"]
        first = (await one_stream(client, url, body(cold)))["ttft"]
        stream = asyncio.create_task(one_stream(client, url, body(loaded, 400)))
        await asyncio.sleep(2)  # decoding by now
        started = time.perf_counter()
        await one_stream(client, url, body(cold + "-again"))  # a load while the stream runs
        load_window = (started, time.perf_counter())
        res = await stream
    stamps, gaps = [res["start"] + res["ttft"]], res["itl"]
    for gap in gaps:
        stamps.append(stamps[-1] + gap)
    during = [g for t, g in zip(stamps[1:], gaps) if load_window[0] <= t <= load_window[1] + 0.5]
    return {"ttft_loaded": warm, "ttft_cold": first, "gap_p50": statistics.median(gaps) if gaps else float("nan"),
            "gap_max_during_load": max(during) if during else float("nan")}


# A story in JSON: a long free string after a short bounded one, as structured answers go.
# (Not minLength: a counted repetition of thousands makes every mask slow, which measures the schema.)
STORY_FORMAT = {"type": "json_schema", "json_schema": {"name": "story", "schema": {
    "type": "object", "properties": {"title": {"type": "string", "maxLength": 40}, "story": {"type": "string"}},
    "required": ["title", "story"]}}}
# pydantic-ai's output schema for a small model: enums in $defs, booleans, bounded strings, a range.
COMPILE_SCHEMA = {
    "$defs": {"Sky": {"enum": ["clear", "cloudy", "rain"], "type": "string"}},
    "properties": {"city": {"maxLength": 40, "type": "string"}, "sky": {"$ref": "#/$defs/Sky"},
                   "warm": {"type": "boolean"}, "celsius": {"maximum": 60, "minimum": -60, "type": "number"},
                   "notes": {"items": {"maxLength": 80, "type": "string"}, "maxItems": 5, "type": "array"}},
    "required": ["city", "sky", "warm", "celsius"], "title": "Weather", "type": "object",
}


def bench_compile(model_path: str) -> dict[str, float]:
    """Schema compile times on the model's tokenizer: its one-time setup, a cold compile, a cached one."""
    from mlx_lm.utils import load_tokenizer

    from app.engine.constrain.constraints import JsonSchema
    from app.engine.constrain.grammar import compiler_for

    tokenizer = load_tokenizer(Path(model_path))
    t0 = time.perf_counter()
    compiler = compiler_for(tokenizer)
    t1 = time.perf_counter()
    compiler.compile(JsonSchema(COMPILE_SCHEMA))
    t2 = time.perf_counter()
    compiler.compile(JsonSchema(COMPILE_SCHEMA))
    t3 = time.perf_counter()
    return {"setup_s": t1 - t0, "cold_ms": (t2 - t1) * 1000, "cached_ms": (t3 - t2) * 1000}


async def bench_embedding_jobs(base: str, model: str, embedder: str) -> tuple[float, float]:
    """TTFT of a chat alone, then of one sent right after a 512-input embeddings request
    whose client gave up once it was running. Medians of three each."""
    sys.path.insert(0, str(REPO / "scripts"))
    from bench_embeddings import sentences

    url = base + "/v1/chat/completions"
    body = lambda q: {"model": model, "max_tokens": 1, "temperature": 0,  # noqa: E731
                      "messages": [{"role": "user", "content": q}]}
    questions = ["What should I pack for a week of walking in Lisbon?", "Name three rivers in France.",
                 "How do I boil an egg?"]
    async with httpx.AsyncClient(timeout=3600) as client:
        await one_stream(client, url, body("Hello, are you there?"))  # warm up
        await client.post(base + "/v1/embeddings", json={"model": embedder, "input": "warm up"})
        alone = [(await one_stream(client, url, body(q)))["ttft"] for q in questions]
        busy = []
        for i, q in enumerate(questions):
            job = asyncio.create_task(client.post(base + "/v1/embeddings", json={
                "model": embedder, "input": sentences(512, seed=i)}))
            await asyncio.sleep(2.0)  # tokenized and running by now
            job.cancel()  # the client hangs up
            await asyncio.gather(job, return_exceptions=True)
            busy.append((await one_stream(client, url, body(q)))["ttft"])
    return statistics.median(alone), statistics.median(busy)



def bench_bodies(base: str, model: str, pid: int, total: int = 100, early: int = 10) -> tuple[float, float]:
    """RSS after ``early`` and after ``total`` chat requests, each on a new connection, each with
    0.9 MB of ``{}`` in an ignored field: a body must not outlive its request."""
    ignored = [{}] * 225_000  # ~0.9 MB as JSON, a quarter of a million objects once parsed
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                       "temperature": 0, "x": ignored}).encode()
    after: dict[int, float] = {}
    for i in range(1, total + 1):
        httpx.post(base + "/v1/chat/completions", content=body, timeout=600,
                   headers={"content-type": "application/json"}).raise_for_status()
        if i in (early, total):
            time.sleep(0.5)  # the connection's close is handled
            after[i] = rss_mb(pid)
    return after[early], after[total]


def page_fetch_ms(base: str, runs: int = 20) -> float:
    """The dashboard's three files fetched one after another on one connection (median ms)."""
    times = []
    with httpx.Client(base_url=base, timeout=30) as client:
        for _ in range(runs):
            t0 = time.perf_counter()
            for path in ("/", "/ui/static/app.js", "/ui/static/app.css"):
                client.get(path).raise_for_status()
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def browser_paint_ms(base: str, runs: int = 5) -> float | None:
    """Chromium's first contentful paint of the page (median ms), or None without a browser."""
    chromium = os.environ.get("TANDEM_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return None
    if chromium is None:
        return None
    paints = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        for _ in range(runs):
            page = browser.new_page()
            page.goto(base + "/", wait_until="load")
            page.wait_for_function("performance.getEntriesByName('first-contentful-paint').length > 0")
            paints.append(page.evaluate("performance.getEntriesByName('first-contentful-paint')[0].startTime"))
            page.close()
        browser.close()
    return statistics.median(paints)


class Watchers:
    """``n`` /ui/events clients, as open dashboard pages are (the page's only traffic is this
    stream; it polls nothing), each reading and parsing every event."""

    def __init__(self, base: str, n: int = 1) -> None:
        self.base, self.n, self.ticks = base, n, 0
        self._ready = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def _watch(self) -> None:
        async with httpx.AsyncClient(timeout=None) as client, client.stream("GET", self.base + "/ui/events") as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    json.loads(line[5:])
                    self.ticks += 1
                    if self.ticks >= 2 * self.n:
                        self._ready.set()

    async def __aenter__(self) -> Watchers:
        self._tasks = [asyncio.create_task(self._watch()) for _ in range(self.n)]
        await asyncio.wait_for(self._ready.wait(), 30)  # every page has its history and a tick
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def decode_toggling_dashboard(base: str, model: str, seconds: float, window_s: float = 5.0,
                                    tokens: int = 64) -> list[tuple[float, float, float]]:
    """Streams one after another for ``seconds``, while a /ui/events client is attached in
    every other window of ``window_s`` (checked to get its ticks all through the window).
    Returns, for each window with the page open, (decode tok/s in the window before it,
    in it, in the window after it), over the gaps between tokens of one stream inside a
    window: alternating within one run cancels the drift of a busy machine, which
    separate runs with and without a page do not."""
    windows: list[tuple[float, float, bool]] = []
    stamps: list[list[float]] = []

    async def toggle() -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(window_s)
            windows.append((t0, time.perf_counter(), False))
            async with Watchers(base) as page:
                t0, before = time.perf_counter(), page.ticks
                await asyncio.sleep(window_s)
                windows.append((t0, time.perf_counter(), True))
                assert page.ticks - before >= int(window_s) - 1, "the page got no ticks"

    body = {"model": model, "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": tokens, "temperature": 0.8, "top_p": 1.0}
    toggler = asyncio.create_task(toggle())
    try:
        deadline = time.perf_counter() + seconds
        async with httpx.AsyncClient(timeout=3600) as client:
            while time.perf_counter() < deadline:
                stamps.append((await one_stream(client, base + "/v1/chat/completions", body))["stamps"])
    finally:
        toggler.cancel()
        await asyncio.gather(toggler, return_exceptions=True)

    def rate(t0: float, t1: float) -> float | None:
        gaps = [b - a for s in stamps for a, b in zip(s, s[1:]) if t0 <= a and b <= t1]
        return len(gaps) / sum(gaps) if len(gaps) >= 3 else None

    rates = [(rate(t0, t1), on) for t0, t1, on in windows]
    return [(before, during, after) for (before, _), (during, on), (after, _) in zip(rates, rates[1:], rates[2:])
            if on and before and during and after]


def server_cpu_s(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return float(t.user + t.system)


async def stream_cpu_ms_per_s(base: str, pid: int, pages: int = 5, seconds: float = 15.0) -> tuple[float, float]:
    """The idle server's CPU (ms per second) with no page open, then with ``pages`` open:
    (idle, extra per page)."""
    async def cpu_over(span: float) -> float:
        c0, t0 = server_cpu_s(pid), time.monotonic()
        await asyncio.sleep(span)
        return (server_cpu_s(pid) - c0) / (time.monotonic() - t0) * 1000

    idle = await cpu_over(seconds)
    async with Watchers(base, pages):
        watched = await cpu_over(seconds)
    return idle, (watched - idle) / pages


def bench_dashboard(serve, model: str, prof: dict, seconds: float = 150.0) -> list[str]:
    ours, base = serve()
    try:
        fetch = page_fetch_ms(base)
        paint = browser_paint_ms(base)
        idle_cpu, page_cpu = asyncio.run(stream_cpu_ms_per_s(base, ours.pid))
        asyncio.run(concurrent(base, model, 1, 4))  # warm up
        windows = asyncio.run(decode_toggling_dashboard(base, model, seconds, tokens=2 * prof["decode_tokens"]))
    finally:
        stop(ours)
    ratios = [during / ((before + after) / 2) for before, during, after in windows]
    ratio = statistics.median(ratios)
    shown = f"{paint:.0f} ms" if paint is not None else "n/a (no browser)"
    print(f"dashboard: files fetched in {fetch:.1f} ms, first contentful paint {shown}; decode tok/s in windows "
          f"with a page open / the windows around it: {[round(r, 3) for r in ratios]}; idle server CPU "
          f"{idle_cpu:.1f} ms/s, each open page adds {page_cpu:.2f} ms/s")
    out = [f"dashboard page, HTML + JS + CSS fetched on loopback: {fetch:.1f} ms   (target: first paint < 300 ms)"]
    if paint is not None:
        out.append(f"dashboard first contentful paint in Chromium: {paint:.0f} ms   (target < 300 ms)")
    out.append(f"decode tok/s with a /ui/events client / without, median of {len(ratios)} alternated 5 s windows "
               f"of one run: {ratio:.3f}   (target >= 0.99)")
    out.append(f"server CPU per open dashboard (its /ui/events stream), idle server: {page_cpu:.2f} ms per second "
               f"= {page_cpu / 10:.3f}% of one core   (idle server without one: {idle_cpu:.1f} ms/s)")
    return out


SECTIONS = ("decode", "ttft", "rss", "mlx_lm.server", "vision", "priority", "models", "embeddings", "constrained",
            "disk", "distributed", "embedding_jobs", "bodies", "vision_cache", "pacing", "dashboard", "speculative",
            "vision_native", "engine", "decisions", "breakpoints")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", help="mlx-lm model directory (default: the embedded demo model)")
    ap.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    ap.add_argument("--skip-mlx-server", action="store_true")
    ap.add_argument("--skip-breakpoints-control", action="store_true",
                    help="breakpoints: the marked run only (the unmarked control prefills as much again)")
    ap.add_argument("--skip-vision", action="store_true")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, help="run only these sections")
    args = ap.parse_args()
    run = set(args.only or SECTIONS) - ({"mlx_lm.server"} if args.skip_mlx_server else set()) - (
        {"vision"} if args.skip_vision else set())
    prof = PROFILES[args.profile]
    if args.model_path is None:
        from app.engine.models.demo_model import ensure_demo_model

        args.model_path = str(ensure_demo_model(progress=False))
    name = "bench"
    print(f"model: {args.model_path}\nprofile: {args.profile} {prof}\nsections: {sorted(run)}\n")
    ratios: list[str] = []

    raw = raw_decode(args.model_path, prof["decode_tokens"]) if "decode" in run else None
    if raw is not None:
        print(f"raw mlx-lm stream_generate decode: {raw:.1f} tok/s")

    def serve(copies: int = 1, extra: list[dict] | None = None, **params) -> tuple[subprocess.Popen, str]:
        cfg = Path(tempfile.mkdtemp()) / "models.yaml"
        entry = {"local_path": args.model_path, "params": {
            "mem": prof["mem"], "max_num_seqs": max(prof["concurrency"]), "max_model_len": 8192,
            "prefill_chunk_size": 512, "cache_min_tokens": 32, "max_queue": 256,
            "prompt_cache_disk_mb": 0, **params}}  # a disk tier only where a section asks for one
        names = [name, f"{name}-cold", f"{name}-cold-again"][:copies]
        models = [{"name": n, **entry} for n in names] + (extra or [])
        cfg.write_text(json.dumps({"default_model": name, "models": models}))
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        proc = start([sys.executable, "-m", "app", "serve", "--models-file", str(cfg), "--port", str(port),
                      "--no-vision", "--log-level", "warning"], base + "/health")
        return proc, base

    results: dict[str, dict] = {"tandem": {}, "mlx_lm.server": {}}
    if run & {"decode", "ttft", "rss"}:
        ours, base = serve()
        try:
            if "decode" in run:
                asyncio.run(concurrent(base, name, 1, 4))  # warm up
                single = asyncio.run(concurrent(base, name, 1, prof["decode_tokens"]))
                print(f"tandem single-stream decode: {single['decode_tok_s']:.1f} tok/s")
                ratios.append(f"single-stream decode, tandem / raw mlx-lm:      {single['decode_tok_s'] / raw:.3f}"
                              "   (target >= 0.95)")
                for n in prof["concurrency"]:
                    asyncio.run(concurrent(base, name, n, 2))  # warm up this batch shape
                    res = asyncio.run(concurrent(base, name, n, prof["stream_tokens"]))
                    results["tandem"][n] = res
                    print(f"tandem {n:>2} streams: {res['tok_s']:.1f} tok/s aggregate")
            if "ttft" in run:
                cold, warm, cached = bench_ttft(base, name, prof["system_tokens"])
                print(f"TTFT system prompt ~{prof['system_tokens']} tokens: cold {cold:.2f}s, cached {warm:.2f}s "
                      f"({cached} cached tokens)")
                ratios.append(f"TTFT cached / cold (~{prof['system_tokens']}-token system prompt): {warm / cold:.3f}"
                              "   (target <= 0.2)")
            if "rss" in run:
                idle = rss_mb(ours.pid)
                peak = asyncio.run(rss_burst(base, name, ours.pid, prof["rss_requests"], prof["rss_prompt_tokens"],
                                             prof["rss_max_tokens"]))
                budget = weights_mb(args.model_path) + prof["mem"]
                ratios.append(f"peak RSS / (weights + mem): {peak:.0f} MB / {budget:.0f} MB = {peak / budget:.3f}"
                              "   (target <= 1.1)")
                # The process's own floor (Python, MLX, tokenizer, HTTP stack) dominates a small model;
                # growth over idle is what the KV budget bounds.
                ratios.append(f"RSS growth under the burst / mem: {peak - idle:.0f} MB / {prof['mem']} MB = "
                              f"{(peak - idle) / prof['mem']:.3f}   (idle {idle:.0f} MB)")
        finally:
            stop(ours)

    if "mlx_lm.server" in run:
        port2 = free_port()
        base2 = f"http://127.0.0.1:{port2}"
        theirs = start([sys.executable, "-m", "mlx_lm.server", "--model", args.model_path, "--port", str(port2),
                        "--decode-concurrency", str(max(prof["concurrency"])), "--log-level", "WARNING"],
                       base2 + "/v1/models")
        try:
            asyncio.run(concurrent(base2, args.model_path, 1, 4))
            for n in prof["concurrency"]:
                asyncio.run(concurrent(base2, args.model_path, n, 2))
                res = asyncio.run(concurrent(base2, args.model_path, n, prof["stream_tokens"]))
                results["mlx_lm.server"][n] = res
                print(f"mlx_lm.server {n:>2} streams: {res['tok_s']:.1f} tok/s aggregate")
        finally:
            stop(theirs)
    for n in results["tandem"]:
        ours_n = results["tandem"][n]["tok_s"]
        line = f"aggregate tok/s at {n:>2} streams: tandem {ours_n:.1f}"
        if n in results["mlx_lm.server"]:
            theirs_n = results["mlx_lm.server"][n]["tok_s"]
            line += f", mlx_lm.server {theirs_n:.1f}, ratio {ours_n / theirs_n:.3f}"
            line += "   (target >= 1.3)" if n == 8 else ""
        ratios.append(line)
    if results["tandem"]:
        itl = sorted(results["tandem"].get(8, results["tandem"][max(results["tandem"])])["itl"])
        if itl:
            p50, p99 = itl[len(itl) // 2] * 1000, itl[min(len(itl) - 1, int(len(itl) * 0.99))] * 1000
            ratios.append(f"inter-token latency at {max(k for k in results['tandem'] if k <= 8)} streams: "
                          f"p50 {p50:.1f} ms, p99 {p99:.1f} ms")

    if "vision" in run:
        first, repeat = bench_vision()
        ratios.append(f"caption repeat / first image: {repeat * 1000:.2f} ms / {first * 1000:.0f} ms = "
                      f"{repeat / first:.4f}   (target <= 0.01)")

    if "vision_cache" in run:
        v = bench_vision_cache()
        print(f"native VLM, one {v['image_tokens']:.0f}-token image: turn 1 TTFT {v['ttft1']:.3f}s, turn 2 "
              f"{v['ttft2']:.3f}s ({v['turn2_cached']:.0f} of its {v['turn2_tokens']:.0f} prompt tokens cached); "
              f"new conversation TTFT {v['ttft_new']:.3f}s (caches off {v['ttft_new_off']:.3f}s)")
        ratios.append(f"native VLM turn-2 TTFT / turn-1 TTFT (turn 1's image again): {v['ttft2']:.3f}s / "
                      f"{v['ttft1']:.3f}s = {v['ttft2'] / v['ttft1']:.3f}   (target <= 0.2)")
        ratios.append(f"vision tower, same image in a new conversation / first encode: "
                      f"{v['repeat_encode'] * 1000:.2f} ms / {v['first_encode'] * 1000:.1f} ms = "
                      f"{v['repeat_encode'] / v['first_encode']:.3f}   (target <= 0.05)")
        ratios.append(f"native VLM decode tok/s, prefix and vision-feature caches on / off (medians "
                      f"{v['decode_on']:.1f} / {v['decode_off']:.1f}), median of paired rounds: "
                      f"{v['decode_ratio']:.3f}   (target >= 0.97)")

    if "priority" in run:
        # No prefix cache, so neither chat finds the other's prompt cached.
        ours, base = serve(prompt_cache="off")
        try:
            alone, busy = asyncio.run(bench_priority(base, name))
        finally:
            stop(ours)
        print(f"chat TTFT alone {alone:.2f}s, with 3 background tasks decoding {busy:.2f}s")
        ratios.append(f"chat TTFT with 3 background tasks / alone: {busy:.2f}s / {alone:.2f}s = {busy / alone:.3f}"
                      "   (target <= 1.5)")

    if "models" in run:
        ours, base = serve(copies=3)
        try:
            m = asyncio.run(bench_models(base, name, f"{name}-cold"))
        finally:
            stop(ours)
        ratios.append(f"TTFT of a model not loaded yet (load + prefill) / loaded: {m['ttft_cold']:.2f}s / "
                      f"{m['ttft_loaded']:.2f}s")
        ratios.append(f"longest inter-token gap of a running stream while another model loads: "
                      f"{m['gap_max_during_load'] * 1000:.0f} ms (its usual gap {m['gap_p50'] * 1000:.0f} ms)")

    if "constrained" in run:
        c = bench_compile(args.model_path)
        ratios.append(f"schema compile (pydantic-ai-like output): cold {c['cold_ms']:.1f} ms, cached "
                      f"{c['cached_ms']:.2f} ms, tokenizer setup once per model {c['setup_s']:.2f} s")
        ours, base = serve()
        try:
            for n in (1, 8):
                asyncio.run(concurrent(base, name, n, 4))  # warm up this batch shape
                tokens = prof["decode_tokens"]
                # Alternated, three times, medians: a busy machine drifts between runs.
                frees, helds = [], []
                for _ in range(3):
                    # Per stream, between tokens: prefill and queueing left out of both.
                    frees.append(asyncio.run(concurrent(base, name, n, tokens))["decode_tok_s"])
                    helds.append(asyncio.run(concurrent(base, name, n, tokens,
                                                        response_format=STORY_FORMAT))["decode_tok_s"])
                f, h = statistics.median(frees), statistics.median(helds)
                print(f"{n} stream(s): free {f:.2f} tok/s, constrained {h:.2f} tok/s per stream")
                ratios.append(f"decode tok/s constrained / free at {n} stream(s): {h:.2f} / {f:.2f} = {h / f:.3f}"
                              "   (target >= 0.9)")
        finally:
            stop(ours)

    if "embeddings" in run:
        sys.path.insert(0, str(REPO / "scripts"))
        from bench_embeddings import bench_embeddings

        e = bench_embeddings(seconds=5.0)
        ratios.append(f"embeddings/s (all-MiniLM-L6-v2): batch 1 {e['batch_1']['embeddings_per_s']:.1f}, "
                      f"batch 32 {e['batch_32']['embeddings_per_s']:.1f}")

    if "disk" in run:
        ratios += bench_disk(serve, name, prof)

    if "embedding_jobs" in run:
        # No prefix cache, so the chats after the job find no prompt of the ones before cached.
        ours, base = serve(prompt_cache="off", extra=[{"name": "minilm", "role": "embedding",
                                                        "builtin": "all-minilm-l6-v2"}])
        try:
            alone, busy = asyncio.run(bench_embedding_jobs(base, name, "minilm"))
        finally:
            stop(ours)
        print(f"chat TTFT alone {alone:.2f}s, after an abandoned 512-input embedding job {busy:.2f}s")
        ratios.append(f"chat TTFT after an abandoned 512-input embedding job / alone: {busy:.2f}s / {alone:.2f}s = "
                      f"{busy / alone:.3f}   (target <= 1.5)")

    if "bodies" in run:
        ours, base = serve()
        try:
            early, late = bench_bodies(base, name, ours.pid)
        finally:
            stop(ours)
        ratios.append(f"RSS after 100 requests of 0.9 MB of {{}} / after 10: {late:.0f} MB / {early:.0f} MB = "
                      f"{late / early:.3f}   (target <= 1.1)")

    if "pacing" in run:
        # No prefix cache: each run prefills the long prompt in full.
        paced = {}
        for step_ms in (250, 0):
            ours, base = serve(prompt_cache="off", prefill_step_ms=step_ms)
            try:
                paced[step_ms] = asyncio.run(bench_pacing(base, name, prof))
            finally:
                stop(ours)
            print(f"prefill_step_ms {step_ms}: {paced[step_ms]}")
        on, off = paced[250], paced[0]
        ratios.append(f"longest token gap of a stream beside a {prof['pacing_prompt_tokens']}-token prefill, "
                      f"time-sized chunks / fixed: {on['max_gap']:.2f}s / {off['max_gap']:.2f}s = "
                      f"{on['max_gap'] / off['max_gap']:.3f}   (median gap {on['p50_gap']:.2f}s / "
                      f"{off['p50_gap']:.2f}s; the prefill {on['prefill_s']:.0f}s / {off['prefill_s']:.0f}s)")

    if "dashboard" in run:
        ratios += bench_dashboard(serve, name, prof)

    if "speculative" in run:
        sys.path.insert(0, str(REPO / "scripts"))
        from bench_speculative import bench_speculative

        ours, base = serve(max_num_seqs=4)
        try:
            ratios += bench_speculative(base, name, prof)
        finally:
            stop(ours)

    if "vision_native" in run:
        sys.path.insert(0, str(REPO / "scripts"))
        from bench_vision_native import bench_vision_native

        ratios += bench_vision_native([] if args.profile == "full" else ["--tiny"])

    if "engine" in run:
        sys.path.insert(0, str(REPO / "scripts"))
        from bench_engine import bench_engine

        ratios += bench_engine(args.model_path, prof)

    if "decisions" in run:
        sys.path.insert(0, str(REPO / "scripts"))
        from bench_decisions import bench_decisions

        ours, base = serve()
        try:
            ratios += bench_decisions(base, name, args.model_path)
        finally:
            stop(ours)

    if "breakpoints" in run:
        sys.path.insert(0, str(REPO / "scripts"))
        from bench_breakpoints import bench_breakpoints

        # A prefix cache a little over one marked prompt's KV, nearly all of it open to pins: the
        # traffic that fills it twice is as small as the workload allows (a CPU prefills slowly).
        ours, base = serve(prompt_cache_mem=160, prompt_cache_pin_share=0.9, mem=max(prof["mem"], 1024))
        try:
            ratios += bench_breakpoints(base, name, args.model_path, control=not args.skip_breakpoints_control)
        finally:
            stop(ours)

    if "distributed" in run:
        # Two ranks on one machine share its cores: slower, by the collectives' cost per step.
        from bench_distributed import SHAPES, bench_distributed, build_llama, report

        root = Path(tempfile.mkdtemp(prefix="tandem-bench-dist-"))
        ratios.extend(report(bench_distributed({n: build_llama(root / n, s) for n, s in SHAPES.items()},
                                               prof["stream_tokens"])))

    print("\n== ratios ==")
    for line in ratios:
        print(line)


if __name__ == "__main__":
    main()
