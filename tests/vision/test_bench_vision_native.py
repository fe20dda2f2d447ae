"""scripts/bench_vision_native.py: its captioned set, its scoring, the servers it writes, and
its --tiny run end to end (two real `tandem serve` processes on tiny random models)."""

from __future__ import annotations

import argparse
import importlib.util
import io
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from PIL import Image

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_vision_native.py"


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("bench_vision_native", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_each_reference_caption_names_its_own_key_words(bench):
    for sample in bench.SAMPLES:
        assert sample.agrees(sample.caption), sample.name


@pytest.mark.parametrize(("name", "answer", "agrees"), [
    ("two_green_triangles", "Two green triangles.", True),
    ("two_green_triangles", "There are 2 GREEN triangles side by side.", True),
    ("two_green_triangles", "A green triangle.", False),  # how many is a key word
    ("red_circle", "A red disc on white.", True),
    ("red_circle", "A bored circle.", False),  # a key word starts a word
    ("digit_7", "The number seven, in black.", True),
    ("digit_7", "The digit 1.", False),
    ("arrow_left", "A black arrow that points to the left.", True),
    ("arrow_left", "A black arrow pointing right.", False),
    ("yellow_star", "", False),  # an answer cut before it began
])
def test_an_answer_agrees_when_it_names_every_key(bench, name, answer, agrees):
    sample = next(s for s in bench.SAMPLES if s.name == name)
    assert sample.agrees(answer) is agrees


def test_the_drawn_images_are_distinct_and_show_their_colour(bench):
    colours = {"red_circle": (220, 20, 20), "blue_square": (20, 40, 220), "yellow_star": (250, 210, 0),
               "two_green_triangles": (20, 160, 40), "digit_7": (0, 0, 0), "arrow_left": (0, 0, 0)}
    pngs = {s.name: s.png() for s in (*bench.SAMPLES, bench.WARM_UP)}
    assert len(set(pngs.values())) == len(pngs)
    for name, colour in colours.items():
        image = Image.open(io.BytesIO(pngs[name])).convert("RGB")
        assert image.size == (bench.SIDE, bench.SIDE)
        counts = {rgb: n for n, rgb in image.getcolors(bench.SIDE * bench.SIDE) or []}
        assert counts.get(colour, 0) > 0.04 * bench.SIDE**2, name  # the scene, not a speck


def _args(bench, **kw) -> argparse.Namespace:
    return bench.parse_args([f"--{k.replace('_', '-')}={v}" if v is not True else f"--{k}" for k, v in kw.items()])


def test_the_setups_serve_the_repo_entries_from_the_sources_given(bench, tmp_path):
    args = _args(bench)
    assert (args.native, args.text, args.captioner) == ("mistralai/Ministral-3-3B-Reasoning-2512",
                                                        "mlx-community/Ministral-3-3B-Reasoning-2512-4bit",
                                                        "mlx-community/Qwen2-VL-2B-Instruct-4bit")
    docs = bench.setups(args, {"native": str(tmp_path), "text": args.text, "captioner": args.captioner})
    [native] = docs["native"]["models"]
    assert native["name"] == docs["native"]["default_model"] == "ministral-3-3b-vision"
    assert native["local_path"] == str(tmp_path) and "hf_id" not in native  # a directory: local_path
    assert native["capabilities"]["vision_mode"] == "native"
    text, captioner = docs["proxy"]["models"]
    assert docs["proxy"]["default_model"] == text["name"] == "ministral-3-3b-reasoning"
    assert text["hf_id"] == args.text and text["capabilities"]["vision_mode"] == "proxy"
    assert text["capabilities"]["vision_proxy"]["model"] == captioner["name"]
    assert captioner["role"] == "vision" and captioner["hf_id"] == args.captioner
    assert "quantization" not in native["params"]  # the entry as shipped, unless asked
    docs = bench.setups(_args(bench, isq="q4"), {"native": None, "text": None, "captioner": None})
    [native] = docs["native"]["models"]
    assert native["params"]["quantization"] == "q4"
    assert native["hf_id"] == "mistralai/Ministral-3-3B-Reasoning-2512"  # no source given: the entry's own


def test_the_tiny_run_serves_both_setups_and_compares_them(bench):
    """The whole script, as a user runs it: two servers, six images each, the table, the ratios."""
    run = subprocess.run([sys.executable, str(SCRIPT), "--tiny"], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    out = run.stdout
    assert run.returncode == 0, out[-3000:] + run.stderr[-3000:]
    native, proxy = out.split("== native:")[1].split("== proxy:")
    for setup in (native, proxy):
        answered = re.findall(r"^  (\w+): TTFT (\d+\.\d+)s, [\d.]+s, (\d+) prompt tokens", setup, re.M)
        assert [a[0] for a in answered] == ["red_circle", "blue_square", "yellow_star", "two_green_triangles",
                                            "digit_7", "arrow_left"]
        assert all(int(tokens) > 0 for _, _, tokens in answered)
    # The proxy's text model was scripted to answer "It shows a shape." after its reasoning:
    # the answer is the content, the reasoning kept out of it.
    assert proxy.count("'It shows a shape.'") == 6
    for row in ("TTFT, median (s)", "peak RSS (MB)", "/health memory.used_mb", "/health memory.mlx.peak_mb",
                "agreement (share of images)"):
        assert re.search(rf"^{re.escape(row)}\s+[\d.]+\s+[\d.]+\s+(\d+\.\d+|n/a)$", out, re.M), row
    assert re.search(r"^vision native / proxy \(tiny random models, meaningless answers\), TTFT median: "
                     r"\d+\.\d+s / \d+\.\d+s = \d+\.\d+$", out, re.M)
    # Said first and last: tiny-model answers mean nothing.
    assert out.startswith(bench.TINY_NOTE) and out.rstrip().endswith(bench.TINY_NOTE)
