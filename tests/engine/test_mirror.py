"""Rank 0's record, replayed: a TextEngine on MirrorOps and a Follower in one process.

The record goes through JSON as on the wire, and the follower replays it at once on its
own batch and prefix cache over the same tiny model; it checks every step's tokens
against rank 0's (a mismatch raises DesyncError and fails the request). In one process
``all_sum`` is the identity, so the follower samples greedily itself instead of adding 0,
and agrees with its own verify steps' draws (``agree``) instead of adding zeros to rank 0's.
After the work, the follower holds exactly the prefix cache rank 0 holds, and no other
cache: every one rank 0 let go was dropped on the follower too.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace

import mlx.core as mx
import pytest

from app.config.schema import ChatParams
from app.engine.batch.engine import TextEngine
from app.engine.models.loader import load_text_model
from app.engine.params import ModelSource
from app.engine.prompt import TokenPrompt
from app.engine.speculative.adaptive import FreeVerify
from app.engine.step.mirror import DesyncError, Follower, MirrorOps
from app.engine.types import GenerationRequest, SpeculationRequest
from app.engine.worker import MLXWorker
from app.errors import EngineError
from app.specs import engine_params, load_params
from tests.engine.engines import run


class Watch:
    def begin_step(self) -> None: ...

    def end_step(self) -> None: ...


def mirror(model_dir, tamper=None):
    """A TextEngine on MirrorOps, its Follower, the messages sent, and the follower's errors.
    ``tamper(msg)`` may change a message on its way (a rank that replays something else)."""
    # Two prefix-cache entries at most, so evictions happen; 4 slots, so background work pauses.
    # A 1 ms step: every prompt beside a decoding row is prefilled in the smallest chunks, on every rank.
    p = ChatParams(mem=64, max_num_seqs=4, prefill_chunk_size=32, temperature=0.0, cache_min_tokens=8,
                   prompt_cache_entries=2, prefill_step_ms=1)
    worker = MLXWorker()
    worker.start()
    loaded = worker.submit(lambda: load_text_model(ModelSource("tiny", local_path=str(model_dir)),
                                                   load_params(p))).result()
    follower = Follower(loaded.model, loaded.tokenizer, sampler=lambda lp: mx.argmax(lp, axis=-1),
                        agree=lambda table: table)
    messages, errors = [], []

    def send(msg):
        messages.append(msg)
        msg = json.loads(json.dumps(msg))
        if tamper is not None:
            tamper(msg)
        try:
            follower.apply(msg)
        except DesyncError as exc:
            errors.append(exc)
            raise

    ops = MirrorOps(send, Watch())
    worker.add_stepper(ops.flush_idle, lambda exc: None)
    engine = TextEngine(worker, loaded, engine_params(p), ops=ops)
    # Every proposal verified, whatever this CPU's step timings.
    engine.speculator.adaptive.costs = FreeVerify()
    return engine, follower, messages, errors


@pytest.fixture(scope="module")
def mirrored(tiny_model_dir):
    engine, follower, messages, errors = mirror(tiny_model_dir)
    yield engine, follower, messages
    engine.worker.stop()
    assert not errors


def request(engine, text: str, max_tokens: int, **kw) -> GenerationRequest:
    return GenerationRequest(TokenPrompt(engine.tokenizer.encode(text)), max_tokens=max_tokens, **kw)


def test_the_follower_keeps_in_step_and_holds_what_rank_0_holds(mirrored):
    engine, follower, messages = mirrored
    # A disk tier is on by default, but would make caches no follower replays: off on rank 0.
    assert engine.params.prompt_cache_disk_bytes and engine.prompt_cache.disk is None
    system = "You are a terse assistant. " * 6
    prompts = [system + f"Question {i}?" for i in range(4)]

    async def work():
        prefixed = [request(engine, p, 12, cache_prefix_len=len(engine.tokenizer.encode(system))) for p in prompts]
        texts = await asyncio.gather(*(run(engine, r) for r in prefixed))
        again = await run(engine, prefixed[1])  # a prefix-cache hit
        background = [request(engine, f"Title {i} " * 5, 40, priority="background") for i in range(3)]
        interactive = request(engine, "An interactive question " * 10, 4)
        started = asyncio.gather(*(run(engine, r) for r in background))
        await asyncio.sleep(0.3)  # the background ones are decoding: the interactive one pauses them
        texts += [await run(engine, interactive), *await started]
        texts.append(await run(engine, request(engine, prompts[0], 12, stop=("Question",))))
        cancelled = engine.stream(request(engine, "Cancel me " * 4, 200))
        await cancelled.__anext__()
        await cancelled.aclose()
        return texts, again

    pauses = engine.stats().background_pauses
    texts, (again_text, again_last) = asyncio.run(work())
    assert all(last.finish_reason in ("length", "stop") for _, last in texts)
    assert again_last.cached_tokens > 0 and again_text == texts[1][0]
    assert engine.stats().background_pauses > pauses
    time.sleep(0.5)  # idle: pending drops go out

    def compare():
        return len(follower.caches), len(follower.prompt_cache), follower.prompt_cache.nbytes, \
            len(engine.prompt_cache), engine.prompt_cache.nbytes

    held, f_entries, f_bytes, entries, nbytes = engine.worker.submit(compare).result()
    assert (f_entries, f_bytes) == (entries, nbytes) and entries == 2
    assert held == 0, "the follower still holds caches rank 0 let go"
    ops = {op[0] for m in messages for op in m["ops"]}
    assert {"batch", "insert", "remove", "extract", "fetch", "store", "finished", "drop", "chunk"} <= ops


SPEC_OFF = SpeculationRequest(prompt_lookup=False)


def test_verify_steps_replay_on_the_follower_and_give_the_plain_output(mirrored):
    """Rank 0's proposals travel with the step; the follower verifies the same ones (its
    check of every emitted token would raise otherwise) and the answers are the plain ones."""
    engine, follower, messages = mirrored
    lookup = request(engine, "one two three four five six seven eight " * 4, 24)
    chat = request(engine, "Write a short poem about the sea and the sky.", 24)
    plains = [asyncio.run(run(engine, replace(r, speculation=SPEC_OFF)))[0] for r in (lookup, chat)]
    predicted = replace(chat, speculation=SpeculationRequest(tuple(engine.tokenizer.encode(plains[1])), False))
    start = len(messages)

    async def together():
        return await asyncio.gather(run(engine, lookup), run(engine, predicted),
                                    run(engine, replace(chat, speculation=SPEC_OFF)))

    out = asyncio.run(together())
    assert [text for text, _ in out] == [plains[0], plains[1], plains[1]]
    assert out[1][1].accepted_prediction_tokens > 0
    time.sleep(0.5)  # idle: the last step's check goes out
    ops = [op for m in messages[start:] for op in m["ops"]]
    assert any(op[0] == "propose" for op in ops) and ops[-1][0] in ("check", "finished", "drop")
    assert {"verify"} <= {op[0] for m in messages for op in m["ops"]}


def test_a_follower_that_verifies_other_proposals_is_caught(tiny_model_dir):
    def tamper(msg):
        for op in msg["ops"]:
            if op[0] == "propose":
                op[1] = [[uid, [(t + 1) % 1000 for t in tokens]] for uid, tokens in op[1]]

    engine, _, messages, errors = mirror(tiny_model_dir, tamper)
    try:
        req = request(engine, "Write a short poem about the sea and the sky.", 16)
        plain, _ = asyncio.run(run(engine, replace(req, speculation=SPEC_OFF)))
        prediction = SpeculationRequest(tuple(engine.tokenizer.encode(plain)), False)
        with pytest.raises(EngineError, match="differs from rank 0"):  # rank 0 fails the batch: it cannot follow
            asyncio.run(run(engine, replace(req, speculation=prediction)))
        assert errors and "differs from rank 0's" in str(errors[0])
    finally:
        engine.worker.stop()
