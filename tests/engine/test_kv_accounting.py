"""KV accounting matches what MLX allocates, on a real tiny model, float and 8-bit KV.

Sequences of awkward lengths (not multiples of the 256-token allocation step,
mixed in one batch, some resuming from the prefix cache) run under a tight
``mem``. Between every two engine steps, a job on the MLX thread reads the bytes
MLX reports for the caches (mlx-lm's ``BatchGenerator.prompt_cache_nbytes`` and
the prefix cache's entries) next to the admission figure (the reserved
footprint plus the prefix cache). The bytes never exceed the figure, the figure
never exceeds ``mem``, and when rows run to their end together the figure is
within one allocation step per row of the bytes.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from app.engine.batch.admission import KV_STEP
from app.engine.prompt import TokenPrompt
from app.engine.types import GenerationRequest
from tests.engine.engines import make_engine, run
from tests.fixtures.tiny_llama import build_tiny_llama

# 4 layers x 4 KV heads x head_dim 64: 8 KB a token in float32, 2.25 KB at 8 bits,
# so 16 MB (the least `mem` there is) holds 2,048 / 7,281 tokens.
CONFIG = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64, "rms_norm_eps": 1e-5, "vocab_size": 32768,
    "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": True,
}
MEM_MB = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, demo_model_dir):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-kv"), demo_model_dir, CONFIG, seed=1)


class Sampler:
    """Reads the caches' bytes and the admission figure between engine steps, on the MLX thread."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.samples: list[tuple[int, int, int]] = []  # (bytes MLX reports, admission figure, rows)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def read(self) -> tuple[int, int, int]:
        eng = self.engine
        paused = sum(c.nbytes for s in eng._paused for c in (s.paused[0] if s.paused else ()))
        held = eng._bg.prompt_cache_nbytes + eng.prompt_cache.nbytes + paused
        figure = eng.admission.reserved + eng.prompt_cache.nbytes
        return held, figure, len(eng._running) + len(eng._paused)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.engine.worker.submit(self.read).result())

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def prompt(n: int, seed: int) -> list[int]:
    return [1000 + (seed * 7919 + i * 31) % 30000 for i in range(n)]  # ids the model and tokenizer share


async def together(engine, reqs):
    return await asyncio.gather(*(run(engine, r) for r in reqs))


@pytest.mark.parametrize("bits", [None, 8])
def test_cache_bytes_stay_within_the_admission_figure_and_mem(model_dir, bits):
    eng = make_engine(model_dir, mem=MEM_MB, kv_cache_bits=bits, max_num_seqs=4, prefill_chunk_size=128,
                      prompt_cache="prefix", cache_min_tokens=16, prompt_cache_mem=8)
    mem = MEM_MB * 2**20
    try:
        lengths = [37, 300, 213, 129, 400, 251, 90, 77]
        first = [GenerationRequest(TokenPrompt(prompt(n, i)), max_tokens=80 - 3 * i) for i, n in enumerate(lengths)]
        # Then continuations of the last ones: the prefix cache hands their start over and they
        # prefill the rest, next to fresh prompts padded to the same chunks.
        second = [GenerationRequest(TokenPrompt(prompt(n, i) + prompt(40 + 17 * i, 99)), max_tokens=60,
                                     cache_prefix_len=n)
                  for i, n in reversed(list(enumerate(lengths))[4:])]
        second += [GenerationRequest(TokenPrompt(prompt(n, 50 + i)), max_tokens=70) for i, n in enumerate((333, 201))]
        with Sampler(eng) as sampler:
            asyncio.run(together(eng, first))
            results = asyncio.run(together(eng, second))
        assert any(last.cached_tokens for _, last in results)  # the prefix cache was used
        busy = [s for s in sampler.samples if s[2]]
        # Many steps were watched (fewer than tokens: rows that speculate emit several a step).
        assert len(busy) > 50
        for held, figure, rows in busy:
            assert held <= figure <= mem, (held, figure, rows)
        assert max(rows for _, _, rows in busy) >= 2  # several sequences shared the batch
        assert max(held for held, _, _ in busy) > mem // 2  # and the budget was what limited them
    finally:
        eng.worker.stop()


@pytest.mark.parametrize("bits", [None, 8])
def test_the_admission_figure_is_within_one_step_of_the_bytes(model_dir, bits):
    """Rows prefilled in one step and decoded to their end together: at the end the figure
    exceeds the bytes MLX holds by less than one allocation step per row."""
    eng = make_engine(model_dir, mem=MEM_MB, kv_cache_bits=bits, max_num_seqs=4, prefill_chunk_size=128,
                      prompt_cache="off")
    try:
        reqs = [GenerationRequest(TokenPrompt(prompt(n, i)), max_tokens=130) for i, n in enumerate((37, 77, 101))]
        with Sampler(eng) as sampler:
            results = asyncio.run(together(eng, reqs))
        assert all(last.completion_tokens == 130 for _, last in results)
        held, figure, rows = max(sampler.samples)
        assert rows == 3
        assert 0 <= figure - held < rows * KV_STEP * eng.bytes_per_token, (held, figure)
        # The old figure, prompt + max_tokens a sequence, was below what MLX held.
        assert sum(len(r.prompt_tokens) + r.max_tokens for r in reqs) * eng.bytes_per_token < held
    finally:
        eng.worker.stop()


def test_long_rows_reserve_as_they_grow_and_a_small_request_is_not_starved(model_dir):
    """Two rows that may write 1,000 tokens each and a title-sized request, in a budget
    (2,048 tokens) that holds one long row whole. Reserving max_tokens up front ran the
    long rows one after the other and the small request after both; reserving what a row
    holds plus a step admits all three at once: the small one ends first, and when the
    long rows outgrow the budget the wider, newer one is paused (its KV to the prefix
    cache) and resumes when the other ends, with the output it has alone."""
    eng = make_engine(model_dir, mem=MEM_MB, max_num_seqs=4, prefill_chunk_size=128, prompt_cache="off",
                      prompt_cache_mem=8)
    try:
        long_a = GenerationRequest(TokenPrompt(prompt(40, 1)), max_tokens=1000)
        long_b = GenerationRequest(TokenPrompt(prompt(41, 2)), max_tokens=1000)
        small = GenerationRequest(TokenPrompt(prompt(30, 3)), max_tokens=8)
        alone = [asyncio.run(run(eng, r))[0] for r in (long_a, long_b)]
        order: list[str] = []

        async def timed(name: str, req: GenerationRequest) -> str:
            text, last = await run(eng, req)
            order.append(name)
            assert last.completion_tokens == req.max_tokens or last.finish_reason == "stop"
            return text

        async def main() -> list[str]:
            return await asyncio.gather(timed("a", long_a), timed("b", long_b), timed("small", small))

        with Sampler(eng) as sampler:
            text_a, text_b, _ = asyncio.run(main())
        assert order[0] == "small", order
        assert eng.memory_pauses >= 1 and eng.stats().memory_pauses == eng.memory_pauses  # /metrics reads it
        assert eng.prompt_cache.stats()["memory"].hits >= 1  # it resumed from its KV in the prefix cache
        assert [text_a, text_b] == alone, "a pause for memory must not change what a row generates"
        mem = MEM_MB * 2**20
        for held, figure, rows in sampler.samples:
            assert held <= figure <= mem, (held, figure, rows)
        assert eng.admission.reserved == 0 and eng.admission.running == 0 and not eng.admission.waiting
    finally:
        eng.worker.stop()
