"""Helpers for engine tests: a TextEngine on a real model directory, and a run to the end."""

from __future__ import annotations

from app.config.schema import ChatParams
from app.engine.batch.engine import TextEngine
from app.engine.models.loader import load_text_model
from app.engine.params import ModelSource
from app.engine.types import GenerationRequest, TokenDelta
from app.engine.worker import MLXWorker
from app.specs import engine_params, load_params


def make_engine(path, **params) -> TextEngine:
    """Its own MLX thread and model; stop it with ``engine.worker.stop()``. No disk tier
    unless ``prompt_cache_disk_mb`` says (then give it its own ``prompt_cache_disk_dir``)."""
    p = ChatParams(**{"mem": 64, "max_num_seqs": 4, "prefill_chunk_size": 32, "temperature": 0.0,
                       "cache_min_tokens": 8, "prompt_cache_disk_mb": 0, **params})
    worker = MLXWorker()
    worker.start()
    loaded = worker.submit(lambda: load_text_model(ModelSource("tiny", local_path=str(path)), load_params(p))).result()
    return TextEngine(worker, loaded, engine_params(p))


async def run(engine: TextEngine, req: GenerationRequest) -> tuple[str, TokenDelta]:
    """The whole text of one request and its final delta."""
    text, last = [], None
    async for d in engine.stream(req):
        text.append(d.text)
        last = d
    assert last is not None
    return "".join(text), last


def vlm_engine(worker: MLXWorker, loaded, params, feature_cache_bytes: int = 0) -> TextEngine:
    """The chat engine serving a loaded VLM (``app.engine.batch.vision_rows``)."""
    from app.engine.batch.vision_rows import VisionRows

    return TextEngine(worker, loaded, params, vision=VisionRows(loaded, worker, feature_cache_bytes))
