"""Prefill chunks sized by time, so no step outlasts its budget.

Each engine step runs one token for every decoding row and one chunk of every prompt
being prefilled. A stream that decodes beside a long prompt waits a whole chunk per
token, and a request that arrives waits for the step in progress before it is even
admitted: on a slow machine a 512-token chunk is tens of seconds. So every step is
sized to a time budget (``prefill_step_ms``), decoding rows or not: the chunk is what
the budget leaves after the decode, at the prefill rate measured on this model, shared
by the prompts in the step. A step then ends within about its budget, and what waits
between steps (admission, cancellations, queue deadlines, shutdown) waits no longer.
Until a rate is measured the chunk is small (``FIRST_CHUNK``), which measures it; a
budget of 0 turns pacing off (every chunk the cap, ``prefill_chunk_size``).

Both rates are measured from recent steps, per model (each engine has its own pacer):
a step with no prefill gives the decode time, a step with prefill gives seconds per
prompt token (its time less the decode's, when rows decoded too). Exponential moving
averages follow the rates as the context grows. Pure Python: the engine reports each
step, tests feed it numbers.
"""

from __future__ import annotations

# The smallest chunk: a prompt keeps moving however slow the step is.
MIN_CHUNK = 1
# The chunk of a model's first prefill steps, before a rate is measured.
FIRST_CHUNK = 64
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
        if self.budget_s <= 0:
            return self.cap
        if not self.prefill_s_per_token:
            return min(self.cap, FIRST_CHUNK)
        left = self.budget_s - ((self.decode_s or 0.0) if decoding else 0.0)
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
