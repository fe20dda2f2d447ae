"""The lookup drafters: n-gram matching against the row's tokens and against a prediction."""

from __future__ import annotations

from app.engine.speculative.lookup import NgramIndex, PredictionLookup, PromptLookup


def test_index_finds_the_longest_suffix_latest_or_nearest():
    index = NgramIndex(max_n=3)
    index.extend([1, 2, 3, 9, 1, 2, 4, 1, 2, 3, 7])
    assert index.find([5, 1, 2, 3]) == (10, 3)  # the 3-gram, its latest occurrence
    assert index.find([5, 1, 2, 3], near=0) == (3, 3)  # nearest at or after 0
    assert index.find([8, 2, 4]) == (7, 2)
    assert index.find([8, 6, 4]) == (7, 1)
    assert index.find([8, 6, 4], min_n=2) is None
    assert index.find([42]) is None


def test_index_grows_token_by_token_like_built_at_once():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3, 2, 7, 9, 5]
    whole, grown = NgramIndex(), NgramIndex()
    whole.extend(tokens)
    for t in tokens:
        grown.extend([t])
    for i in range(1, len(tokens)):
        for near in (None, 0, i):
            assert whole.find(tokens[:i], near=near) == grown.find(tokens[:i], near=near)


def test_prompt_lookup_proposes_what_followed_the_suffix_before():
    d = PromptLookup()
    prompt = [10, 11, 12, 13, 14, 15, 16, 20, 21]
    assert d.propose([*prompt, 11, 12], 4).tokens == (13, 14, 15, 16)
    assert d.propose([*prompt, 11, 12, 13, 14, 15], 3).tokens == (16, 20, 21)
    assert d.propose([*prompt, 11, 12, 13, 14, 15, 99], 3) is None  # 15 99 never occurred
    # A match reaching the end goes on repeating its pattern.
    assert PromptLookup().propose([7, 8, 7, 8, 7, 8], 5).tokens == (7, 8, 7, 8, 7)


def test_prompt_lookup_needs_two_tokens_of_context():
    d = PromptLookup()
    assert d.propose([1, 2, 3, 4, 9, 3], 2) is None  # "3" alone: a single token is no evidence
    assert d.propose([1, 2, 3, 4, 9, 2, 3], 2).tokens == (4, 9)


def test_prediction_is_proposed_from_its_start_and_follows_a_substitution():
    prompt = [100] * 5
    predicted = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    d = PredictionLookup(predicted, len(prompt))
    first = d.propose([*prompt, 1], 4)  # the first token was the predicted one
    assert first.tokens == (2, 3, 4, 5)
    d.verified(first, 2)  # 2, 3 kept; the model wrote 44 where 4 was predicted
    nxt = d.propose([*prompt, 1, 2, 3, 44], 3)
    assert nxt.tokens == (5, 6, 7)  # a renamed token: the prediction goes on after it
    d.verified(nxt, 3)
    assert d.propose([*prompt, 1, 2, 3, 44, 5, 6, 7, 8], 4).tokens == (9, 10)


def test_prediction_resyncs_after_an_insertion():
    prompt = [100]
    predicted = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    d = PredictionLookup(predicted, len(prompt))
    p = d.propose([*prompt, 1], 3)
    d.verified(p, 3)  # 2 3 4 kept; the model inserted 50 where 5 was
    p = d.propose([*prompt, 1, 2, 3, 4, 50], 3)
    assert p.tokens == (6, 7, 8)  # guessed a substitution
    d.verified(p, 0)  # wrong: the model wrote 51
    assert d.propose([*prompt, 1, 2, 3, 4, 50, 51], 3) is None  # no match for the new text: nothing
    # It writes the predicted 5 6 after its insertion: found again, nearest the cursor.
    assert d.propose([*prompt, 1, 2, 3, 4, 50, 51, 5, 6], 3).tokens == (7, 8, 9)


def test_prediction_output_that_starts_elsewhere_is_matched_by_ngram():
    d = PredictionLookup([1, 2, 3, 4, 5, 6], prompt_len=2)
    p = d.propose([9, 9, 7], 3)  # the output's first token is not the prediction's
    assert p.tokens == (2, 3, 4)  # a blind guess: a substitution of the first token
    d.verified(p, 0)
    assert d.propose([9, 9, 7, 8], 3) is None
    assert d.propose([9, 9, 7, 8, 3, 4], 2).tokens == (5, 6)


def test_prediction_stays_aligned_across_steps_without_proposals():
    """The engine asks nothing in some steps (a row's first token, a busy batch): the
    prediction is still proposed from where the output has got to."""
    d = PredictionLookup([1, 2, 3, 4, 5, 6, 7, 8], prompt_len=1)
    assert d.propose([0, 1, 2, 3], 3).tokens == (4, 5, 6)  # first asked with three tokens written


def test_prediction_refused_at_its_first_token_goes_on_after_the_models_substitute():
    d = PredictionLookup([1, 2, 3, 4, 5, 6, 7, 8], prompt_len=1)
    p = d.propose([0, 1], 2)
    assert p.tokens == (2, 3)
    d.verified(p, 0)  # the model wrote 20 where 2 was predicted: a renamed identifier
    assert d.propose([0, 1, 20], 3).tokens == (3, 4, 5)
