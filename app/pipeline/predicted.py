"""Predicted Outputs usage, as OpenAI defines it: of the prediction's tokens, those that
appear in the completion (``accepted_prediction_tokens``) and those that do not
(``rejected_prediction_tokens``).

What the drafter did does not enter into it. The prediction speeds decoding up only
where the model's output matches it, and the adaptive rule may propose few of its
tokens on a slow machine (2 of 60 on the 2-core development CPU, with the exact answer
as the prediction): those verify-step counts stay in /metrics
(``tandem_speculative_*{drafter="prediction"}``). What a client is told is how much of
its prediction the answer kept, counted once the answer is known:

    prediction ids    the client's text as the model's tokens (``speculation_for``)
    completion ids    the answer's text (its leading whitespace aside, as the chat message
                      has it), tokenized the same way
    accepted          prediction tokens in the longest matching blocks of the two, in
                      order (``difflib``: an edited line keeps the tokens around it)
    rejected          the rest of the prediction

Re-tokenizing the answer, rather than reading the ids the model sampled, is what makes
the counts the client's: an answer equal to the prediction accepts every token even
where the model wrote it in other pieces.
"""

from __future__ import annotations

import bisect
import difflib
from collections.abc import Sequence
from typing import Any

# Below this product of the two lengths, difflib runs without its junk heuristic: exact blocks.
EXACT_WORK = 1 << 20
# Tokens in a run that anchors the alignment of two long sequences (a chance repeat is unlikely).
ANCHOR = 8


def matched_tokens(prediction: Sequence[int], completion: Sequence[int]) -> int:
    """How many tokens of ``prediction`` appear, in order, in ``completion``.

    Equal edges are matched first (an exact answer costs a scan). Small middles go to
    ``difflib`` whole; long ones are cut at shared runs of ``ANCHOR`` tokens, in order, and
    the gaps between them matched the same way, so an edited 20,000-token file is counted
    exactly in milliseconds. A long stretch with no shared run at all (an answer unlike the
    prediction) falls back to difflib's junk heuristic, which may miss a few tokens there.
    """
    head = 0
    limit = min(len(prediction), len(completion))
    while head < limit and prediction[head] == completion[head]:
        head += 1
    tail = 0
    while tail < limit - head and prediction[-1 - tail] == completion[-1 - tail]:
        tail += 1
    a = prediction[head:len(prediction) - tail]
    b = completion[head:len(completion) - tail]
    if not a or not b:
        return head + tail
    if len(a) * len(b) <= EXACT_WORK:
        return head + tail + _blocks(a, b, autojunk=False)
    anchors = _anchors(a, b)
    if not anchors:
        return head + tail + _blocks(a, b, autojunk=True)
    total, i, j = 0, 0, 0
    for ai, bj, size in anchors:
        total += matched_tokens(a[i:ai], b[j:bj]) + size
        i, j = ai + size, bj + size
    return head + tail + total + matched_tokens(a[i:], b[j:])


def _blocks(a: Sequence[int], b: Sequence[int], *, autojunk: bool) -> int:
    return sum(block.size for block in difflib.SequenceMatcher(None, a, b, autojunk=autojunk).get_matching_blocks())


def _anchors(a: Sequence[int], b: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs of at least ``ANCHOR`` tokens shared by ``a`` and ``b``, in order in both, each
    as ``(start in a, start in b, length)``: each run of ``a`` taken at its first place in
    ``b`` past the previous run."""
    where: dict[tuple[int, ...], list[int]] = {}
    for j in range(len(b) - ANCHOR + 1):
        where.setdefault(tuple(b[j:j + ANCHOR]), []).append(j)
    out: list[tuple[int, int, int]] = []
    i, floor = 0, 0
    while i <= len(a) - ANCHOR:
        places = where.get(tuple(a[i:i + ANCHOR]), ())
        k = bisect.bisect_left(places, floor)
        if k == len(places):
            i += 1
            continue
        j, size = places[k], ANCHOR
        while i + size < len(a) and j + size < len(b) and a[i + size] == b[j + size]:
            size += 1
        out.append((i, j, size))
        i, floor = i + size, j + size
    return out


def prediction_usage(tokenizer: Any, prediction: Sequence[int], completion_text: str) -> tuple[int, int]:
    """``(accepted, rejected)`` prediction tokens for an answer whose raw text is
    ``completion_text``. CPU work (a tokenizer call and a diff): run it off the event loop."""
    if not prediction:
        return 0, 0
    completion = list(tokenizer.encode(completion_text.lstrip(), add_special_tokens=False))
    accepted = matched_tokens(list(prediction), completion)
    return accepted, len(prediction) - accepted
