#!/usr/bin/env python
"""Native VLM engine benchmark: load, the worst-case profile, and decode tokens/s.

    .venv/bin/python scripts/bench_vlm.py                          # tiny random Qwen2-VL
    .venv/bin/python scripts/bench_vlm.py --processor-max-pixels 200704 --max-images 8
    .venv/bin/python scripts/bench_vlm.py --model-path ~/models/qwen2-vl-2b-4bit --max-pixels 200704

It measures, on one MLX thread, in this order:
  1. load_vlm: load time, weights, and the worst-case profile (max_images images
     at max_pixels through the vision tower): its prompt tokens and peak memory;
  2. raw mlx-vlm ``stream_generate`` decode tokens/s, one request with one image;
  3. VlmEngine: decode tokens/s for 1 stream, and the aggregate at each
     concurrency, every request with its own image;
  4. the cost of one request's processor pass (Tandem runs it twice: to count
     the prompt for admission, then to encode).
``--processor-max-pixels`` raises the tiny model's own image cap (112x112 px) so
the profile grows as a real VLM's would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from io import BytesIO
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from PIL import Image  # noqa: E402

from app.config.schema import ChatParams  # noqa: E402
from app.engine.mlx_internals import vlm_prompt_inputs  # noqa: E402
from app.engine.models.vlm import VlmEngine, load_vlm, render_vlm_prompt  # noqa: E402
from app.engine.types import GenerationRequest  # noqa: E402
from app.engine.worker import MLXWorker  # noqa: E402
from app.specs import engine_params, load_params  # noqa: E402


def picture(seed: int, side: int) -> Image.Image:
    from tests.vision.sample_images import striped_bytes

    return Image.open(BytesIO(striped_bytes(seed, (side, side)))).convert("RGB")


def model_dir(args: argparse.Namespace) -> str:
    if args.model_path:
        return str(Path(args.model_path).expanduser())
    from tests.fixtures.tiny_vlm import build_tiny_qwen2_vl

    path = build_tiny_qwen2_vl(Path(tempfile.mkdtemp(prefix="tiny-qwen2-vl-")))
    if args.processor_max_pixels:
        config = json.loads((path / "preprocessor_config.json").read_text())
        config["max_pixels"] = args.processor_max_pixels
        (path / "preprocessor_config.json").write_text(json.dumps(config))
    return str(path)


async def stream_rate(engine: VlmEngine, reqs: list[GenerationRequest]) -> tuple[float, int]:
    """Aggregate decode tokens/s from the first token to the last, and the tokens."""
    firsts: list[float] = []

    async def one(req: GenerationRequest) -> int:
        n = 0
        async for delta in engine.stream(req):
            if n == 0:
                firsts.append(time.perf_counter())
            n += delta.tokens
        return n

    counts = await asyncio.gather(*(one(r) for r in reqs))
    end = time.perf_counter()
    tokens = sum(counts) - 1  # the first token came with the first prefill
    return tokens / max(1e-9, end - min(firsts)), sum(counts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path")
    ap.add_argument("--processor-max-pixels", type=int)
    ap.add_argument("--max-pixels", type=int, default=448 * 448)
    ap.add_argument("--max-images", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8])
    args = ap.parse_args()
    source = model_dir(args)
    side = min(448, int(args.max_pixels**0.5))

    worker = MLXWorker()
    worker.start()
    load = load_params(ChatParams())
    loaded = worker.submit(lambda: load_vlm(source, load, name="bench-vlm", max_pixels=args.max_pixels,
                                            min_pixels=28 * 28, max_images=args.max_images)).result()
    p = loaded.profile
    print(f"load_vlm: {loaded.load_s:.2f} s, weights {loaded.weights_bytes / 2**20:.1f} MB")
    print(f"worst case: {p.images} image(s) at {p.image_size[0]}x{p.image_size[1]} = {p.prompt_tokens} prompt tokens, "
          f"vision tower peak {p.peak_bytes / 2**20:.1f} MB above the weights, {p.seconds:.2f} s")

    def prompt(text: str, n_images: int) -> str:
        content = [{"type": "image"}] * n_images + [{"type": "text", "text": text}]
        return render_vlm_prompt(loaded, [{"role": "user", "content": content}])

    def raw_rate() -> float:
        from mlx_vlm import stream_generate

        responses = list(stream_generate(loaded.model, loaded.processor, prompt("Describe.", 1),
                                         image=[picture(1, side)], max_tokens=args.tokens, temperature=0.0))
        return float(responses[-1].generation_tps) if responses else 0.0

    print(f"raw mlx-vlm stream_generate, 1 image: {worker.submit(raw_rate).result():.1f} tok/s")

    text = prompt("Describe.", 1)
    image = picture(2, side)
    started = time.perf_counter()
    for _ in range(10):
        worker.submit(lambda: vlm_prompt_inputs(loaded.model, loaded.processor, text, [image])).result()
    print(f"processor pass, 1 image at {side}x{side}: {(time.perf_counter() - started) * 100:.1f} ms")

    engine = VlmEngine(worker, loaded, engine_params(ChatParams(mem=256, max_num_seqs=max(args.streams))))
    images = [picture(10 + i, side) for i in range(max(args.streams))]
    for n in args.streams:
        # A random model may stop early (EOS), so the tokens that came are counted.
        reqs = [GenerationRequest([], max_tokens=args.tokens, prompt_text=text, images=(images[i],)) for i in range(n)]
        rate, tokens = asyncio.run(stream_rate(engine, reqs))
        print(f"VlmEngine, {n} stream(s) with an image each: {rate:.1f} tok/s aggregate ({tokens} tokens)")
    worker.stop()


if __name__ == "__main__":
    main()
