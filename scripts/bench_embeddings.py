#!/usr/bin/env python
"""Encoder benchmark: embeddings/s at batch 1 and 32, load time and memory.

    .venv/bin/python scripts/bench_embeddings.py                  # the embedded MiniLM
    .venv/bin/python scripts/bench_embeddings.py --model-path DIR --seconds 10

Runs in this process, straight on ``app.engine.models.encoder`` (no server), so it
measures the engine: tokenizing, padding, the forward pass and pooling. Inputs
are seeded pseudo-sentences of 8 to 40 words (about 10 to 50 tokens), plus a
batch of inputs at the model's full length. Memory is this process's resident
set: before importing MLX, after importing the libraries, after loading, and
the peak after the runs. ``bench_embeddings()`` returns the same numbers as a
dict, for ``scripts/bench.py``.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

_VOCABULARY = """
    the a cat dog market rates bank river music quantum soup garden city train night morning
    reads writes sleeps runs falls rises quietly after before under over because while small old
    new green bright heavy model server request token memory engine batch vector search answer
"""
WORDS = _VOCABULARY.split()


def rss_mb() -> float:
    """Resident set size now (Linux /proc; elsewhere the peak, which is what macOS offers)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return peak_rss_mb()


def peak_rss_mb() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024  # bytes on macOS, KiB on Linux


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) + "." for _ in range(n)]


def rate(encoder: Any, batch: list[str], seconds: float, truncate: bool = False) -> dict[str, float]:
    """Embed ``batch`` over and over for about ``seconds`` (at least once).

    Rates per wall-clock second, and per CPU-second of this process: on a
    shared machine the second is the steadier number.
    """
    from app.engine.models.encoder_inputs import EncoderInputs

    encoder.embed(EncoderInputs(tuple(batch[:1])), truncate=truncate)  # warm-up
    inputs = EncoderInputs(tuple(batch))
    done = tokens = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    while (elapsed := time.perf_counter() - start) < seconds or done == 0:
        tokens += encoder.embed(inputs, truncate=truncate).prompt_tokens
        done += len(batch)
    cpu = time.process_time() - cpu_start
    return {"embeddings_per_s": round(done / elapsed, 1), "tokens_per_s": round(tokens / elapsed),
            "embeddings_per_cpu_s": round(done / cpu, 1), "tokens_per_input": round(tokens / done)}


def bench_embeddings(model_path: Path | None = None, seconds: float = 5.0) -> dict[str, Any]:
    """Load the encoder and measure it; returns the numbers printed by ``main``."""
    before = rss_mb()
    start = time.perf_counter()
    import mlx.core as mx
    import mlx_embeddings.utils  # type: ignore[import-untyped]  # noqa: F401 - its import cost, apart from the load

    from app.config.schema import EncoderParams
    from app.engine.models.builtin_models import ensure_minilm
    from app.engine.models.encoder import load_encoder
    from app.specs import encoder_limits

    imported, import_s = rss_mb(), time.perf_counter() - start
    path = model_path or ensure_minilm(progress=False)
    start = time.perf_counter()
    encoder = load_encoder(path, limits=encoder_limits(EncoderParams()))
    load_s, loaded = time.perf_counter() - start, rss_mb()
    texts = sentences(64 * 32)
    long_text = " ".join(sentences(200))
    result: dict[str, Any] = {
        "model": path.name, "device": str(mx.default_device()), "dim": encoder.dim,
        "max_length": encoder.max_length, "weights_mb": round(encoder.weight_bytes / 2**20, 1),
        "import_s": round(import_s, 2), "load_s": round(load_s, 2),
        "rss_mb": {"start": round(before), "libraries": round(imported), "loaded": round(loaded)},
    }
    # The last batch is longer than the model takes, so every input is cut to its full length.
    runs = {"batch_1": (texts[:1], False), "batch_32": (texts[:32], False),
            "batch_32_full_length": ([long_text] * 32, True)}
    for name, (batch, truncate) in runs.items():
        result[name] = rate(encoder, batch, seconds, truncate)
    result["rss_mb"]["peak"] = round(peak_rss_mb())
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-path", type=Path, help="an encoder directory (default: the embedded MiniLM)")
    parser.add_argument("--seconds", type=float, default=5.0, help="time per measurement")
    parser.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = parser.parse_args()
    r = bench_embeddings(args.model_path, args.seconds)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    print(f"{r['model']} on {r['device']}: dim {r['dim']}, max {r['max_length']} tokens, "
          f"weights {r['weights_mb']} MB")
    print(f"  import {r['import_s']} s, load {r['load_s']} s; RSS MB: {r['rss_mb']}")
    for name in ("batch_1", "batch_32", "batch_32_full_length"):
        m = r[name]
        print(f"  {name:<22} {m['embeddings_per_s']:>8} embeddings/s {m['tokens_per_s']:>8} tokens/s "
              f"{m['embeddings_per_cpu_s']:>8} per CPU-s ({m['tokens_per_input']} tokens each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
