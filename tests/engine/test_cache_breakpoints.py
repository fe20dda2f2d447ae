"""Cache breakpoints in the engine (``GenerationRequest.cache_breakpoints``), on a real tiny
model: an entry stored exactly at each, pinned for its TTL ahead of the traffic that fills
the cache, its tokens reported as written and then read; breakpoints only in explicit
mode; pins on disk across a restart; and one prefix computed once for the requests that
share it while it is being computed."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from pathlib import Path

import pytest

from app.engine.kv.disk_index import DiskEntry, DiskIndex
from app.engine.prompt import TokenPrompt
from app.engine.types import CacheBreakpoint, GenerationRequest
from tests.engine.engines import make_engine, run

SYSTEM = "You are a careful assistant who answers questions about farms and their animals. " * 16


def tokens(engine, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text, add_special_tokens=False))


def marked(engine, question: str, ttl: int = 300, *, system: str = SYSTEM, **kw) -> GenerationRequest:
    """``system`` then ``question``, a breakpoint where the system prompt ends."""
    head = tokens(engine, system)
    return GenerationRequest(TokenPrompt(head + tokens(engine, question)), max_tokens=2,
                             cache_breakpoints=(CacheBreakpoint(len(head), ttl),), **kw)


def unmarked(engine, question: str, *, system: str = SYSTEM) -> GenerationRequest:
    """The same prompt with the system prompt as the prefix Tandem caches on its own."""
    head = tokens(engine, system)
    return GenerationRequest(TokenPrompt(head + tokens(engine, question)), max_tokens=2, cache_prefix_len=len(head))


def ask(engine, req: GenerationRequest):
    return asyncio.run(run(engine, req))[1]


def traffic(engine, n: int) -> None:
    """``n`` unrelated conversations, each long enough to be cached, each its own prefix."""
    for i in range(n):
        ask(engine, unmarked(engine, f" Question {i}?", system=f"Document {i}: " + f"word{i} " * 200))


def entries(engine) -> dict[tuple[int, ...], float]:
    """The memory tier's entries: tokens -> pinned until (monotonic)."""
    return {e.tokens: e.pinned_until for e in engine.prompt_cache.memory.entries()}


def pinned(engine, prefix: tuple[int, ...]) -> float:
    """Until when the entry that keeps ``prefix`` is pinned: its own, or a longer one's that
    took it in (an entry of a longer sequence holds its prefixes' KV, and their pins)."""
    return max((until for tokens, until in entries(engine).items() if tokens[:len(prefix)] == prefix), default=0.0)


@pytest.fixture
def engine(tiny_model_dir):
    # 1 MB of prefix cache: about 2,000 tokens of this model's KV, a few conversations.
    eng = make_engine(tiny_model_dir, prompt_cache_mem=1)
    yield eng
    eng.worker.stop()


def test_a_breakpoint_stores_its_prefix_pinned_and_reports_it_written_then_read(engine):
    head = tuple(tokens(engine, SYSTEM))
    first = ask(engine, marked(engine, " How many cows?"))
    assert first.cached_tokens == 0 and first.cache_write_tokens == len(head)
    assert pinned(engine, head) > time.monotonic() + 200  # the marked prefix, pinned for ~300 s
    second = ask(engine, marked(engine, " And how many goats?"))
    assert second.cached_tokens == len(head) and second.cache_write_tokens == 0


def test_a_pinned_prefix_outlives_traffic_that_fills_the_cache_twice(engine):
    head = len(tokens(engine, SYSTEM))
    ask(engine, marked(engine, " How many cows?"))
    before = engine.prompt_cache.stats()["memory"].evictions
    traffic(engine, 16)
    assert engine.prompt_cache.stats()["memory"].evictions - before >= 8  # the cache turned over
    assert ask(engine, marked(engine, " And how many goats?")).cached_tokens == head
    # The control: the same prefix unmarked goes the way of the least recently used.
    ask(engine, unmarked(engine, " How many cows?", system=SYSTEM.upper()))
    traffic(engine, 16)
    assert ask(engine, unmarked(engine, " And how many goats?", system=SYSTEM.upper())).cached_tokens == 0


def test_an_expired_pin_is_an_ordinary_entry(engine):
    ask(engine, marked(engine, " How many cows?", ttl=1))
    time.sleep(1.2)
    traffic(engine, 16)
    assert ask(engine, marked(engine, " And how many goats?")).cached_tokens == 0


def test_explicit_mode_caches_at_the_breakpoints_only(engine):
    head = tuple(tokens(engine, SYSTEM))
    req = marked(engine, " How many cows?", cache_implicit=False)
    ask(engine, req)
    assert list(entries(engine)) == [head]  # not the conversation at its end
    ask(engine, marked(engine, " How many sheep?"))  # implicit, the default: the conversation too
    assert max(map(len, entries(engine))) > len(head)


def test_a_breakpoint_cached_already_is_pinned_again(engine):
    head = tuple(tokens(engine, SYSTEM))
    ask(engine, marked(engine, " How many cows?", ttl=5))
    short = pinned(engine, head)
    ask(engine, marked(engine, " How many goats?", ttl=3600))
    assert pinned(engine, head) > short + 3000


def test_requests_with_one_prefix_compute_it_once_and_keep_their_answers(tiny_model_dir):
    eng = make_engine(tiny_model_dir, prefill_chunk_size=16)
    try:
        head = len(tokens(eng, SYSTEM))
        questions = [" How many cows?", " How many goats are there?", " And the sheep?"]

        async def together():
            return await asyncio.gather(*(run(eng, unmarked(eng, q)) for q in questions))

        results = asyncio.run(together())
        # One computed the system prompt; the others waited for it and read it from the cache.
        assert sorted(last.cached_tokens for _, last in results) == [0, head, head]
        cold = [asyncio.run(run(eng, replace(unmarked(eng, q), cache_namespace="cold")))[0] for q in questions]
        assert [text for text, _ in results] == cold
        assert eng.admission.reserved == 0 and eng.admission.running == 0
    finally:
        eng.worker.stop()


def test_pins_survive_a_restart_through_the_disk_tier(tiny_model_dir, tmp_path):
    params = {"prompt_cache_disk_mb": 64, "prompt_cache_disk_dir": str(tmp_path)}
    eng = make_engine(tiny_model_dir, **params)
    try:
        head = tuple(tokens(eng, SYSTEM))
        ask(eng, marked(eng, " How many cows?", ttl=3600))
        assert eng.finish_writes(30)
    finally:
        eng.worker.stop()
    pins = json.loads(next(tmp_path.rglob("pins.json")).read_text())
    assert any(name.split("-")[1] == str(len(head)) and until > time.time() + 3000 for name, until in pins.items())
    eng = make_engine(tiny_model_dir, **params)
    try:
        again = ask(eng, marked(eng, " And how many goats?", ttl=1))
        assert again.cached_tokens == len(head)
        # Loaded from disk, it is back in memory pinned for what its pin had left (about an hour).
        assert pinned(eng, head) > time.monotonic() + 3000
    finally:
        eng.worker.stop()


def test_the_disk_tier_evicts_pinned_files_last_within_their_share():
    index = DiskIndex(budget_bytes=300, key_share=1.0, pin_share=0.5)
    now = time.time()

    def entry(name: str, size: int, used: float, pinned: float = 0.0) -> DiskEntry:
        return DiskEntry("k" * 16, len(name), name.ljust(32, "0"), Path(name), size, used, {}, pinned)

    index.add(entry("a", 50, used=1.0, pinned=now + 60))  # the oldest, pinned: kept
    index.add(entry("bb", 100, used=2.0))
    index.add(entry("ccc", 100, used=3.0, pinned=now - 1))  # expired: an ordinary file
    index.add(entry("dddd", 100, used=4.0))
    order = []
    while (victim := index.victim()) is not None:
        order.append(victim.n_tokens)
        index.forget(victim)
    assert order == [2]  # least recently used first among the unpinned ones
    index.budget_bytes = 100
    while (victim := index.victim()) is not None:
        order.append(victim.n_tokens)
        index.forget(victim)
    assert order == [2, 3, 4] and index.bytes == 50  # the pinned one last: it stays
