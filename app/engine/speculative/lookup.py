"""Lookup drafters: proposals found in text the row already has, no model of their own.

    prompt_lookup   the row's own tokens (prompt and output so far): the longest suffix of
                    them that occurred before, and what followed it there. An agent that
                    rewrites a file from its prompt, or a model that quotes its context,
                    repeats long runs.
    prediction      OpenAI's Predicted Outputs: the client's predicted tokens. The output's
                    suffix is looked up in them; when it is found nowhere, the prediction
                    is proposed from where the output last followed it (a cursor), so an
                    answer that starts as predicted is proposed from its first token, and
                    one that replaced a token or two (a renamed identifier) picks the
                    prediction up again right after.

Both use one ``NgramIndex``: n-gram -> the position after its latest occurrence, for every
n up to ``max_n``, built once for a fixed source and extended token by token for a
growing one. A step's lookup is ``max_n`` dictionary reads, whatever the prompt's length.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from app.engine.speculative import Proposal

# The longest n-gram matched, and the shortest worth proposing from (a single token
# matches almost anywhere in a long text; two rarely do by chance; the prediction's
# cursor covers the single-token case there).
MAX_N = 4
MIN_N_PROMPT = 2
MIN_N_PREDICTION = 2


class NgramIndex:
    """n-gram -> the positions just after its occurrences in ``tokens``, in order."""

    def __init__(self, max_n: int = MAX_N) -> None:
        self.max_n = max_n
        self.tokens: list[int] = []
        self._after: list[dict[tuple[int, ...], list[int]]] = [{} for _ in range(max_n + 1)]

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to the source and index the n-grams ending in them."""
        src = self.tokens
        for t in tokens:
            src.append(int(t))
            end = len(src)
            for n in range(1, min(self.max_n, end) + 1):
                self._after[n].setdefault(tuple(src[end - n:end]), []).append(end)

    def find(self, suffix: Sequence[int], min_n: int = 1, near: int | None = None) -> tuple[int, int] | None:
        """(position after the match, n) for the longest n-gram ending ``suffix`` (n from
        ``max_n`` down to ``min_n``) found in the source: its latest occurrence, or with
        ``near`` its first at or after ``near`` (else its latest); None when none is."""
        for n in range(min(self.max_n, len(suffix)), min_n - 1, -1):
            at = self._after[n].get(tuple(suffix[len(suffix) - n:]))
            if at:
                if near is not None:
                    i = bisect_left(at, near)
                    if i < len(at):
                        return at[i], n
                return at[-1], n
        return None


class PromptLookup:
    """Drafter: n-gram continuations from the row's own prompt and output."""

    name = "prompt_lookup"

    def __init__(self, min_n: int = MIN_N_PROMPT, max_n: int = MAX_N) -> None:
        self._index = NgramIndex(max_n)
        self._min_n = min_n

    def propose(self, tokens: Sequence[int], k: int) -> Proposal | None:
        index = self._index
        if len(tokens) < len(index.tokens):  # the row is not what it was: start over
            self._index = index = NgramIndex(index.max_n)
        # Index all but the last token: the suffix ending there is what is looked up, and
        # it must match an earlier occurrence, not itself.
        index.extend(tokens[len(index.tokens):len(tokens) - 1])
        found = index.find(tokens, self._min_n)
        if found is None:
            return None
        at, _ = found
        # A match close to the end runs into the tokens being proposed: a repeating
        # pattern goes on repeating (period: the distance to the match).
        period = len(tokens) - at
        run = [int(tokens[at + j]) if j < period else 0 for j in range(k)]
        for j in range(period, k):
            run[j] = run[j - period]
        return Proposal(self.name, tuple(run))

    def verified(self, proposal: Proposal, accepted: int) -> None:
        pass

    def close(self) -> None:
        self._index = NgramIndex(self._index.max_n)


class PredictionLookup:
    """Drafter: the client's predicted tokens (OpenAI's Predicted Outputs).

    It keeps the output aligned with the prediction (``_offset``: prediction index minus
    output index, 0 at the start), so its cursor is where in the prediction the row's next
    token (the last of ``tokens``, drawn but not yet verified) is expected, however many
    steps went by without a proposal. When that token is the predicted one, the prediction
    goes on after it. When it is not, it is first taken as a substitute for the predicted
    one (a renamed identifier) and the prediction goes on after it; if that guess missed
    too, the output's suffix is looked up in the prediction (its occurrence nearest after
    the cursor first), which aligns the two anew, and without a match nothing is proposed."""

    name = "prediction"

    def __init__(self, prediction: Sequence[int], prompt_len: int, min_n: int = MIN_N_PREDICTION,
                 max_n: int = MAX_N) -> None:
        self._index = NgramIndex(max_n)
        self._index.extend(prediction)
        self._prompt_len = prompt_len
        self._min_n = min_n
        self._offset = 0
        # Guesses in a row (proposals made taking the row's next token for a substitute) of
        # which nothing was kept.
        self._misses = 0
        # The last proposal, the alignment it was made with, and whether it was a guess.
        self._last: tuple[Proposal, int, bool] | None = None

    @property
    def size(self) -> int:
        return len(self._index.tokens)

    def propose(self, tokens: Sequence[int], k: int) -> Proposal | None:
        prediction = self._index.tokens
        output = tokens[self._prompt_len:]
        if not output:
            return None
        cursor = len(output) - 1 + self._offset
        guess = False
        if 0 <= cursor < len(prediction) and (prediction[cursor] == output[-1] or not self._misses):
            at, guess = cursor + 1, prediction[cursor] != output[-1]
        else:
            found = self._index.find(output, self._min_n, near=max(0, cursor + 1))
            if found is None:
                return None
            at = found[0]
        run = prediction[at:at + k]
        if not run:
            return None
        proposal = Proposal(self.name, tuple(run))
        # The first proposed token stands at output index len(output).
        self._last = (proposal, at - len(output), guess)
        return proposal

    def verified(self, proposal: Proposal, accepted: int) -> None:
        if self._last is not None and self._last[0] is proposal:
            # The model's own next token stands where the first refused (or next) one was: the
            # alignment the proposal was made with holds (a substitution), until a miss finds another.
            _, self._offset, guess = self._last
            # A proposal that followed the output and lost its first token leaves the model's
            # own token as a substitute, a fair guess next; a guess that lost its first too
            # means the output went elsewhere.
            self._misses = self._misses + 1 if guess and not accepted else 0
        self._last = None

    def close(self) -> None:
        self._last = None
