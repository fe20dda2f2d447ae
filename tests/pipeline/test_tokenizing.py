"""A prompt's tokens at a cost bounded by the context (app/pipeline/tokenizing.py), on the demo tokenizer."""

from __future__ import annotations

import random
from typing import Any

import pytest

from app.errors import ContextLengthError
from app.pipeline.tokenizing import SLICE_CHARS, encode_within, slices

RNG = random.Random(5)
CJK = "".join(chr(RNG.randrange(0x4E00, 0x9FFF)) for _ in range(30_000))
ENGLISH = " ".join(RNG.choice("the quick brown fox jumps over a lazy dog, then  runs\naway.".split(" "))
                   for _ in range(12_000))
MIXED = "".join(RNG.choice(["\u4e2d\u6587", "abc ", "\n\n", "  ", "\u00e9", "\U0001f642", ", ", "123", "\t"])
                for _ in range(12_000))
TEXTS = {"cjk": CJK, "english": ENGLISH, "mixed": MIXED}


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    from mlx_lm.utils import load_tokenizer

    return load_tokenizer(demo_model_dir)


class Counting:
    """The real tokenizer, counting the characters it is given (the cost under test)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.chars = tokenizer, 0

    def encode(self, text: str, **kw: Any) -> list[int]:
        self.chars += len(text)
        return self.tokenizer.encode(text, **kw)


@pytest.mark.parametrize("name", TEXTS)
def test_a_prompt_that_fits_tokenizes_exactly_as_whole(tokenizer, name):
    text = TEXTS[name]
    whole = list(tokenizer.encode(text, add_special_tokens=False))
    assert len(text) > 2048  # the sliced count runs first
    assert encode_within(tokenizer, text, len(whole)) == whole  # at the very limit
    assert encode_within(tokenizer, text, len(whole), special_tokens=True) == list(tokenizer.encode(text))


@pytest.mark.parametrize("name", TEXTS)
def test_slices_cover_the_text(name):
    text = TEXTS[name]
    parts = list(slices(text, 1000))
    assert "".join(parts) == text and all(0 < len(p) <= 1000 for p in parts)


def test_a_dense_script_past_the_context_is_refused_after_a_slice_or_two(tokenizer):
    """1.3 M CJK characters pass the character cut of an 8,192-token model (1,327,104) and were
    3.5 M tokens; now counting stops once past the context."""
    text = CJK * 44  # 1.32 M characters
    counting = Counting(tokenizer)
    with pytest.raises(ContextLengthError, match="maximum context length is 8192 tokens") as refused:
        encode_within(counting, text, 8192, "messages")
    assert refused.value.param == "messages"
    assert counting.chars <= 2 * SLICE_CHARS, counting.chars


def test_a_long_prompt_that_fits_is_counted_once_and_tokenized_once(tokenizer):
    counting = Counting(tokenizer)
    tokens = encode_within(counting, ENGLISH, 30_000)  # fewer tokens, more characters
    assert counting.chars == 2 * len(ENGLISH) and tokens == list(tokenizer.encode(ENGLISH, add_special_tokens=False))
    short = Counting(tokenizer)
    encode_within(short, ENGLISH[:1000], 2048)  # no more characters than the context: one call
    assert short.chars == 1000
