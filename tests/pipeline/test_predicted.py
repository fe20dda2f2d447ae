"""Predicted Outputs usage counted as OpenAI defines it (app/pipeline/predicted.py): the
prediction's tokens that appear in the completion, and those that do not."""

from __future__ import annotations

import random

import pytest

from app.pipeline.predicted import matched_tokens, prediction_usage


@pytest.mark.parametrize("prediction, completion, matched", [
    ([1, 2, 3, 4], [1, 2, 3, 4], 4),  # the answer was the prediction
    ([1, 2, 3, 4], [5, 6, 7], 0),  # nothing of it
    ([1, 2, 3, 4, 5, 6], [1, 2, 9, 9, 5, 6], 4),  # one edit in the middle keeps both sides
    ([1, 2, 3, 4, 5, 6], [1, 2, 3], 3),  # the answer stopped early
    ([1, 2, 3], [0, 1, 2, 3, 4], 3),  # the answer wrote more around it
    ([1, 2, 3, 4], [4, 3, 2, 1], 1),  # in order: reversed keeps one
    ([7, 7, 7], [7], 1),  # a token counts once per appearance
    ([], [1, 2], 0),
    ([1, 2], [], 0),
])
def test_matched_tokens(prediction, completion, matched):
    assert matched_tokens(prediction, completion) == matched


def test_a_long_edited_file_is_counted_quickly_and_exactly():
    """A 20,000-token prediction with three edited lines: the diff keeps everything else."""
    rng = random.Random(3)
    prediction = [rng.randrange(50) for _ in range(20_000)]
    completion = list(prediction)
    for at in (1_000, 9_000, 15_000):
        completion[at:at + 5] = [99, 98, 97]
    assert matched_tokens(prediction, completion) == 20_000 - 15


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(demo_model_dir))


def test_usage_counts_the_prediction_in_its_own_tokens(tokenizer):
    text = "def area(r):\n    return 3.14159 * r * r\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert prediction_usage(tokenizer, ids, text) == (len(ids), 0)
    # The answer as the model wrote it, with the whitespace a chat answer starts with.
    assert prediction_usage(tokenizer, ids, "\n " + text) == (len(ids), 0)
    edited = text.replace("3.14159", "math.pi")
    accepted, rejected = prediction_usage(tokenizer, ids, edited)
    assert accepted + rejected == len(ids) and 0 < rejected < len(ids) // 2
    assert prediction_usage(tokenizer, (), text) == (0, 0)


def test_an_unrelated_long_answer_is_counted_without_a_quadratic_diff():
    rng = random.Random(5)
    prediction = [rng.randrange(30_000) for _ in range(20_000)]
    completion = [rng.randrange(30_000) for _ in range(20_000)]
    matched = matched_tokens(prediction, completion)
    assert 0 <= matched < 2_000
