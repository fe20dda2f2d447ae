"""Admission's arithmetic, on its own: widths, the rectangle's footprint, eviction, limits."""

from __future__ import annotations

import pytest

from app.engine.batch.admission import KV_STEP, Admission, Waiting, prefill_span, reservation, sequence_width
from app.errors import ContextLengthError


@pytest.mark.parametrize("prompt, max_tokens, segments, width", [
    (100, 600, 1, 700),  # decoding is what it needs most: prompt + max_tokens
    (514, 5, 1, 513 + 511),  # its last prefill step may be padded to a neighbour's full chunk
    (1511, 1, 2, 1510 + 2 * 511),  # a cached prefix ending mid-prompt: two segments, two such steps
])
def test_sequence_width(prompt, max_tokens, segments, width):
    assert sequence_width(prompt, max_tokens, segments=segments, chunk=512) == width


def admission(budget: int = 4000, seqs: int = 8) -> Admission[str]:
    return Admission(budget, seqs, max_queue=8, queue_timeout_s=60)


def test_every_row_costs_the_widest_plus_a_step():
    a = admission()
    for name, width in (("short", 100), ("long", 900), ("mid", 300)):
        a.waiting.append(Waiting(name, width))
    assert a.admit(0, lambda n: 0) == ["short", "long", "mid"]
    assert a.reserved == 3 * (900 + KV_STEP - 1)
    a.release("long")  # the widest leaves: the others shrink to the next widest
    assert a.reserved == 2 * (300 + KV_STEP - 1) and a.running == 2


def test_a_narrow_request_is_charged_the_width_of_the_batch_it_joins():
    a = admission(budget=2 * (1500 + KV_STEP - 1))
    a.waiting.append(Waiting("long", 1500))
    assert a.admit(0, lambda n: 0) == ["long"]
    a.waiting.append(Waiting("tiny", 10))  # a row of the batch: as wide as "long", 1755 tokens
    assert a.admit(0, lambda n: 0) == ["tiny"]
    a.waiting.append(Waiting("another", 10))
    assert a.admit(0, lambda n: 0) == []


def test_cache_is_evicted_for_a_request_and_admissions_can_come_one_at_a_time():
    a = admission(budget=3000)
    evicted: list[int] = []

    def evict(n: int, item: str) -> int:
        evicted.append(n)
        return 2500 - n

    a.waiting.extend([Waiting("a", 700), Waiting("b", 700)])
    assert a.admit(2500, evict, limit=1) == ["a"]
    assert evicted == [700 + KV_STEP - 1 + 2500 - 3000]  # just what "a" needed
    assert [w.item for w in a.waiting] == ["b"]


def test_a_request_wider_than_the_budget_is_refused_at_once():
    a = admission(budget=1000)
    a.check(1000 - (KV_STEP - 1))
    with pytest.raises(ContextLengthError, match="allocation step"):
        a.check(1000 - (KV_STEP - 1) + 1)
    assert a.max_sequence_tokens == 1000 - (KV_STEP - 1)


def test_a_row_reserves_what_it_holds_plus_a_step_within_its_width():
    width = sequence_width(40, 32000, segments=1, chunk=512)
    assert reservation(width, 40, prefill=prefill_span(40, segments=1, chunk=512)) == 39 + 511  # prefilling
    assert reservation(width, 300) == 300 + KV_STEP  # decoding: grows with what it holds
    assert reservation(500, 300) == 500  # never past its whole width


def test_rows_grow_and_the_lowest_priority_widest_newest_row_is_the_one_to_pause():
    a = admission(budget=3 * (300 + KV_STEP - 1))
    for name, tokens, rank in (("claude", 300, 0), ("codex", 300, 0), ("title", 300, 1)):
        a.waiting.append(Waiting(name, tokens, rank=rank))
    assert a.admit(0, lambda n: 0) == ["claude", "codex", "title"]
    assert a.over(0) == 0
    a.resize("claude", 400)  # it decoded: three rows as wide as it no longer fit
    assert a.over(0) == 3 * 100
    keys = {"claude": (0, 32000, 1.0), "codex": (0, 32000, 2.0), "title": (1, 1000, 3.0)}
    assert a.victim(keys) == "title"  # background first
    del keys["title"]
    assert a.victim(keys) == "codex"  # then the widest, the newest of those
    a.requeue("codex", 300 + 2 * KV_STEP, since=0.0, rank=0)
    assert a.running == 2 and a.waiting[0].item == "codex" and a.waiting[0].paused
    assert a.expire(now=10**9) == []  # a paused row never times out: the rows ahead of it end
    a.release("title")
    assert a.victim({"claude": (0, 32000, 1.0)}) is None  # a row alone always fits


def test_a_request_that_cannot_fit_does_not_evict_the_cache():
    """Eviction only for a request it can make fit (a paused row's own KV is in the cache)."""
    a = admission(budget=2000)
    a.waiting.append(Waiting("wide", 700))
    assert a.admit(0, lambda n: 0) == ["wide"]
    evicted: list[int] = []
    a.waiting.append(Waiting("paused", 1000, paused=True))  # 2 x (1000 + 255): more than the budget
    assert a.admit(400, lambda n, item: evicted.append(n) or 0) == []
    assert evicted == []


def test_a_held_request_waits_for_memory_from_when_its_hold_ends():
    """Rows held for a shared prefix a running row computes (a decision's questions behind its
    input) never time out while held, and their queue timeout counts from the hold's end."""
    a = admission()
    a.waiting.append(Waiting("question", 100, since=0.0))
    a.waiting.append(Waiting("other", 100, since=0.0))
    assert a.expire(now=500.0, held=lambda item: item == "question") == ["other"]
    assert a.expire(now=540.0) == []  # 40 s after the hold ended, within the 60 s timeout
    assert a.expire(now=561.0) == ["question"]
