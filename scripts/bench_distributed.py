#!/usr/bin/env python
"""Distributed benchmark: per-step time and tokens/s, one process against two ranks.

    .venv/bin/python scripts/bench_distributed.py                   # seeded llamas, built here
    .venv/bin/python scripts/bench_distributed.py --model-path DIR  # a model of yours (heads divisible by 2)

Each model is served twice, one server at a time: by ``tandem serve`` alone, then by
``mlx.launch --backend ring -n 2 --hosts 127.0.0.1 -- tandem serve`` (tensor parallel over
two ranks on this machine). At 1 and at 8 concurrent streams it measures the aggregate
tokens/s and the median gap between a stream's tokens, which is the time of one batch step
(one token per stream per step). On one machine two ranks share its cores and memory
bandwidth and add collectives to every step (two all_sums per layer, and one that hands
every rank the step's sampled tokens), so they are slower: the difference is the collectives' cost per step. Across
machines, tensor parallelism divides each step's weight reads by the world size.

The default models are seeded random llamas with the embedded demo model's tokenizer:
"tiny" (hidden 64, 2 layers: a step is almost only overhead) and "small" (hidden 768,
12 layers, about 110M parameters in bfloat16: compute starts to count).
``bench_distributed()`` returns the numbers, for ``scripts/bench.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from bench import concurrent, free_port, stop, wait_ready  # noqa: E402

SHAPES = {
    "tiny": {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4,
             "num_key_value_heads": 2},
    "small": {"hidden_size": 768, "num_hidden_layers": 12, "intermediate_size": 2048, "num_attention_heads": 12,
              "num_key_value_heads": 4},
}
STREAMS = (1, 8)


def build_llama(out: Path, shape: dict[str, int]) -> Path:
    """A seeded random llama of ``shape``, with the demo model's tokenizer, in bfloat16."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    from app.engine.models.demo_model import ensure_demo_model

    demo = ensure_demo_model(progress=False)
    config = {"model_type": "llama", "rms_norm_eps": 1e-5, "vocab_size": 49152, "rope_theta": 10000.0,
              "max_position_embeddings": 4096, "tie_word_embeddings": True, **shape}
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(demo / name, out / name)
    return out


def ring_port() -> int:
    """A port whose next one is free too: the ring backend listens on one per rank."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
                return port
            except OSError:
                continue


def measure(base: str, tokens: int) -> dict[int, dict[str, float]]:
    out = {}
    asyncio.run(concurrent(base, "bench", 1, 4))  # warm up
    for n in STREAMS:
        asyncio.run(concurrent(base, "bench", n, 2))  # this batch shape
        res = asyncio.run(concurrent(base, "bench", n, tokens))
        out[n] = {"tok_s": res["tok_s"], "step_ms": statistics.median(res["itl"]) * 1000}
    return out


def serve(model_path: Path, ranks: int, direct: bool = False) -> tuple[list[Any], str]:
    """One process, or ``ranks`` ranks through mlx.launch (``direct``: started as mlx.launch
    starts them, without the launcher, whose output loop keeps a core busy)."""
    tmp = Path(tempfile.mkdtemp())
    (tmp / "models.yaml").write_text(json.dumps({"models": [{"name": "bench", "local_path": str(model_path),
                                     "params": {"mem": 256, "max_num_seqs": max(STREAMS), "prompt_cache": "off"}}]}))
    port = free_port()
    cmd = [sys.executable, "-m", "app", "serve", "--models-file", str(tmp / "models.yaml"), "--port", str(port),
           "--no-vision", "--log-level", "warning"]
    envs: list[dict[str, str] | None] = [None]
    if ranks > 1 and direct:
        ring = ring_port()
        (tmp / "hosts.json").write_text(json.dumps([[f"127.0.0.1:{ring + r}"] for r in range(ranks)]))
        envs = [{**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(tmp / "hosts.json")} for r in range(ranks)]
    elif ranks > 1:
        launch = REPO / ".venv" / "bin" / "mlx.launch"
        cmd = [str(launch), "--backend", "ring", "-n", str(ranks), "--hosts", "127.0.0.1", "-p", str(ring_port()),
               "--", *cmd]
    base = f"http://127.0.0.1:{port}"
    # mlx.launch makes its own stdin non-blocking: never hand it this terminal's.
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True) for env in envs]
    wait_ready(base + "/health", procs[0])
    return procs, base


def bench_distributed(model_paths: dict[str, Path], tokens: int = 32,
                      direct: bool = False) -> dict[str, dict[int, dict[int, dict]]]:
    """{model: {ranks: {streams: {"tok_s", "step_ms"}}}}."""
    results: dict[str, dict[int, dict[int, dict]]] = {}
    for name, path in model_paths.items():
        for ranks in (1, 2):
            procs, base = serve(path, ranks, direct)
            try:
                results.setdefault(name, {})[ranks] = measure(base, tokens)
            finally:
                for proc in procs:
                    stop(proc)
    return results


def report(results: dict[str, dict[int, dict[int, dict]]]) -> list[str]:
    lines = []
    for name, by_ranks in results.items():
        for n in STREAMS:
            one, two = by_ranks[1][n], by_ranks[2][n]
            lines.append(f"{name} at {n} stream(s): 1 process {one['tok_s']:.1f} tok/s, step {one['step_ms']:.1f} ms; "
                         f"2 ranks {two['tok_s']:.1f} tok/s, step {two['step_ms']:.1f} ms "
                         f"(+{two['step_ms'] - one['step_ms']:.1f} ms per step)")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", type=Path, help="a model whose heads divide by 2 (default: seeded llamas)")
    ap.add_argument("--tokens", type=int, default=32, help="tokens per stream")
    ap.add_argument("--direct", action="store_true", help="start the ranks without mlx.launch")
    ap.add_argument("--only", nargs="+", choices=sorted(SHAPES), help="some of the seeded models")
    args = ap.parse_args()
    if args.model_path:
        paths = {args.model_path.name: args.model_path}
    else:
        root = Path(tempfile.mkdtemp(prefix="tandem-bench-dist-"))
        paths = {name: build_llama(root / name, shape) for name, shape in SHAPES.items()
                 if not args.only or name in args.only}
    for line in report(bench_distributed(paths, args.tokens, args.direct)):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
