#!/usr/bin/env python
"""Ministral 3 with its own eyes against the proxy setup, on the same images
(``scripts/bench.py --only vision_native``; issue 29).

    .venv/bin/python scripts/bench_vision_native.py            # the real models, from the hub (a Mac)
    .venv/bin/python scripts/bench_vision_native.py --native ~/models/ministral-3-3b-vlm \\
        --text ~/models/ministral-3-3b-4bit --captioner ~/models/qwen2-vl-2b-4bit
    .venv/bin/python scripts/bench_vision_native.py --tiny     # tiny random models: the mechanics only

Two setups, each a real ``tandem serve`` process, one after the other (they never share
the machine), each from a models.yaml written here out of the repo's own entries (their
params and capabilities as shipped; only the sources change, to the paths or hub ids given):

  native  ``ministral-3-3b-vision``: Ministral 3 with its Pixtral tower, served by mlx-vlm;
          one model, ``vision_mode: native``;
  proxy   ``ministral-3-3b-reasoning`` (text only, mlx-lm) with ``vision_mode: proxy``,
          each image captioned first by ``qwen2-vl-2b`` (``role: vision``).

Each setup gets the same six drawn images (a red circle, a blue square, a yellow star,
two green triangles, the digit 7, a black arrow pointing left), one request at a time,
each with the same question, streamed through the openai SDK, after one warm-up request
with another image. It reports side by side, and native / proxy:

  - TTFT: from sending the request to the first streamed token (reasoning or answer),
    median over the images; the proxy's includes captioning the image;
  - the time to the whole answer, median;
  - memory: the server process's peak RSS (sampled every 50 ms; on Linux the kernel's
    own high-water mark too), and /health's figures after the run: ``memory.used_mb``
    (the registry's budget: weights, KV budgets, the vision profile), the models'
    ``memory_mb.weights`` (a VLM's counts its vision tower's worst-case peak and its
    feature cache too), and MLX's peak (``memory.mlx.peak_mb``, which on Apple silicon counts the
    buffers in unified memory);
  - agreement: the share of images whose answer (its content, not its reasoning)
    names every key word of the image's reference (any one of each key's spellings:
    "green" and "triangle" and "two" or "2").

The default native checkpoint (mistralai's own) is not 4-bit while the proxy's two models
are: ``--isq q4`` (or a 4-bit ``mlx_vlm.convert`` as ``--native``) compares memory like for
like. Sampling is each entry's own (Ministral's 0.7 / 0.95), with a fixed ``seed``;
``--temperature`` overrides it for both.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

NATIVE, TEXT = "ministral-3-3b-vision", "ministral-3-3b-reasoning"  # the repo's models.yaml entries
QUESTION = ("What is in this image? Answer in one short sentence that names the colour, the shape "
            "and how many there are (or the digit, if it is a digit).")
SIDE = 256  # px; every model here shrinks larger images, and these scenes need no more
TINY_NOTE = ("NOTE: --tiny serves tiny RANDOM models: their answers mean nothing, and neither do the "
             "agreement and the times; this run proves the benchmark's mechanics, not the models.")


# ---- the captioned set -------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One drawn scene: its reference caption, and the key words an answer must contain
    (each key a tuple of the spellings that count)."""

    name: str
    caption: str
    keys: tuple[tuple[str, ...], ...]
    draw: Callable[[Any], object]  # draws on a PIL ImageDraw of a white SIDE x SIDE canvas

    def png(self) -> bytes:
        from PIL import Image, ImageDraw

        image = Image.new("RGB", (SIDE, SIDE), "white")
        self.draw(ImageDraw.Draw(image))
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return buf.getvalue()

    def agrees(self, answer: str) -> bool:
        """Whether ``answer`` names every key (a word starting with one of its spellings)."""
        text = answer.lower()
        return all(any(re.search(rf"(?<![a-z0-9]){re.escape(s)}", text) for s in key) for key in self.keys)


def _star(cx: float, cy: float, outer: float, inner: float) -> list[tuple[float, float]]:
    from math import cos, pi, sin

    return [(cx + r * sin(i * pi / 5), cy - r * cos(i * pi / 5))
            for i, r in zip(range(10), [outer, inner] * 5)]


def _arrow_left(d: Any) -> None:
    d.rectangle((110, 110, 216, 146), fill="black")
    d.polygon([(40, 128), (120, 68), (120, 188)], fill="black")


def _seven(d: Any) -> None:
    d.line([(72, 56), (184, 56)], fill="black", width=26)
    d.line([(176, 58), (104, 204)], fill="black", width=26)


SAMPLES = (
    Sample("red_circle", "A red circle on a white background.", (("red",), ("circle", "circular", "disc", "disk")),
           lambda d: d.ellipse((48, 48, 208, 208), fill=(220, 20, 20))),
    Sample("blue_square", "A blue square on a white background.", (("blue",), ("square",)),
           lambda d: d.rectangle((56, 56, 200, 200), fill=(20, 40, 220))),
    Sample("yellow_star", "A yellow five-pointed star on a white background.", (("yellow",), ("star",)),
           lambda d: d.polygon(_star(128, 136, 100, 40), fill=(250, 210, 0), outline="black")),
    Sample("two_green_triangles", "Two green triangles side by side on a white background.",
           (("two", "2"), ("green",), ("triangle",)),
           lambda d: [d.polygon(p, fill=(20, 160, 40)) for p in
                      ([(20, 180), (70, 80), (120, 180)], [(136, 180), (186, 80), (236, 180)])]),
    Sample("digit_7", "The digit 7 in black on a white background.", (("7", "seven"),), _seven),
    Sample("arrow_left", "A black arrow pointing left on a white background.", (("black",), ("arrow",), ("left",)),
           _arrow_left),
)
WARM_UP = Sample("warm_up", "A grey bar.", (), lambda d: d.rectangle((40, 100, 216, 156), fill=(128, 128, 128)))


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


# ---- the models.yaml of each setup -------------------------------------------------------------


def _entry(entries: dict[str, dict[str, Any]], name: str, source: str | None) -> dict[str, Any]:
    """The repo's entry ``name``, its source replaced by ``source`` (a directory: local_path; else a hub id)."""
    entry = {k: v for k, v in entries[name].items() if source is None or k not in ("hf_id", "local_path", "builtin")}
    if source is not None:
        path = Path(source).expanduser()
        entry.update({"local_path": str(path)} if path.exists() else {"hf_id": source})
    return entry


def setups(args: argparse.Namespace, sources: dict[str, str | None]) -> dict[str, dict[str, Any]]:
    """The two models.yaml documents: ``native`` and ``proxy``."""
    import yaml

    entries = {e["name"]: e for e in yaml.safe_load(Path(args.models_file).read_text())["models"]}
    native = _entry(entries, NATIVE, sources["native"])
    text = _entry(entries, TEXT, sources["text"])
    captioner_name = text["capabilities"]["vision_proxy"]["model"]
    captioner = _entry(entries, captioner_name, sources["captioner"])
    if args.isq:
        native["params"] = {**native.get("params", {}), "quantization": args.isq}
    if args.tiny:  # a CPU's sizes: a small KV budget, short captions
        for e in (native, text, captioner):
            e["params"] = {**e.get("params", {}), "mem": 64, "max_num_seqs": 2}
        text["capabilities"]["vision_proxy"]["max_tokens"] = 16
    return {"native": {"default_model": NATIVE, "models": [native]},
            "proxy": {"default_model": TEXT, "models": [text, captioner]}}


def tiny_sources(root: Path) -> dict[str, str | None]:
    """Tiny random stand-ins, built here: a mistral3 VLM (Pixtral tower, ministral3 text model),
    a scripted text Ministral 3 (a fixed reasoning and answer), a Qwen2-VL captioner."""
    from app.engine.models.demo_model import ensure_demo_model
    from tests.fixtures.tiny_ministral import build_tiny_ministral
    from tests.fixtures.tiny_vlm import build_tiny_qwen2_vl
    from tests.fixtures.zoo_vision import build_zoo_vlm

    native = build_zoo_vlm("mistral3", root / "native")
    text = build_tiny_ministral(root / "text", "[THINK]The caption names it[/THINK]It shows a shape.",
                                base=ensure_demo_model(progress=False)).path
    captioner = build_tiny_qwen2_vl(root / "captioner")
    return {"native": str(native), "text": str(text), "captioner": str(captioner)}


# ---- one server ------------------------------------------------------------------------------


class PeakRss:
    """The peak RSS of a process and its children, sampled on a thread (psutil); on Linux
    the kernel's high-water mark (VmHWM) is read too, before the process ends."""

    def __init__(self, pid: int, every_s: float = 0.05) -> None:
        self.pid, self.every_s, self.peak = pid, every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import psutil

        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(self.pid)
            while not self._stop.wait(self.every_s):
                procs = [proc, *proc.children(recursive=True)]
                self.peak = max(self.peak, sum(p.memory_info().rss for p in procs))

    def finish(self) -> float:
        """Stop sampling; the peak in MB."""
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    self.peak = max(self.peak, int(line.split()[1]) * 1024)
        self._stop.set()
        self._thread.join()
        return self.peak / 2**20


@dataclass
class Server:
    base: str
    proc: subprocess.Popen[bytes]
    rss: PeakRss


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_loaded(server: Server, document: dict[str, Any], log: Path, timeout_s: float) -> None:
    """Wait for /health (every model loads before it answers); fail with the log's tail."""
    import httpx

    def fail(why: str) -> RuntimeError:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        return RuntimeError(f"{why}\n--- server log ({log}) ---\n{tail}")

    deadline = time.monotonic() + timeout_s
    while True:
        if server.proc.poll() is not None:
            raise fail(f"the server exited with {server.proc.returncode}")
        if time.monotonic() > deadline:
            raise fail(f"not ready after {timeout_s:.0f} s")
        with contextlib.suppress(httpx.HTTPError):
            health = httpx.get(server.base + "/health", timeout=5).json()
            break
        time.sleep(0.5)
    for entry in document["models"]:
        state = health["models"][entry["name"]]
        if state["state"] != "loaded":
            raise fail(f"model {entry['name']} is {state['state']}: {state['error']}")
    if not health["vision"]["available"]:
        raise fail(f"vision unavailable: {health['vision']['reason']}")


@contextlib.contextmanager
def served(document: dict[str, Any], workdir: Path, label: str, timeout_s: float) -> Iterator[Server]:
    """``tandem serve`` on a free loopback port with ``document`` as its models.yaml."""
    config, log = workdir / f"{label}.models.yaml", workdir / f"{label}.log"
    config.write_text(json.dumps(document, indent=2))  # JSON is YAML
    port = _free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app", "serve", "--models-file", str(config), "--port",
                                 str(port), "--log-level", "warning"], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    server = Server(f"http://127.0.0.1:{port}", proc, PeakRss(proc.pid))
    try:
        _wait_loaded(server, document, log, timeout_s)
        yield server
    finally:
        server.rss.finish()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ---- measuring a setup -----------------------------------------------------------------------


@dataclass
class Answer:
    ttft_s: float
    total_s: float
    content: str
    reasoning: str
    finish_reason: str | None
    prompt_tokens: int


@dataclass
class Result:
    answers: dict[str, Answer] = field(default_factory=dict)
    peak_rss_mb: float = 0.0
    health: dict[str, Any] = field(default_factory=dict)


def ask(client: Any, model: str, png: bytes, args: argparse.Namespace, max_tokens: int) -> Answer:
    """One streamed chat completion with the image and the question."""
    extra: dict[str, Any] = {"seed": 0}
    if args.temperature is not None:
        extra["temperature"] = args.temperature
    t0 = time.perf_counter()
    first: float | None = None
    content, reasoning, finish, prompt_tokens = [], [], None, 0
    stream = client.chat.completions.create(
        model=model, max_tokens=max_tokens, stream=True, stream_options={"include_usage": True}, extra_body=extra,
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png)}},
                                               {"type": "text", "text": QUESTION}]}])
    for chunk in stream:
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
        for choice in chunk.choices:
            think = getattr(choice.delta, "reasoning_content", None) or ""
            if choice.delta.content or think:
                first = first or time.perf_counter()
            content.append(choice.delta.content or "")
            reasoning.append(think)
            finish = choice.finish_reason or finish
    end = time.perf_counter()
    return Answer((first or end) - t0, end - t0, "".join(content).strip(), "".join(reasoning).strip(), finish,
                  prompt_tokens)


def measure(server: Server, model: str, args: argparse.Namespace) -> Result:
    """The warm-up, then every sample in order; /health after them."""
    import httpx
    from openai import OpenAI

    result = Result()
    with OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0, timeout=args.request_timeout) as client:
        ask(client, model, WARM_UP.png(), args, max_tokens=1)
        for sample in SAMPLES:
            result.answers[sample.name] = answer = ask(client, model, sample.png(), args, args.max_tokens)
            print(f"  {sample.name}: TTFT {answer.ttft_s:.2f}s, {answer.total_s:.2f}s, "
                  f"{answer.prompt_tokens} prompt tokens, agrees {sample.agrees(answer.content)}: "
                  f"{answer.content[:100]!r}", flush=True)
    result.health = httpx.get(server.base + "/health", timeout=30).json()
    return result


# ---- the report ------------------------------------------------------------------------------

# The figures compared: label -> whether a native / proxy ratio means something.
TTFT, TOTAL, PROMPT, RSS = "TTFT, median (s)", "whole answer, median (s)", "prompt tokens, median", "peak RSS (MB)"
USED, WEIGHTS, MLX = "/health memory.used_mb", "/health models' weights (MB)", "/health memory.mlx.peak_mb"
AGREE, CUT = "agreement (share of images)", "answers cut at max_tokens"


def figures(r: Result) -> dict[str, float]:
    """The compared figures of one setup."""
    answers = list(r.answers.values())
    memory = r.health["memory"]
    return {
        TTFT: statistics.median(a.ttft_s for a in answers),
        TOTAL: statistics.median(a.total_s for a in answers),
        PROMPT: statistics.median(a.prompt_tokens for a in answers),
        RSS: r.peak_rss_mb,
        USED: memory["used_mb"],
        # A VLM's "weights" are its weights, its vision tower's worst-case peak and its feature cache.
        WEIGHTS: sum(m["memory_mb"]["weights"] for m in r.health["models"].values()),
        MLX: memory["mlx"]["peak_mb"],
        AGREE: sum(s.agrees(r.answers[s.name].content) for s in SAMPLES) / len(SAMPLES),
        CUT: sum(a.finish_reason == "length" for a in answers),
    }


def report(native: Result, proxy: Result, tiny: bool) -> list[str]:
    """The side-by-side table (printed) and the ratio lines for scripts/bench.py."""
    n, p = figures(native), figures(proxy)

    def ratio(key: str) -> str:
        return "" if key == CUT else f"{n[key] / p[key]:.3f}" if p[key] else "n/a"

    def cell(x: float) -> str:
        return f"{x:>12.3f}" if abs(x) < 10 else f"{x:>12.1f}" if abs(x) < 1000 else f"{x:>12.0f}"

    print(f"\n{'':36}{'native':>12}{'proxy':>12}{'native/proxy':>14}")
    for key in n:
        print(f"{key:36}{cell(n[key])}{cell(p[key])}{ratio(key):>14}")
    print("\nper image, the reference; whether the native / the proxy answer agrees with it:")
    for s in SAMPLES:
        print(f"  {s.name:20} {s.caption!r}: {s.agrees(native.answers[s.name].content)} / "
              f"{s.agrees(proxy.answers[s.name].content)}")
    models = "tiny random models, meaningless answers" if tiny else "Ministral 3 / Ministral 3 + Qwen2-VL-2B"
    lines = [f"vision native / proxy ({models}), TTFT median: {n[TTFT]:.2f}s / {p[TTFT]:.2f}s = {ratio(TTFT)}",
             f"vision native / proxy, peak RSS: {n[RSS]:.0f} MB / {p[RSS]:.0f} MB = {ratio(RSS)}; /health used_mb "
             f"{n[USED]:.0f} / {p[USED]:.0f} = {ratio(USED)}; MLX peak {n[MLX]:.0f} / {p[MLX]:.0f} MB = {ratio(MLX)}",
             f"vision native / proxy, answers agreeing with the references: {n[AGREE]:.2f} / {p[AGREE]:.2f} of "
             f"{len(SAMPLES)} images = {ratio(AGREE)} (cut at max_tokens: {n[CUT]:.0f} / {p[CUT]:.0f})"]
    if tiny:
        print("\n" + TINY_NOTE)
        lines.append(TINY_NOTE)
    return lines


def bench_vision_native(argv: list[str]) -> list[str]:
    """Serve each setup in turn, ask it about every image, compare; the ratio lines."""
    args = parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="tandem-bench-vision-native-"))
    if args.tiny:
        print(TINY_NOTE)
        sources = tiny_sources(workdir / "models")
    else:
        sources = {"native": args.native, "text": args.text, "captioner": args.captioner}
    results: dict[str, Result] = {}
    for label, document in setups(args, sources).items():
        names = ", ".join(f"{e['name']} ({e.get('local_path') or e.get('hf_id')})" for e in document["models"])
        print(f"\n== {label}: {names}", flush=True)
        with served(document, workdir, label, args.load_timeout) as server:
            results[label] = measure(server, document["default_model"], args)
            results[label].peak_rss_mb = server.rss.finish()
    return report(results["native"], results["proxy"], args.tiny)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--native", default="mistralai/Ministral-3-3B-Reasoning-2512",
                    help="Ministral 3 as a VLM: a hub id or an mlx_vlm.convert directory")
    ap.add_argument("--text", default="mlx-community/Ministral-3-3B-Reasoning-2512-4bit",
                    help="the text model of the proxy setup: a hub id or an mlx-lm directory")
    ap.add_argument("--captioner", default="mlx-community/Qwen2-VL-2B-Instruct-4bit",
                    help="the proxy setup's captioner: a hub id or a directory")
    ap.add_argument("--isq", choices=("q4", "q8"),
                    help="quantize the native model's language model at load (params.quantization): the proxy's "
                         "models are 4-bit, mistralai's checkpoint is not")
    ap.add_argument("--tiny", action="store_true", help="tiny random models built here (the mechanics only)")
    ap.add_argument("--models-file", default=str(REPO / "models.yaml"), help="where the entries are read from")
    ap.add_argument("--max-tokens", type=int, default=None, help="answer limit (default 2048; 16 with --tiny)")
    ap.add_argument("--temperature", type=float, default=None, help="override the entries' temperature")
    ap.add_argument("--load-timeout", type=float, default=3600, help="seconds a server may take to load")
    ap.add_argument("--request-timeout", type=float, default=1800)
    args = ap.parse_args(argv)
    if args.max_tokens is None:
        args.max_tokens = 16 if args.tiny else 2048
    return args


if __name__ == "__main__":
    for line in bench_vision_native(sys.argv[1:]):
        print(line)
