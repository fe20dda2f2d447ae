"""The prefix cache's disk tier: files, restarts, identities, damage, the byte budget, shutdown.

Engines run the real tiny models on their own MLX threads; the file-level tests
build KV caches directly (the test thread is then the only one using MLX).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import struct
import tracemalloc
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from app.engine.kv.disk_cache import DiskTier, open_disk_tier
from app.engine.kv.kv_files import FORMAT, TMP_PREFIX, DamagedFileError, Tensor, read_file, write_file
from app.engine.kv.kv_layout import KVLayout, LayerSpec
from app.engine.mlx_internals import KVCache
from app.engine.prompt import TokenPrompt
from app.engine.types import GenerationRequest
from tests.engine.engines import make_engine, run
from tests.engine.test_kv_quant import model_dir  # noqa: F401 - the head_dim-64 tiny llama fixture

SYSTEM = "You are a terse assistant who counts sheep and never stops counting them. " * 12


def disk_engine(path: Path, cache_dir: Path, **params):
    return make_engine(path, prompt_cache_disk_mb=64, prompt_cache_disk_dir=str(cache_dir), **params)


def request(engine, question: str, system: str = SYSTEM, **kw) -> GenerationRequest:
    head = engine.tokenizer.encode(system)
    return GenerationRequest(TokenPrompt(head + engine.tokenizer.encode(question)), max_tokens=8,
                             cache_prefix_len=len(head), **kw)


# Another question after the same system prompt: only the system prompt's file can serve it
# (a conversation's file restores where its own prompt ended, which this one does not share).
ANOTHER = " And how many goats?"


def cold_answer(model: Path, question: str, **params) -> str:
    """``question``'s answer from an engine with no prefix cache at all."""
    eng = make_engine(model, prompt_cache="off", **params)
    try:
        return asyncio.run(run(eng, request(eng, question)))[0]
    finally:
        eng.worker.stop()


def stop(engine) -> None:
    assert engine.finish_writes(30)
    engine.worker.stop()


def files(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.glob("*/*.safetensors"))


def fill(cache_dir: Path, model: Path, **params) -> tuple[str, int]:
    """One cold request on a fresh engine, its writes finished: (its text, system tokens)."""
    eng = disk_engine(model, cache_dir, **params)
    try:
        req = request(eng, " How many sheep?")
        text, last = asyncio.run(run(eng, req))
        assert last.cached_tokens == 0
        return text, req.cache_prefix_len or 0
    finally:
        stop(eng)


# ---- the file format ---------------------------------------------------------------------


def tensors() -> list[Tensor]:
    data = [bytes(range(256)) * 4, b"\x01\x02" * 12]
    return [Tensor("a", "U8", (4, 256), memoryview(data[0])), Tensor("b", "BF16", (1, 3, 4), memoryview(data[1]))]


def test_file_round_trip_is_valid_safetensors(tmp_path):
    size = write_file(tmp_path, "x.safetensors", {"k": "v"}, tensors())
    assert size == (tmp_path / "x.safetensors").stat().st_size
    assert not list(tmp_path.glob(TMP_PREFIX + "*"))
    meta, read = read_file(tmp_path / "x.safetensors")
    assert meta["k"] == "v" and meta["format"] == FORMAT
    assert {n: (t.dtype, t.shape, bytes(t.data)) for n, t in read.items()} == {
        t.name: (t.dtype, t.shape, bytes(t.data)) for t in tensors()}
    arrays = mx.load(str(tmp_path / "x.safetensors"))  # MLX's own reader takes it as it is
    assert arrays["a"].shape == (4, 256) and arrays["b"].dtype == mx.bfloat16


def damage_truncate(raw: bytearray) -> bytearray:
    return raw[: len(raw) - 7]


def damage_data_bit(raw: bytearray) -> bytearray:
    raw[-100] ^= 0x10
    return raw


def damage_header_digit(raw: bytearray) -> bytearray:
    (n,) = struct.unpack_from("<Q", raw)
    shape = re.search(rb'"shape": ?\[(\d)', bytes(raw[8 : 8 + n]))
    assert shape is not None
    i = 8 + shape.start(1)
    raw[i : i + 1] = b"5" if raw[i : i + 1] != b"5" else b"6"  # one digit of a shape, same length
    return raw


def damage_header_length(raw: bytearray) -> bytearray:
    raw[0:8] = struct.pack("<Q", 1 << 40)
    return raw


def damage_empty(raw: bytearray) -> bytearray:
    return bytearray()


DAMAGES = [damage_truncate, damage_data_bit, damage_header_digit, damage_header_length, damage_empty]


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__)
def test_damaged_file_is_detected(tmp_path, damage):
    path = tmp_path / "x.safetensors"
    write_file(tmp_path, path.name, {}, tensors())
    path.write_bytes(bytes(damage(bytearray(path.read_bytes()))))
    with pytest.raises(DamagedFileError):
        read_file(path)


def test_a_failed_write_leaves_no_file(tmp_path):
    bad = [Tensor("a", "U8", (3,), memoryview(b"1234"))]  # 4 bytes for a shape of 3
    with pytest.raises(ValueError):
        write_file(tmp_path, "x.safetensors", {}, bad)
    assert list(tmp_path.iterdir()) == []


# ---- the tier on its own: budget, LRU, shutdown --------------------------------------------


def kv(tokens: int, seed: int) -> list[KVCache]:
    mx.random.seed(seed)
    cache = []
    for _ in range(2):
        c = KVCache()
        c.keys = mx.random.normal((1, 2, tokens, 16)).astype(mx.bfloat16)
        c.values = mx.random.normal((1, 2, tokens, 16)).astype(mx.bfloat16)
        c.offset = tokens
        cache.append(c)
    mx.eval([c.state for c in cache])
    return cache


LAYOUT = KVLayout((LayerSpec("kv", "KVCache", seq=(("keys", 2, 16, "BF16"), ("values", 2, 16, "BF16"))),) * 2,
                  lambda: [KVCache(), KVCache()])  # what kv() makes
# 100 tokens of bfloat16 K and V, 2 layers of 2 heads x 16, the tokens, and room for the header.
PER_FILE = 2 * 2 * (2 * 100 * 16 * 2) + 400 + 2000


def test_queued_writes_finish_on_close_and_the_budget_holds(tmp_path):
    budget = 10 * PER_FILE
    tier = DiskTier(tmp_path / "m", budget_bytes=budget, identity="i" * 20, queue_bytes=1 << 30, layout=LAYOUT)
    prompts = [[i] * 100 for i in range(30)]
    for i, tokens in enumerate(prompts):
        tier.offer("model\x00", tokens, kv(100, i))
    assert tier.close(30)  # everything queued is written before it returns
    tier.collect()
    stats = tier.stats()
    assert stats.writes == 30 and stats.pending == 0 and stats.write_drops == 0
    on_disk = sum(p.stat().st_size for p in (tmp_path / "m").iterdir())
    assert on_disk == stats.bytes <= budget
    assert stats.entries == 10 and stats.evictions == 20
    reopened = DiskTier(tmp_path / "m", budget_bytes=budget, identity="i" * 20, queue_bytes=1 << 30, layout=LAYOUT)
    kept = [i for i, tokens in enumerate(prompts) if reopened.lookup("model\x00", tokens + [7]) is not None]
    assert kept == list(range(20, 30))  # least recently used out: the last ten written stay
    reopened.close()


def test_a_hit_keeps_an_entry_over_newer_ones(tmp_path):
    tier = DiskTier(tmp_path / "m", budget_bytes=3 * PER_FILE, identity="i" * 20, queue_bytes=1 << 30, layout=LAYOUT)
    for i in range(3):
        tier.offer("k", [i] * 100, kv(100, i))
    tier.close(30)
    tier = DiskTier(tmp_path / "m", budget_bytes=3 * PER_FILE, identity="i" * 20, queue_bytes=1 << 30, layout=LAYOUT)
    found = tier.lookup("k", [0] * 100)
    assert found is not None and tier.load(*found, [0] * 100) is not None  # the oldest, used again
    tier.offer("k", [9] * 100, kv(100, 9))
    tier.close(30)
    assert tier.lookup("k", [0] * 100) is not None  # survived: the LRU victim was [1] * 100
    assert tier.lookup("k", [1] * 100) is None
    assert tier.stats().evictions == 1


def test_a_full_queue_drops_writes_instead_of_waiting(tmp_path):
    tier = DiskTier(tmp_path / "m", budget_bytes=1 << 30, identity="i" * 20, queue_bytes=1, layout=LAYOUT)
    for i in range(20):
        tier.offer("k", [i] * 100, kv(100, i))  # one is always taken; the rest only while it is empty
    tier.close(30)
    stats = tier.stats()
    assert stats.writes + stats.write_drops == 20 and stats.writes >= 1


def test_a_cache_cleared_while_serving_is_written_again(tmp_path):
    """Deleting the directory (a user clearing the cache) costs the files, not later writes."""
    tier = DiskTier(tmp_path / "m", budget_bytes=1 << 30, identity="i" * 20, queue_bytes=1 << 30, layout=LAYOUT)
    tier.offer("k", [1] * 100, kv(100, 1))
    tier.close(30)
    shutil.rmtree(tmp_path / "m")
    tier = DiskTier(tmp_path / "m", budget_bytes=1 << 30, identity="i" * 20, queue_bytes=1 << 30, layout=LAYOUT)
    shutil.rmtree(tmp_path / "m")
    found = tier.lookup("k", [1] * 100)
    assert found is None or tier.load(*found, [1] * 100) is None  # gone: a miss
    tier.offer("k", [2] * 100, kv(100, 2))
    tier.close(30)
    assert tier.stats().writes == 1 and tier.stats().write_errors == 0
    assert tier.lookup("k", [2] * 100) is not None and len(list((tmp_path / "m").iterdir())) == 1


# ---- engines: restart, identity, damage ------------------------------------------------------


def test_a_restart_gives_disk_hits_with_the_same_tokens(tiny_model_dir, tmp_path):
    cold_text, system_len = fill(tmp_path, tiny_model_dir)
    eng = disk_engine(tiny_model_dir, tmp_path)
    cold = make_engine(tiny_model_dir)  # no disk tier, nothing cached: prefilled as the others were
    try:
        again = request(eng, " How many sheep?")
        text, last = asyncio.run(run(eng, again))
        # The conversation's file restores where its prompt ended: all of it but the last token.
        whole = len(again.prompt_tokens) - 1
        assert last.cached_tokens == whole and text == cold_text
        other = request(eng, ANOTHER)
        text, last = asyncio.run(run(eng, other))
        assert last.cached_tokens == system_len  # from memory now: the disk hit was promoted
        assert text == asyncio.run(run(cold, other))[0]
        tiers = eng.stats().prompt_cache_tiers
        assert tiers["disk"].hits == 1 and tiers["disk"].tokens == whole
        assert tiers["memory"].hits == 1 and eng.stats().prompt_cache_tokens_saved == whole + system_len
    finally:
        stop(eng)
        cold.worker.stop()


def test_a_conversation_continues_from_disk(tiny_model_dir, tmp_path):
    """An agent's next turn re-sends the whole conversation: it is a stored prefix."""
    eng = disk_engine(tiny_model_dir, tmp_path)
    first = request(eng, " How many sheep?")
    reply, _ = asyncio.run(run(eng, first))
    turn = first.prompt_tokens + eng.tokenizer.encode(reply) + eng.tokenizer.encode(" And now goats?")
    stop(eng)
    eng = disk_engine(tiny_model_dir, tmp_path)
    try:
        _, last = asyncio.run(run(eng, replace(first, prompt=TokenPrompt(turn))))
        assert last.cached_tokens > len(first.prompt_tokens)
    finally:
        stop(eng)


def test_an_unload_finishes_its_writes_and_the_next_load_hits_disk(tiny_model_dir, tmp_path):
    """An idle unload (the registry calls ``close`` on the MLX thread) keeps what was cached."""
    eng = disk_engine(tiny_model_dir, tmp_path)
    first = request(eng, " How many sheep?")
    cold_text, _ = asyncio.run(run(eng, first))
    eng.worker.submit(eng.close).result()  # at once: the writes may still be queued
    eng.worker.stop()
    assert len(files(tmp_path)) == 2  # the system prompt, and the whole conversation
    eng = disk_engine(tiny_model_dir, tmp_path)
    try:
        text, last = asyncio.run(run(eng, first))
        assert last.cached_tokens == len(first.prompt_tokens) - 1 and text == cold_text
        assert eng.stats().prompt_cache_tiers["disk"].hits == 1
    finally:
        stop(eng)


def test_quantized_kv_round_trips_through_disk(model_dir, tmp_path):  # noqa: F811
    cold_text, system_len = fill(tmp_path, model_dir, kv_cache_bits=8)
    eng = disk_engine(model_dir, tmp_path, kv_cache_bits=8)
    try:
        again = request(eng, " How many sheep?")
        text, last = asyncio.run(run(eng, again))
        assert last.cached_tokens == len(again.prompt_tokens) - 1 and text == cold_text
    finally:
        stop(eng)


def test_models_kv_bits_and_namespaces_never_share_files(tiny_model_dir, model_dir, tmp_path):  # noqa: F811
    fill(tmp_path, model_dir)  # "tiny", head_dim 64, float KV
    others = [
        (tiny_model_dir, {}),  # another model under the same name
        (model_dir, {"kv_cache_bits": 8}),  # the same weights, quantized KV
    ]
    for path, params in others:
        eng = disk_engine(path, tmp_path, **params)
        try:
            _, last = asyncio.run(run(eng, request(eng, " How many sheep?")))
            assert last.cached_tokens == 0
            assert eng.stats().prompt_cache_tiers["disk"].hits == 0
        finally:
            stop(eng)
    assert len({p.parent for p in files(tmp_path)}) == 3  # one directory per identity
    eng = disk_engine(model_dir, tmp_path)
    try:
        _, stranger = asyncio.run(run(eng, request(eng, " How many sheep?", cache_namespace="mallory")))
        _, owner = asyncio.run(run(eng, request(eng, " How many sheep?")))
        assert stranger.cached_tokens == 0 and owner.cached_tokens > 0
    finally:
        stop(eng)


def damage_first_prefix(cache_dir: Path, damage) -> Path:
    path = min(files(cache_dir), key=lambda p: int(p.name.split("-")[1]))  # the system prefix
    path.write_bytes(bytes(damage(bytearray(path.read_bytes()))))
    return path


@pytest.mark.parametrize("damage", [damage_truncate, damage_data_bit, damage_header_digit],
                         ids=lambda f: f.__name__)
def test_a_damaged_file_is_ignored_with_a_warning(tiny_model_dir, tmp_path, caplog, damage):
    fill(tmp_path, tiny_model_dir)
    cold_text = cold_answer(tiny_model_dir, ANOTHER)
    path = damage_first_prefix(tmp_path, damage)
    eng = disk_engine(tiny_model_dir, tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="tandem.engine"):
            text, last = asyncio.run(run(eng, request(eng, ANOTHER)))
        assert last.cached_tokens == 0 and text == cold_text
        assert any("damaged" in r.getMessage() and path.name in r.getMessage() for r in caplog.records)
        assert eng.stats().prompt_cache_tiers["disk"].damaged == 1
    finally:
        stop(eng)


def test_a_file_written_for_another_prompt_is_not_used(tiny_model_dir, tmp_path, caplog):
    """Intact, but renamed to another prompt's key: its tokens give it away."""
    fill(tmp_path, tiny_model_dir)
    system, conversation = sorted(files(tmp_path), key=lambda p: int(p.name.split("-")[1]))
    eng = disk_engine(tiny_model_dir, tmp_path)
    other = request(eng, " Q?", system=SYSTEM.replace("sheep", "goats"))
    stop(eng)
    from app.engine.kv.disk_cache import _digest, _tokens_bytes

    head = other.prompt_tokens[: other.cache_prefix_len]
    key = system.name.split("-")[0]
    system.rename(system.with_name(f"{key}-{len(head)}-{_digest(_tokens_bytes(head))[:32]}.safetensors"))
    eng = disk_engine(tiny_model_dir, tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="tandem.engine"):
            _, last = asyncio.run(run(eng, other))
        assert last.cached_tokens == 0 and eng.stats().prompt_cache_tiers["disk"].damaged == 1
    finally:
        stop(eng)


def test_a_write_cut_short_is_never_read(tiny_model_dir, tmp_path):
    """A crash mid-write leaves only a temporary file: never a name a lookup would read."""
    fill(tmp_path, tiny_model_dir)
    for path in files(tmp_path):
        path.rename(path.with_name(TMP_PREFIX + path.name))
    eng = disk_engine(tiny_model_dir, tmp_path)
    try:
        _, last = asyncio.run(run(eng, request(eng, " How many sheep?")))
        assert last.cached_tokens == 0 and eng.stats().prompt_cache_tiers["disk"].hits == 0
    finally:
        stop(eng)


def test_directories_of_other_identities_count_against_the_budget(tmp_path):
    root = tmp_path / "root"
    old = root / f"m-{'a' * 20}"
    old.mkdir(parents=True)
    (old / "x.safetensors").write_bytes(b"0" * 4096)
    keep = open_disk_tier(root, "m", "b" * 20, 1 << 20, 1 << 20, lambda: LAYOUT)
    assert keep is not None and old.exists()  # within the budget: left alone
    keep.close()
    small = open_disk_tier(root, "m", "c" * 20, 1024, 1 << 20, lambda: LAYOUT)
    assert small is not None and not old.exists()
    small.close()


# ---- files made to pass the checksum, and things that are not files --------------------------


def forge(path: Path, change) -> None:
    """Rewrite ``path`` with ``change(tensor) -> (dtype, shape, bytes)`` applied to each K/V tensor,
    and a valid checksum: what someone who can write the cache directory could put there."""
    meta, read = read_file(path)
    out = []
    for t in read.values():
        dtype, shape, data = change(t) if t.name != "tokens" else (t.dtype, t.shape, bytes(t.data))
        out.append(Tensor(t.name, dtype, shape, memoryview(data)))
    path.unlink()
    write_file(path.parent, path.name, meta, out)


def head_dim_halved(t: Tensor):
    return t.dtype, (*t.shape[:-1], t.shape[-1] // 2), bytes(t.data)[: t.data.nbytes // 2]


def dtype_changed(t: Tensor):
    """The same values in another float dtype (F32 <-> F16 / BF16): finite, and the right shape."""
    if t.dtype == "F32":
        return "F16", t.shape, np.frombuffer(t.data, np.float32).astype(np.float16).tobytes()
    half = mx.array(np.frombuffer(t.data, np.uint16)).view(mx.bfloat16 if t.dtype == "BF16" else mx.float16)
    return "F32", t.shape, np.array(half.astype(mx.float32)).tobytes()


def not_finite(t: Tensor):
    return t.dtype, t.shape, b"\xff" * t.data.nbytes if t.name == "0.keys" else bytes(t.data)


@pytest.mark.parametrize("change", [head_dim_halved, dtype_changed, not_finite], ids=lambda f: f.__name__)
def test_a_forged_file_with_a_valid_checksum_is_refused_and_removed(tiny_model_dir, tmp_path, caplog, change):
    fill(tmp_path, tiny_model_dir)
    cold_text = cold_answer(tiny_model_dir, ANOTHER)
    path = min(files(tmp_path), key=lambda p: int(p.name.split("-")[1]))  # the system prefix
    forge(path, change)
    forged = path.read_bytes()
    eng = disk_engine(tiny_model_dir, tmp_path)
    try:
        with caplog.at_level(logging.WARNING, logger="tandem.engine"):
            text, last = asyncio.run(run(eng, request(eng, ANOTHER)))
        assert last.cached_tokens == 0 and text == cold_text  # served, from a prefill
        assert eng.stats().prompt_cache_tiers["disk"].damaged == 1
        assert eng.finish_writes(30)
        assert not path.exists() or path.read_bytes() != forged  # removed (and written again, from this prefill)
        warned = [r for r in caplog.records if path.name in r.getMessage()]
        assert len(warned) == 1 and not [r for r in caplog.records if r.exc_info]
    finally:
        stop(eng)


def swap_fifo(path: Path, tmp_path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def swap_symlink(path: Path, tmp_path: Path) -> None:
    with open(tmp_path / "big", "wb") as f:  # 64 MiB, sparse: nothing of it may be read
        f.truncate(64 * 2**20)
    path.unlink()
    path.symlink_to(tmp_path / "big")


def swap_directory(path: Path, tmp_path: Path) -> None:
    path.unlink()
    path.mkdir()


@pytest.mark.parametrize("swap", [swap_fifo, swap_symlink, swap_directory], ids=lambda f: f.__name__)
def test_what_is_not_a_regular_file_is_never_read_nor_waited_on(tiny_model_dir, tmp_path, caplog, swap):
    """Swapped in while the server runs (after the scan that would have dropped it)."""
    fill(tmp_path / "cache", tiny_model_dir)
    cold_text = cold_answer(tiny_model_dir, ANOTHER)
    path = min(files(tmp_path / "cache"), key=lambda p: int(p.name.split("-")[1]))
    eng = disk_engine(tiny_model_dir, tmp_path / "cache")
    swap(path, tmp_path)
    tracemalloc.start()
    try:
        with caplog.at_level(logging.WARNING, logger="tandem.engine"):
            req = request(eng, ANOTHER)
            text, last = asyncio.run(asyncio.wait_for(run(eng, req), 60))  # the MLX thread never blocks
        peak = tracemalloc.get_traced_memory()[1]
        assert last.cached_tokens == 0 and text == cold_text
        assert peak < 16 * 2**20  # the 64 MiB behind a link were not read
        assert eng.stats().prompt_cache_tiers["disk"].damaged == 1
        assert eng.finish_writes(30)  # removed, and written again from this request's prefill
        assert path.is_file() and not path.is_symlink() and read_file(path)
        warned = [r for r in caplog.records if path.name in r.getMessage()]
        assert len(warned) == 1 and not [r for r in caplog.records if r.exc_info]
        if swap is swap_symlink:
            assert (tmp_path / "big").stat().st_size == 64 * 2**20  # the link went, not its target
    finally:
        tracemalloc.stop()
        with contextlib.suppress(OSError):  # the old code blocks on the FIFO: let it go
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
        stop(eng)


def test_what_is_not_a_regular_file_is_dropped_when_the_tier_opens(tmp_path, caplog):
    tier = DiskTier(tmp_path / "m", budget_bytes=1 << 30, identity="i" * 20, queue_bytes=1 << 30, layout=LAYOUT)
    for i in range(3):
        tier.offer("k", [i] * 100, kv(100, i))
    tier.close(30)
    fifo, link, folder = sorted((tmp_path / "m").iterdir())
    for path, swap in [(fifo, swap_fifo), (link, swap_symlink), (folder, swap_directory)]:
        swap(path, tmp_path)
    with caplog.at_level(logging.WARNING, logger="tandem.engine"):
        tier = DiskTier(tmp_path / "m", budget_bytes=1 << 30, identity="i" * 20, queue_bytes=1 << 30, layout=LAYOUT)
    assert tier.stats().entries == 0 and list((tmp_path / "m").iterdir()) == []
    assert len([r for r in caplog.records if "not a regular file" in r.getMessage()]) == 3
    tier.close()


def test_the_size_is_checked_against_the_header_before_the_data_is_read(tmp_path):
    """A file with 64 MiB more than its header says: refused after reading the header alone."""
    path = tmp_path / "x.safetensors"
    write_file(tmp_path, path.name, {}, tensors())
    with open(path, "ab") as f:
        f.truncate(path.stat().st_size + 64 * 2**20)
    tracemalloc.start()
    try:
        with pytest.raises(DamagedFileError, match="the header describes"):
            read_file(path)
        assert tracemalloc.get_traced_memory()[1] < 2**20
    finally:
        tracemalloc.stop()


def test_a_file_holding_other_tensors_than_asked_is_refused_before_its_data_is_read(tmp_path):
    path = tmp_path / "x.safetensors"
    write_file(tmp_path, path.name, {}, tensors())
    expected = {t.name: (t.dtype, t.shape) for t in tensors()}
    assert read_file(path, expected)[1].keys() == expected.keys()
    for wrong in ({**expected, "b": ("BF16", (1, 3, 2, 2))}, {**expected, "b": ("F16", (1, 3, 4))},
                  {**expected, "c": ("U8", (1,))}):
        with pytest.raises(DamagedFileError, match="not this model's KV"):
            read_file(path, wrong)


def test_the_layout_is_read_off_the_model(demo_model_dir, tmp_path):
    """The embedded SmolLM2's KV is not in the dtype of its first float weights: the layout the
    files are checked against comes from the model's own cache, so its prefixes are still kept."""
    for restart in range(2):
        eng = disk_engine(demo_model_dir, tmp_path)
        try:
            head = eng.tokenizer.encode("You count sheep. " * 8)
            req = GenerationRequest(TokenPrompt(head + eng.tokenizer.encode(" How many?")), max_tokens=2,
                                    cache_prefix_len=len(head))
            _, last = asyncio.run(run(eng, req))
            assert eng.finish_writes(30)
            disk = eng.stats().prompt_cache_tiers["disk"]
            # After the restart the conversation's file restores where the prompt ended.
            whole = len(req.prompt_tokens) - 1
            assert (disk.writes, disk.hits, last.cached_tokens) == ((2, 0, 0) if restart == 0 else (0, 1, whole))
        finally:
            stop(eng)
