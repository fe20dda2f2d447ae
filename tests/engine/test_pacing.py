"""Prefill chunks sized by time: the pacer's arithmetic, and the engine sizing real chunks.

No timing here: the engine reads a virtual clock that the tiny model itself advances as
it runs (a fixed cost per prompt token prefilled and per decode step), so the rates it
measures, and the chunks it chooses, are known in advance.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from app.config.schema import ChatParams
from app.engine.batch.engine import TextEngine
from app.engine.batch.pacing import FIRST_CHUNK, MIN_CHUNK, PrefillPacer
from app.engine.models.loader import load_text_model
from app.engine.params import ModelSource
from app.engine.prompt import TokenPrompt
from app.engine.types import GenerationRequest, SpeculationRequest
from app.engine.worker import MLXWorker
from app.specs import engine_params, load_params
from tests.engine.engines import run


def test_a_small_first_chunk_then_every_step_within_its_budget_decoding_or_not():
    pacer = PrefillPacer(cap=512, budget_s=0.5)
    assert pacer.chunk(decoding=False) == FIRST_CHUNK  # nothing measured yet: a small chunk measures it
    pacer.observe(prefilled=512, decoding=False, seconds=5.12)  # 10 ms a token, alone
    pacer.observe(prefilled=0, decoding=True, seconds=0.05)  # a decode step: 50 ms
    assert pacer.chunk(decoding=False) == 50  # nothing decodes, yet a request may arrive: 500 ms at 10 ms a token
    assert pacer.chunk(decoding=True) == 45  # (500 - 50) ms at 10 ms a token
    assert pacer.chunk(decoding=True, prompts=2) == 22  # two prompts share the step


def test_the_rate_follows_the_steps_beside_decoding_rows():
    pacer = PrefillPacer(cap=512, budget_s=0.45)
    pacer.observe(prefilled=100, decoding=False, seconds=1.0)  # 10 ms a token
    pacer.observe(prefilled=0, decoding=True, seconds=0.05)
    for _ in range(30):  # slower now (a longer context): 20 ms a token, less the decode's 50 ms
        pacer.observe(prefilled=20, decoding=True, seconds=0.05 + 20 * 0.02)
    assert pacer.chunk(decoding=True) == pytest.approx(20, abs=1)  # (450 - 50) ms at 20 ms a token


def test_a_slow_decode_still_lets_a_prompt_move_and_zero_turns_it_off():
    pacer = PrefillPacer(cap=512, budget_s=0.25)
    pacer.observe(prefilled=0, decoding=True, seconds=0.4)  # the decode alone is over budget
    pacer.observe(prefilled=100, decoding=True, seconds=0.5)
    assert pacer.chunk(decoding=True) == MIN_CHUNK
    off = PrefillPacer(cap=512, budget_s=0)
    off.observe(prefilled=100, decoding=True, seconds=50.0)
    assert off.chunk(decoding=True) == 512


class Metered:
    """The tiny model, charging a virtual clock as it runs: ``per_token`` seconds for each
    prompt token of a prefill call (every row), ``per_decode`` for each decode step."""

    def __init__(self, model, per_token: float, per_decode: float) -> None:
        self.model, self.per_token, self.per_decode = model, per_token, per_decode
        self.now = 0.0
        self.chunks: list[int] = []  # each prefill call's chunk (columns)

    def __call__(self, inputs, *args, **kwargs):
        rows, n = inputs.shape[0], inputs.shape[1]
        if n == 1:
            self.now += self.per_decode
        else:
            self.now += self.per_token * rows * n
            self.chunks.append(n)
        return self.model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


def test_alone_and_beside_a_decoding_stream_chunks_are_sized_to_the_step_budget(tiny_model_dir):
    p = ChatParams(mem=64, max_num_seqs=4, prefill_chunk_size=128, prefill_step_ms=250, temperature=0.0,
                   prompt_cache="off", prompt_cache_disk_mb=0)
    worker = MLXWorker()
    worker.start()
    try:
        loaded = worker.submit(lambda: load_text_model(ModelSource("tiny", local_path=str(tiny_model_dir)),
                                                       load_params(p))).result()
        metered = Metered(loaded.model, per_token=0.005, per_decode=0.04)
        engine = TextEngine(worker, replace(loaded, model=metered), engine_params(p), clock=lambda: metered.now)
        # No speculation: the metered model takes every multi-token call for a prefill chunk.
        plain = SpeculationRequest(prompt_lookup=False)
        stream = GenerationRequest(TokenPrompt([1000 + i for i in range(300)]), max_tokens=80, speculation=plain)
        prompt = GenerationRequest(TokenPrompt([2000 + i for i in range(400)]), max_tokens=2, speculation=plain)

        async def main() -> None:
            deltas = engine.stream(stream)
            await deltas.__anext__()  # decoding now
            alone = len(metered.chunks)
            await run(engine, prompt)
            beside.extend(metered.chunks[alone:])
            async for _ in deltas:
                pass

        beside: list[int] = []
        asyncio.run(main())
        # Alone, the stream's prompt went in chunks of the budget too (a request may arrive at any
        # step): a first one that measures the rate, then 250 ms at 5 ms a token (299 tokens: the
        # last one is decoded).
        assert metered.chunks[:3] == [FIRST_CHUNK, 50, 50]
        # Beside it, (250 - 40) ms at 5 ms a token: 42 tokens a step, the last piece what is left.
        assert beside[:-1] and all(c in (41, 42) for c in beside[:-1]), beside
        assert sum(beside) == 399 and beside[-1] <= 42
        assert engine.pacer.decode_s == pytest.approx(0.04)
        assert engine.pacer.prefill_s_per_token == pytest.approx(0.005)
    finally:
        worker.stop()
