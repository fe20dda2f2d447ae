"""The text engine on a real tiny model: batching, stops, cancel, budget, prefix cache."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from app.engine.prompt import MultimodalPrompt, PromptImage, TokenPrompt
from app.engine.types import GREEDY, GenerationRequest
from app.errors import ContextLengthError, EngineError, RateLimitError, VisionNotSupportedError
from tests.engine.engines import make_engine, run


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = make_engine(tiny_model_dir)
    yield eng
    eng.worker.stop()




def prompt(engine, text="Hello there, how are you today?"):
    return engine.tokenizer.encode(text)


def test_generates_exact_token_counts(engine):
    req = GenerationRequest(TokenPrompt(prompt(engine)), max_tokens=7)
    text, last = asyncio.run(run(engine, req))
    assert last.finish_reason == "length"
    assert last.completion_tokens == 7
    assert last.prompt_tokens == len(req.prompt_tokens)
    assert engine.admission.reserved == 0 and engine.admission.running == 0


def test_batched_equals_alone_at_temperature_zero(engine):
    reqs = [GenerationRequest(TokenPrompt(prompt(engine, f"Count to {i} please")), max_tokens=6) for i in range(4)]
    alone = [asyncio.run(run(engine, r))[0] for r in reqs]

    async def together():
        return await asyncio.gather(*(run(engine, r) for r in reqs))

    batched = [t for t, _ in asyncio.run(together())]
    assert batched == alone


def test_images_are_refused(engine):
    """A text engine cannot see images: a request carrying some is the client's 400."""
    tokens = prompt(engine)
    image = PromptImage(0, 1, "0" * 64, None)
    req = GenerationRequest(MultimodalPrompt(tokens, (image,)), max_tokens=4)
    with pytest.raises(VisionNotSupportedError):
        asyncio.run(run(engine, req))
    assert engine.in_flight == 0


def test_seeded_sampling_is_reproducible(engine):
    s = replace(GREEDY, temperature=1.0, seed=1234)
    req = GenerationRequest(TokenPrompt(prompt(engine)), max_tokens=8, sampling=s)
    a = asyncio.run(run(engine, req))[0]
    b = asyncio.run(run(engine, req))[0]
    assert a == b


def test_stop_string_cuts_before_it(engine):
    full, unstopped = asyncio.run(run(engine, GenerationRequest(TokenPrompt(prompt(engine)), max_tokens=12)))
    assert unstopped.stop_sequence is None
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    if not stop.strip():
        pytest.skip("random model produced whitespace")
    never = "\u2063never\u2063"
    text, last = asyncio.run(run(engine, GenerationRequest(TokenPrompt(prompt(engine)), max_tokens=12,
                                                            stop=(never, stop))))
    assert last.finish_reason == "stop"
    assert text == full[: full.find(stop)]
    # The final delta names the stop string that matched (Anthropic's stop_sequence).
    assert last.stop_sequence == stop


def test_prefix_cache_reuse_gives_same_tokens(tiny_model_dir):
    eng = make_engine(tiny_model_dir, prompt_cache="prefix")
    try:
        system = prompt(eng, "You are a terse assistant. " * 6)
        tail = prompt(eng, " What is two plus two?")
        req = GenerationRequest(TokenPrompt(system + tail), max_tokens=6, cache_prefix_len=len(system))
        cold, c1 = asyncio.run(run(eng, req))
        warm, c2 = asyncio.run(run(eng, req))
        assert c1.cached_tokens == 0
        assert c2.cached_tokens >= len(system)
        assert warm == cold
        # A different system prompt shares no KV with the first.
        other = prompt(eng, "Answer like a pirate, always. " * 6) + tail
        _, c3 = asyncio.run(run(eng, GenerationRequest(TokenPrompt(other), max_tokens=4)))
        common = next(i for i, (a, b) in enumerate(zip(other, req.prompt_tokens)) if a != b)
        assert c3.cached_tokens <= common
    finally:
        eng.worker.stop()


def test_request_over_budget_is_refused(tiny_model_dir):
    eng = make_engine(tiny_model_dir, mem=16)
    try:
        too_big = eng.admission.budget_tokens + 1
        with pytest.raises(ContextLengthError):
            asyncio.run(run(eng, GenerationRequest(TokenPrompt(prompt(eng)), max_tokens=too_big)))
    finally:
        eng.worker.stop()


def test_admission_queues_and_full_queue_429(tiny_model_dir):
    eng = make_engine(tiny_model_dir, max_num_seqs=1, max_queue=1)
    try:
        async def scenario():
            r = GenerationRequest(TokenPrompt(prompt(eng)), max_tokens=600)
            first = asyncio.create_task(run(eng, r))
            second = asyncio.create_task(run(eng, r))
            await asyncio.sleep(0.05)
            with pytest.raises(RateLimitError) as info:
                await run(eng, r)
            assert info.value.headers["Retry-After"]
            results = await asyncio.gather(first, second)
            assert all(last.finish_reason == "length" for _, last in results)
            # Recovered: the queue drained and a new request runs.
            return await run(eng, GenerationRequest(TokenPrompt(prompt(eng)), max_tokens=2))

        _, last = asyncio.run(scenario())
        assert last.completion_tokens == 2
    finally:
        eng.worker.stop()


def test_cancel_frees_the_sequence(engine):
    async def scenario():
        agen = engine.stream(GenerationRequest(TokenPrompt(prompt(engine)), max_tokens=200))
        await agen.__anext__()
        await agen.aclose()
        for _ in range(100):
            if engine.admission.running == 0:
                break
            await asyncio.sleep(0.02)

    asyncio.run(scenario())
    assert engine.admission.running == 0 and engine.admission.reserved == 0
    assert not engine._running


def test_failing_sampler_fails_one_request_only(engine, monkeypatch):
    """A bad per-request piece fails that request; the thread and others go on."""
    import app.engine.batch.engine as mod

    real = mod.build_sampler

    def sampler_for(p):
        if p.seed == 666:
            raise ValueError("boom")
        return real(p)

    monkeypatch.setattr(mod, "build_sampler", sampler_for)
    bad = GenerationRequest(TokenPrompt(prompt(engine)), max_tokens=4,
                            sampling=replace(GREEDY, seed=666, temperature=1.0))
    with pytest.raises(EngineError, match="boom"):
        asyncio.run(run(engine, bad))
    _, last = asyncio.run(run(engine, GenerationRequest(TokenPrompt(prompt(engine)), max_tokens=3)))
    assert last.completion_tokens == 3 and engine.worker.alive


def test_short_request_is_not_starved_by_a_long_prefill(tiny_model_dir):
    """A short request arriving during a long chunked prefill finishes first."""
    eng = make_engine(tiny_model_dir, prefill_chunk_size=16, prompt_cache="off")
    try:
        long_prompt = prompt(eng, "tell me everything about the history of the world " * 60)
        assert len(long_prompt) > 400

        async def scenario():
            order = []

            async def go(name, req):
                await run(eng, req)
                order.append(name)

            long = asyncio.create_task(go("long", GenerationRequest(TokenPrompt(long_prompt), max_tokens=4)))
            await asyncio.sleep(0.01)
            short = asyncio.create_task(go("short", GenerationRequest(TokenPrompt(prompt(eng, "Hi")), max_tokens=4)))
            await asyncio.gather(long, short)
            return order

        assert asyncio.run(scenario()) == ["short", "long"]
    finally:
        eng.worker.stop()


def test_system_prefix_is_cached_for_a_different_question(tiny_model_dir):
    eng = make_engine(tiny_model_dir, prompt_cache="system")
    try:
        system = prompt(eng, "You are a helpful assistant that answers in one word. " * 4)
        a = GenerationRequest(TokenPrompt(system + prompt(eng, " First question?")), max_tokens=2,
                              cache_prefix_len=len(system))
        b = GenerationRequest(TokenPrompt(system + prompt(eng, " Another one entirely?")), max_tokens=2,
                              cache_prefix_len=len(system))
        _, first = asyncio.run(run(eng, a))
        _, second = asyncio.run(run(eng, b))
        assert first.cached_tokens == 0
        assert second.cached_tokens == len(system)
        # "system" mode keeps only the prefix, not whole conversations.
        _, third = asyncio.run(run(eng, a))
        assert third.cached_tokens == len(system)
    finally:
        eng.worker.stop()


def test_prefix_cache_namespaces_never_share(engine):
    """A cached conversation helps the next request of its own namespace only."""
    text = "A long shared system prompt that is well worth caching for later turns. " * 3
    req = GenerationRequest(TokenPrompt(prompt(engine, text)), max_tokens=4, cache_namespace="alice")
    asyncio.run(run(engine, req))
    from dataclasses import replace

    _, mallory = asyncio.run(run(engine, replace(req, cache_namespace="mallory")))
    _, alice = asyncio.run(run(engine, req))
    assert mallory.cached_tokens == 0
    assert alice.cached_tokens > len(req.prompt_tokens) // 2


def test_a_cancelled_prefill_keeps_its_kv_for_the_retry(tiny_model_dir):
    """Claude Code gives up on a request after 300 s without an answer and sends it again:
    the KV its first try prefilled goes to the prefix cache (its own namespace only), so
    the retry resumes there, and generates what a fresh run does."""
    import threading

    eng = make_engine(tiny_model_dir, prefill_chunk_size=16, prompt_cache="prefix")
    try:
        tokens = prompt(eng, "tell me everything about the history of the world " * 20)
        assert len(tokens) > 150  # ten chunks and more
        req = GenerationRequest(TokenPrompt(tokens), max_tokens=6, cache_namespace="retry")
        holding, gate = threading.Event(), threading.Event()

        def hold_after(steps: int):
            # A step job runs once per loop turn, before the batch step: after `steps` turns
            # it holds the MLX thread, as one long prefill step of a big model would.
            for _ in range(steps):
                yield
            holding.set()
            gate.wait(30)

        async def give_up() -> None:
            first = asyncio.ensure_future(eng.stream(req).__anext__())
            await asyncio.sleep(0)  # submitted
            held = eng.worker.submit_steps(lambda: hold_after(3))
            assert await asyncio.to_thread(holding.wait, 30)
            first.cancel()  # the client is gone while the MLX thread is inside its prefill
            await asyncio.gather(first, return_exceptions=True)
            gate.set()
            await asyncio.wrap_future(held)

        asyncio.run(give_up())
        retry_text, retry = asyncio.run(run(eng, req))
        fresh_text, fresh = asyncio.run(run(eng, replace(req, cache_namespace="fresh")))
        assert fresh.cached_tokens == 0  # nothing leaks to another namespace
        assert 0 < retry.cached_tokens < len(tokens), retry.cached_tokens  # cut short mid-prefill, resumed there
        assert retry_text == fresh_text
    finally:
        eng.worker.stop()
