#!/usr/bin/env python
"""Decisions benchmark: many questions about one input cost about one read of the input.

    .venv/bin/python scripts/bench.py --only decisions        # a server on the demo model

Against a running Tandem (``scripts/bench.py`` starts one): a ~1,000-token input (seeded
pseudo-sentences, counted with the model's tokenizer), asked one predicate question, then
20 predicate questions about it, each request in its own cache scope (``cache_salt``) so
neither finds the input cached by the other. The ratio of the two wall times is the cost
of 19 more questions: the input's KV is computed once per request and every question's
prompt reads it from the prefix cache, so 20 questions cost about one read of the input
plus 20 short ones, where 20 separate requests would each read it whole (about 20x).
Then, for five obvious statements about short inputs and their negations, the model's
probability that each holds (a small model ranks some wrongly).
"""

from __future__ import annotations

import random
import time
import uuid
from typing import Any

import httpx

WORDS = """the a customer order invoice refund parcel shipped late early damaged box courier address
    city account password email reset support ticket agent replied waited days weeks price charged
    twice subscription plan monthly yearly cancelled renewed discount code applied expired""".split()
STATEMENTS = [
    "The text mentions a refund.", "The text mentions a password.", "The customer was charged twice.",
    "The parcel arrived damaged.", "The text is about a subscription.", "The customer is angry.",
    "The text mentions a discount code.", "The order was shipped late.", "The text mentions an email.",
    "The customer cancelled a plan.", "The text is written in French.", "The text mentions a courier.",
    "The support agent replied.", "The text mentions a price.", "The text is a poem.",
    "The customer waited for weeks.", "The text mentions an address.", "The account was reset.",
    "The text is about the weather.", "The text mentions a city.",
]


# Five obvious statements about short inputs, and their negations: what the model makes of them.
OBVIOUS = [
    ("The sky is blue on a clear day.", "The sky is blue on a clear day.", "The sky is not blue on a clear day."),
    ("Paris is the capital of France.", "Paris is the capital of France.", "Paris is not the capital of France."),
    ("I love this product, it works perfectly!", "The review is positive.", "The review is negative."),
    ("The meeting is on Monday at 10am.", "The meeting is on Monday.", "The meeting is not on Monday."),
    ("Water boils at 100 degrees Celsius at sea level.", "Water boils at 100 degrees Celsius.",
     "Water does not boil at 100 degrees Celsius."),
]


def obvious(base: str, model: str) -> list[str]:
    """P(true) of each statement and its negation (one request per input), and how many of
    the five pairs the model ranks the right way round."""
    lines, right = [], 0
    for text, yes, no in OBVIOUS:
        body = {"model": model, "input": text, "questions": [{"type": "predicate", "instructions": s}
                                                             for s in (yes, no)]}
        r = httpx.post(base + "/v1/decisions", json=body, timeout=3600)
        r.raise_for_status()
        p_yes, p_no = (a.get("probability") for a in r.json()["answers"])
        right += p_yes is not None and p_no is not None and p_yes > p_no
        show = lambda p: "refused" if p is None else f"{p:.3f}"  # noqa: E731
        lines.append(f"  {text!r}: {yes!r} {show(p_yes)}, {no!r} {show(p_no)}")
        print(lines[-1], flush=True)
    return [f"obvious statements, P(true) of each and of its negation ({right} of 5 pairs ranked right):", *lines]


def input_text(tokens: int, count: Any, seed: int = 0) -> str:
    """Seeded pseudo-sentences of about ``tokens`` tokens by ``count`` (the model's tokenizer)."""
    rng = random.Random(seed)
    sentences: list[str] = []
    while count(" ".join(sentences)) < tokens:
        sentences.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 16))).capitalize() + ".")
    return " ".join(sentences)


def decide(base: str, model: str, text: str, statements: list[str]) -> tuple[float, dict[str, Any]]:
    """One decision request's wall time and usage, in a cache scope of its own."""
    body = {"model": model, "input": text, "cache_salt": uuid.uuid4().hex,
            "questions": [{"type": "predicate", "instructions": s} for s in statements]}
    start = time.perf_counter()
    r = httpx.post(base + "/v1/decisions", json=body, timeout=3600)
    r.raise_for_status()
    return time.perf_counter() - start, r.json()["usage"]


def bench_decisions(base: str, model: str, model_path: str, input_tokens: int = 1000,
                    questions: int = 20) -> list[str]:
    """The ratio lines for scripts/bench.py."""
    from pathlib import Path

    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(Path(model_path))
    text = input_text(input_tokens, lambda s: len(tokenizer.encode(s, add_special_tokens=False)))
    decide(base, model, "Warm up.", STATEMENTS[:2])
    one, one_usage = decide(base, model, text, STATEMENTS[:1])
    many, many_usage = decide(base, model, text, STATEMENTS[:questions])
    print(f"decisions about a {input_tokens}-token input: 1 question {one:.1f}s ({one_usage}), "
          f"{questions} questions {many:.1f}s ({many_usage})")
    computed = many_usage["input_tokens"] - many_usage["input_tokens_details"]["cached_tokens"]
    return [f"{questions} predicate questions / 1 about one {input_tokens}-token input: {many:.1f}s / {one:.1f}s = "
            f"{many / one:.2f}   (target <= 3; {computed} of {many_usage['input_tokens']} prompt tokens computed)",
            *obvious(base, model)]
