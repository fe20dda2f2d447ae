"""Thinking budgets in the batch (app/engine/step/reasoning.py), on a scripted tiny Ministral
that would think for 500 tokens: each row's reasoning is closed with ``[/THINK]`` at its own
budget, the answer follows, and the tokens spent are reported."""

from __future__ import annotations

import asyncio

import pytest

from app.engine.constrain import constraints as c
from app.engine.constrain.grammar import compiler_for
from app.engine.prompt import TokenPrompt
from app.engine.step.reasoning import BudgetProcessor, Phase, ReasoningTracker
from app.engine.types import GenerationRequest, ReasoningBlock
from tests.engine.engines import make_engine, run
from tests.fixtures.tiny_ministral import distinct_words

ANSWER = "It is sunny"
THOUGHT_TOKENS = 500


@pytest.fixture(scope="module")
def words(demo_model_dir):
    return distinct_words(demo_model_dir, THOUGHT_TOKENS, skip=("sunny",))


@pytest.fixture(scope="module")
def engine(tiny_ministral, words):
    eng = make_engine(tiny_ministral(f"[THINK]{''.join(words)}[/THINK]{ANSWER}"), mem=256)
    yield eng
    eng.worker.stop()


def ministral_block(engine, budget, started=False):
    close = tuple(engine.tokenizer.encode("[/THINK]", add_special_tokens=False))
    return ReasoningBlock("[THINK]", "[/THINK]", close, started=started, budget=budget)


def request(engine, budget, max_tokens, **kw):
    tokens = engine.tokenizer.encode("<s>[INST]Weather in Paris?[/INST]", add_special_tokens=False)
    return GenerationRequest(TokenPrompt(tokens), max_tokens=max_tokens, reasoning=ministral_block(engine, budget),
                             **kw)


def thought(words, n):
    return "".join(words[:n])


def test_rows_with_different_budgets_close_at_their_own(engine, words):
    async def both():
        return await asyncio.gather(run(engine, request(engine, 8, 40)), run(engine, request(engine, 20, 40)),
                                    run(engine, request(engine, None, 30)))

    (short, d1), (longer, d2), (free, d3) = asyncio.run(both())
    assert short == f"[THINK]{thought(words, 8)}[/THINK]{ANSWER}"
    assert (d1.finish_reason, d1.completion_tokens, d1.reasoning_tokens) == ("stop", 1 + 8 + 1 + 3 + 1, 8)
    assert longer == f"[THINK]{thought(words, 20)}[/THINK]{ANSWER}"
    assert d2.reasoning_tokens == 20
    # No budget: it thinks until max_tokens, and every token after [THINK] was reasoning.
    assert free == f"[THINK]{thought(words, 29)}"
    assert (d3.finish_reason, d3.reasoning_tokens) == ("length", 29)
    assert engine.stats().active == 0


def test_budget_zero_closes_the_block_as_it_opens(engine):
    text, last = asyncio.run(run(engine, request(engine, 0, 10)))
    assert text == f"[THINK][/THINK]{ANSWER}" and last.reasoning_tokens == 0


def test_the_grammar_starts_after_the_forced_closer(engine, words):
    grammar = compiler_for(engine.tokenizer).compile(c.JsonObject(), c.Reasoning("[THINK]", "[/THINK]"))
    text, last = asyncio.run(run(engine, request(engine, 6, 6 + 2 + 6, constraint=grammar)))
    head = f"[THINK]{thought(words, 6)}[/THINK]"
    assert text.startswith(head) and text[len(head):].lstrip().startswith("{")
    assert last.reasoning_tokens == 6


def test_a_paused_row_still_closes_at_its_budget(engine, words):
    """Background rows paused mid-thought (an interactive request came) and resumed: each
    budget processor catches up from the row's context and closes the block on time."""
    budgets = (12, 18, 24)

    async def mixed():
        started = [asyncio.Event() for _ in budgets]

        async def go(req, event):
            parts, last = [], None
            async for d in engine.stream(req):
                parts.append(d.text)
                last = d
                event.set()
            return "".join(parts), last

        rows = [asyncio.create_task(go(request(engine, b, 40, priority="background"), e))
                for b, e in zip(budgets, started)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
        pauses = engine.stats().background_pauses
        chat = GenerationRequest(TokenPrompt(engine.tokenizer.encode("An interactive question " * 40)), max_tokens=2)
        await run(engine, chat)
        return engine.stats().background_pauses - pauses, await asyncio.gather(*rows)

    paused, outputs = asyncio.run(mixed())
    assert paused >= 2  # background_share keeps one of the three decoding
    for budget, (text, last) in zip(budgets, outputs):
        assert text == f"[THINK]{thought(words, budget)}[/THINK]{ANSWER}"
        assert last.reasoning_tokens == budget


# ---- the tracker alone: markers in text, however they are tokenized ------------------------------------------------


def tracker(pieces, opener="<think>", closer="</think>", started=False):
    table = dict(enumerate(pieces))
    block = ReasoningBlock(opener, closer, (), started=started)
    t = ReasoningTracker(block, table.__getitem__)
    for token in table:
        t.feed(token)
    return t


@pytest.mark.parametrize("pieces, phase, spent", [
    (["<think>", "a", "b", "</think>", "ok"], Phase.AFTER, 2),
    (["<", "think", ">", "a", "b", "c", "</", "think", ">", "x"], Phase.AFTER, 3),  # markers in several tokens
    (["<think>a", "b", "\n</think>\n\n", "x"], Phase.AFTER, 2),  # merged with the text around them
    (["<think>\n", "a", "b.</think>", "x"], Phase.AFTER, 2),
    (["Sure", "<think>", "a"], Phase.INSIDE, 1),
    (["Hello", " world"], Phase.BEFORE, 0),  # never opened: nothing spent
])
def test_tracker_counts_what_is_inside(pieces, phase, spent):
    t = tracker(pieces)
    assert (t.phase, t.spent) == (phase, spent)


def test_tracker_starts_inside_when_the_prompt_opened_the_block():
    t = tracker(["a", "b", "</think>", "x"], started=True)
    assert (t.phase, t.spent) == (Phase.AFTER, 2)


def test_processor_forces_a_closer_of_several_tokens_one_at_a_time():
    import mlx.core as mx

    pieces = {0: "p", 1: "<think>", 2: "a", 3: "</", 4: "think", 5: ">", 6: "x"}
    block = ReasoningBlock("<think>", "</think>", (3, 4, 5), budget=2)
    proc = BudgetProcessor(block, pieces.__getitem__, prompt_len=1)
    logits = mx.zeros((1, 7))
    context = [0, 1, 2, 2]  # prompt, then <think> and two reasoning tokens
    forced = []
    for _ in range(4):
        out = proc(mx.array(context), logits)
        winner = int(mx.argmax(out, axis=-1).item())
        finite = int(mx.isfinite(out).sum().item())
        forced.append((winner, finite))
        context.append(winner if finite == 1 else 6)
    assert forced[:3] == [(3, 1), (4, 1), (5, 1)] and forced[3][1] == 7  # then the answer is free
