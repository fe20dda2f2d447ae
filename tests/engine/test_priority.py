"""Background work yields to interactive work, on a real tiny model.

While an interactive request waits for its first token, background requests are
not admitted, those in prefill are paused, and those decoding keep at most
``background_share`` of the batch. A paused sequence leaves the batch with its
KV and comes back with it: its greedy output is exactly what it would have been.
"""

from __future__ import annotations

import asyncio

import pytest

from app.engine.prompt import TokenPrompt
from app.engine.types import GenerationRequest
from tests.engine.engines import make_engine, run


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    # background_share 0.25 of 4 slots: one background sequence keeps decoding.
    eng = make_engine(tiny_model_dir, max_num_seqs=4, prompt_cache="off")
    yield eng
    eng.worker.stop()


def request(engine, text: str, max_tokens: int, priority: str = "interactive") -> GenerationRequest:
    return GenerationRequest(TokenPrompt(engine.tokenizer.encode(text)), max_tokens=max_tokens, priority=priority)


async def first_token_then_rest(engine, req: GenerationRequest, started: asyncio.Event) -> str:
    parts = []
    async for delta in engine.stream(req):
        parts.append(delta.text)
        started.set()
    return "".join(parts)


def test_paused_background_resumes_with_the_same_output(engine):
    background = [request(engine, f"Background task number {i} writes a title", 120, "background") for i in range(3)]
    alone = [asyncio.run(run(engine, r))[0] for r in background]
    chat = request(engine, "An interactive question " * 40, 4)  # a long prefill
    chat_alone = asyncio.run(run(engine, chat))[0]

    async def mixed():
        events = [asyncio.Event() for _ in background]
        tasks = [asyncio.create_task(first_token_then_rest(engine, r, e)) for r, e in zip(background, events)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)  # all three decoding
        pauses = engine.stats().background_pauses
        chat_text = (await run(engine, chat))[0]
        return pauses, chat_text, await asyncio.gather(*tasks)

    pauses_before, chat_text, outputs = asyncio.run(mixed())
    assert engine.stats().background_pauses - pauses_before >= 2  # 3 decoding, 1 may stay
    assert chat_text == chat_alone
    assert outputs == alone, "a pause must not change what a sequence generates"
    stats = engine.stats()
    assert stats.paused == 0 and stats.active == 0
    assert engine.admission.reserved == 0 and engine.admission.running == 0


def test_interactive_requests_are_admitted_before_background_ones(tiny_model_dir):
    eng = make_engine(tiny_model_dir, max_num_seqs=1, prompt_cache="off")
    try:
        order: list[str] = []

        async def go(req: GenerationRequest, name: str) -> None:
            async for delta in eng.stream(req):
                if delta.finish_reason:
                    order.append(name)

        async def main() -> None:
            first = asyncio.create_task(go(request(eng, "Occupy the only slot", 30), "first"))
            await asyncio.sleep(0.05)
            later = [asyncio.create_task(go(request(eng, "Title please", 3, "background"), "background")),
                     asyncio.create_task(go(request(eng, "A question", 3), "interactive"))]
            await asyncio.gather(first, *later)

        asyncio.run(main())
        assert order == ["first", "interactive", "background"]
    finally:
        eng.worker.stop()


def test_cancelling_a_paused_sequence_frees_its_reservation(engine):
    async def main() -> None:
        started = asyncio.Event()
        bg = [request(engine, f"Background {i}", 200, "background") for i in range(3)]
        streams = [engine.stream(r) for r in bg]

        async def consume(stream):
            async for _ in stream:
                started.set()

        tasks = [asyncio.create_task(consume(s)) for s in streams]
        await asyncio.wait_for(started.wait(), 60)
        chat = asyncio.create_task(run(engine, request(engine, "Question " * 60, 200)))
        for _ in range(2000):
            if engine.stats().paused:
                break
            await asyncio.sleep(0.005)
        assert engine.stats().paused, "nothing was paused"
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        chat.cancel()
        await asyncio.gather(chat, return_exceptions=True)
        for _ in range(2000):
            if engine.in_flight == 0:
                break
            await asyncio.sleep(0.005)

    asyncio.run(main())
    assert engine.in_flight == 0 and engine.stats().paused == 0
    assert engine.admission.reserved == 0 and engine.admission.running == 0
