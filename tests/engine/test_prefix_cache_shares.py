"""One key's share of the prefix cache (issue 30): its own prefixes go first once it holds more.

The red team wrote 267 MB to the disk tier from 120 abandoned prompts of one key, and
every other key's prefixes went. ``prompt_cache_key_share`` (models.yaml, default 0.5)
caps what one cache partition (an API key, a cache_salt) holds before its own entries
are evicted first, in memory and on disk.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from pydantic import ValidationError

from app.config.schema import ChatParams
from tests.engine.engines import make_engine, run
from tests.engine.test_disk_cache import SYSTEM, disk_engine, files, request, stop


def written(eng) -> None:
    """Wait for the disk writer to empty its queue (``finish_writes`` would close the tier)."""
    deadline = time.monotonic() + 30
    while eng.stats().prompt_cache_tiers["disk"].pending:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def small_disk(model, cache_dir):
    """A disk tier of 1 MB: about eight of the tiny model's prefixes."""
    return make_engine(model, prompt_cache_disk_mb=1, prompt_cache_disk_dir=str(cache_dir))


def test_one_keys_abandoned_prompts_leave_another_keys_prefix_on_disk(tiny_model_dir, tmp_path):
    """Bob's system prompt survives Mallory's flood of distinct prompts, and a restart reads it."""
    eng = small_disk(tiny_model_dir, tmp_path)
    try:
        bob = request(eng, " How many sheep?", cache_namespace="bob")
        asyncio.run(run(eng, bob))
        written(eng)
        bobs = set(files(tmp_path))
        for i in range(12):
            flood = request(eng, " Q?", system=SYSTEM.replace("sheep", f"goats ({i})"), cache_namespace="mallory")
            asyncio.run(run(eng, flood))
        assert eng.finish_writes(30)
        disk = eng.stats().prompt_cache_tiers["disk"]
        assert disk.evictions > 0 and disk.bytes <= 2**20  # the flood did not fit
        assert bobs <= set(files(tmp_path))
    finally:
        stop(eng)
    eng = small_disk(tiny_model_dir, tmp_path)
    try:
        _, last = asyncio.run(run(eng, request(eng, " How many sheep?", cache_namespace="bob")))
        assert last.cached_tokens == len(bob.prompt_tokens) - 1  # where bob's prompt ended
        assert eng.stats().prompt_cache_tiers["disk"].hits == 1
    finally:
        stop(eng)


def test_the_share_is_a_models_yaml_setting_of_both_tiers(tiny_model_dir, tmp_path):
    assert ChatParams().prompt_cache_key_share == 0.5
    for bad in (0, 1.5, -0.1):
        with pytest.raises(ValidationError, match="prompt_cache_key_share"):
            ChatParams(prompt_cache_key_share=bad)
    eng = disk_engine(tiny_model_dir, tmp_path, prompt_cache_key_share=0.25)
    plain = make_engine(tiny_model_dir)
    try:
        assert eng.prompt_cache.key_share == 0.25 and eng.prompt_cache.disk is not None
        assert eng.prompt_cache.disk.key_share == 0.25
        assert plain.prompt_cache.key_share == 0.5
    finally:
        stop(eng)
        plain.worker.stop()
