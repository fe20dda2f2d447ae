"""Prefill chunks sized by time, so decoding streams keep moving beside a long prompt.

mlx-lm's BatchGenerator runs, in each step, one token for every decoding row and then
one chunk (``prefill_step_size`` tokens) of every prompt being prefilled. A stream that
decodes beside a long prompt therefore waits a whole chunk per token: on a slow
machine a 512-token chunk is tens of seconds. While rows decode, the chunk is sized so
that the step stays within a time budget (``prefill_step_ms``): what the budget leaves
after the decode, at the prefill rate measured on this model. With nothing decoding,
nobody waits for the step, and the chunk is the configured cap (``prefill_chunk_size``),
the most efficient size. Until a rate is measured the cap is used too.

Both rates are measured from recent steps, per model (each engine has its own pacer):
a step with no prefill gives the decode time, a step with prefill gives seconds per
prompt token (its time less the decode's, when rows decoded too). Exponential moving
averages follow the rates as the context grows. Pure Python: the engine reports each
step, tests feed it numbers.
"""

from __future__ import annotations

# The smallest chunk while rows decode: a prompt keeps moving however slow the decode is.
MIN_CHUNK = 16
# Weight of the newest step in the moving averages.
SMOOTHING = 0.3


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)


class PrefillPacer:
    """Chooses each step's prefill chunk from the measured rates (see the module docstring)."""

    def __init__(self, cap: int, budget_s: float) -> None:
        # The configured chunk (prefill_chunk_size), and the step's budget (0: always the cap).
        self.cap = cap
        self.budget_s = budget_s
        # Seconds a step spends decoding, and seconds per prompt token prefilled.
        self.decode_s: float | None = None
        self.prefill_s_per_token: float | None = None

    def chunk(self, *, decoding: bool, prompts: int = 1) -> int:
        """The chunk for the next step: ``prompts`` are prefilled in it, each by this many
        tokens, beside decoding rows or not."""
        if not decoding or self.budget_s <= 0 or not self.prefill_s_per_token:
            return self.cap
        left = self.budget_s - (self.decode_s or 0.0)
        n = int(left / (self.prefill_s_per_token * max(1, prompts)))
        return max(min(MIN_CHUNK, self.cap), min(self.cap, n))

    def observe(self, *, prefilled: int, decoding: bool, seconds: float) -> None:
        """One step: ``prefilled`` prompt tokens (all rows together), whether rows decoded
        in it, and how long it took."""
        if prefilled <= 0:
            if decoding:
                self.decode_s = _average(self.decode_s, seconds)
            return
        spent = seconds - (self.decode_s or 0.0) if decoding else seconds
        self.prefill_s_per_token = _average(self.prefill_s_per_token, max(spent, 0.0) / prefilled)
