"""CaptionCache: LRU by entry count, keyed by image, prompt, model and partition."""

from __future__ import annotations

import pytest

from app.vision.cache import CaptionCache, CaptionKey


def key(sha: str, prompt: str = "p", model: str = "m", scope: str = "") -> CaptionKey:
    return CaptionKey(sha, prompt, model, scope)


def test_hit_and_miss_counters():
    cache = CaptionCache(max_entries=4)
    assert cache.get(key("a")) is None
    cache.put(key("a"), "a cat")
    assert cache.get(key("a")) == "a cat"
    assert (cache.hits, cache.misses) == (1, 1)
    assert cache.stats() == {"entries": 1, "max_entries": 4, "hits": 1, "misses": 1, "evictions": 0, "bytes": 5}


def test_evictions_and_bytes_are_counted():
    cache = CaptionCache(max_entries=2)
    for name in "abc":
        cache.put(key(name), f"caption {name}")
    cache.put(key("c"), "ç")  # replaced, not added: its old bytes go
    assert cache.stats() == {"entries": 2, "max_entries": 2, "hits": 0, "misses": 0, "evictions": 1,
                              "bytes": len("caption b") + 2}
    cache.clear()
    assert cache.stats()["bytes"] == 0


def test_every_key_field_matters():
    cache = CaptionCache()
    cache.put(key("a"), "x")
    assert cache.get(key("b")) is None
    assert cache.get(key("a", prompt="other")) is None
    assert cache.get(key("a", model="other")) is None


def test_least_recently_used_is_evicted():
    cache = CaptionCache(max_entries=2)
    cache.put(key("a"), "A")
    cache.put(key("b"), "B")
    cache.get(key("a"))  # a is now the most recent
    cache.put(key("c"), "C")
    assert key("b") not in cache
    assert cache.get(key("a")) == "A" and cache.get(key("c")) == "C"
    assert len(cache) == 2


def test_zero_entries_disables_and_negative_is_refused():
    cache = CaptionCache(max_entries=0)
    cache.put(key("a"), "A")
    assert len(cache) == 0
    with pytest.raises(ValueError):
        CaptionCache(max_entries=-1)
