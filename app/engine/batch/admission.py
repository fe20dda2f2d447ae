"""Memory-bounded admission: a request runs only when the KV that MLX will allocate fits.

What MLX allocates is not prompt + max_tokens per sequence. mlx-lm's batch caches
are rectangles: every row (sequence) is as wide as the widest one, its KV
right-aligned after left padding, and the buffer grows in steps of 256 tokens
(``KV_STEP``), so up to 255 columns are allocated but not yet used. While prompts
are prefilled together, a row that processes fewer tokens than its neighbours in
a step is padded to theirs (up to one prefill chunk per prompt segment). So a
sequence's *width* is ``sequence_width``: prompt + max_tokens, or its prompt plus
that prefill padding when larger; and the running set's footprint is

    rows x (widest width + KV_STEP - 1) tokens       (``Admission.footprint``)

rows counting running and paused sequences. The prefix cache's entries (their
own exact-size copies) live in the same budget (``mem``): when a waiting request
does not fit, cached prefixes are evicted first. Requests that do not fit wait in
a bounded FIFO; a small request may pass a large one at the head (backfill)
unless the head has waited longer than ``starvation_s``. Interactive requests are
admitted before background ones (``rank`` 0 before 1), and background ones not at
all while the engine says so. A paused sequence (``suspend``) keeps its
reservation but frees its batch slot. Pure Python: the engine thread calls it,
tests drive it directly.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from app.errors import ContextLengthError, EngineBusyError, RateLimitError

T = TypeVar("T")

# mlx-lm's KV caches (and kv_quant's) grow their buffers by this many tokens at a time.
KV_STEP = 256


def sequence_width(prompt_len: int, max_tokens: int, *, segments: int, chunk: int) -> int:
    """Columns of a batch cache one sequence may need: prompt + max_tokens, or, when larger,
    its prompt padded during prefill. A prompt is prefilled in ``segments`` pieces (two when
    its cached prefix ends mid-prompt) of up to ``chunk`` tokens a step, and whatever a row
    already holds (a cached prefix) plus each step's widest chunk is what it spans, so it
    spans at most its prompt plus ``chunk - 1`` per segment (the last token is decoded, not
    prefilled)."""
    return max(prompt_len + max_tokens, prompt_len - 1 + segments * (chunk - 1))



@dataclass
class Waiting(Generic[T]):
    item: T
    # The sequence's width (``sequence_width``), in tokens.
    tokens: int
    since: float = field(default_factory=time.monotonic)
    # 0: interactive, 1: background (admitted after every interactive request).
    rank: int = 0


class Admission(Generic[T]):
    """Tracks the reserved rows (by width) and the queue of requests waiting for room."""

    def __init__(
        self,
        budget_tokens: int,
        max_seqs: int,
        max_queue: int,
        queue_timeout_s: float,
        starvation_s: float = 5.0,
        step: int = KV_STEP,
    ) -> None:
        self.budget_tokens = budget_tokens
        self.max_seqs = max_seqs
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.starvation_s = starvation_s
        self.step = step
        # Reserved rows, running and paused, by width.
        self._widths: Counter[int] = Counter()
        self.running = 0
        self.waiting: deque[Waiting[T]] = deque()

    def footprint(self, *extra: int) -> int:
        """Tokens of KV the reserved rows (and ``extra`` widths, as if admitted) can make
        MLX hold: every row as wide as the widest, plus an allocation step not yet used."""
        rows = self._widths.total() + len(extra)
        if rows == 0:
            return 0
        return rows * (max([*self._widths, *extra]) + self.step - 1)

    @property
    def reserved(self) -> int:
        """The footprint of what runs now, in tokens."""
        return self.footprint()

    @property
    def max_sequence_tokens(self) -> int:
        """The longest prompt + max_tokens one sequence alone can have."""
        return max(0, self.budget_tokens - (self.step - 1))

    def check(self, tokens: int, arriving: int = 0) -> None:
        """Refuse at once what could never run (``tokens`` is the sequence's width), or what
        finds the queue full.

        ``arriving`` counts requests submitted but not yet seen by the engine thread:
        they wait too, except those that free batch slots will take at once.
        """
        if tokens + self.step - 1 > self.budget_tokens:
            raise ContextLengthError(
                f"this request needs {tokens + self.step - 1} tokens of KV cache (prompt + max_tokens, "
                f"prefill padding and the cache's {self.step}-token allocation step), more than this model's "
                f"KV budget of {self.budget_tokens} tokens (raise `mem` in models.yaml or lower max_tokens)",
                param="max_tokens",
            )
        waiting = len(self.waiting) + arriving - max(0, self.max_seqs - self.running)
        if waiting >= self.max_queue:
            raise RateLimitError(
                f"server is at capacity ({self.running} running, {max(0, waiting)} waiting); retry shortly",
                retry_after=2,
            )

    def release(self, tokens: int, *, running: bool = True) -> None:
        """Free a sequence's reservation (and its batch slot, unless it was suspended)."""
        self._widths[tokens] -= 1
        if self._widths[tokens] <= 0:
            del self._widths[tokens]
        if running:
            self.running -= 1

    def suspend(self) -> None:
        """A running sequence was paused: its slot is free, its reservation is kept."""
        self.running -= 1

    def resume(self) -> bool:
        """Take a slot back for a paused sequence, if one is free."""
        if self.running >= self.max_seqs:
            return False
        self.running += 1
        return True

    def interactive_fits(self) -> bool:
        """Whether an interactive request waits that the KV budget could take now."""
        return any(w.rank == 0 and self.footprint(w.tokens) <= self.budget_tokens for w in self.waiting)

    def expire(self, now: float | None = None) -> list[T]:
        """Waiting requests past the queue timeout, removed from the queue."""
        now = time.monotonic() if now is None else now
        expired = [w for w in self.waiting if now - w.since > self.queue_timeout_s]
        for w in expired:
            self.waiting.remove(w)
        return [w.item for w in expired]

    def admit(self, cache_tokens: int, evict: Callable[[int], int], *, background: bool = True,
              limit: int | None = None) -> list[T]:
        """Pop every waiting request that fits now (at most ``limit``), evicting cache when that helps.

        ``cache_tokens`` is what the prefix cache holds; ``evict(n)`` frees at
        least ``n`` tokens of it if it can and returns the new cache size.
        Interactive requests go first; ``background=False`` holds background ones back.
        """
        admitted: list[T] = []
        queue = sorted(self.waiting, key=lambda w: w.rank)  # stable: FIFO within a rank
        head_starving = bool(queue) and (time.monotonic() - queue[0].since > self.starvation_s)
        for w in queue:
            if self.running >= self.max_seqs or len(admitted) == limit:
                break
            if w.rank and not background:
                break
            need = self.footprint(w.tokens)
            if need + cache_tokens > self.budget_tokens and cache_tokens > 0:
                cache_tokens = evict(need + cache_tokens - self.budget_tokens)
            if need + cache_tokens <= self.budget_tokens:
                self.waiting.remove(w)
                self._widths[w.tokens] += 1
                self.running += 1
                admitted.append(w.item)
            elif head_starving:
                break  # the oldest waits first: no more backfill past it
        return admitted

    def fail_all(self) -> list[T]:
        items = [w.item for w in self.waiting]
        self.waiting.clear()
        return items


def busy_error(waited_s: float, for_slot: bool, slot_setting: str = "max_num_seqs") -> EngineBusyError:
    """The 503 of a request that waited too long, naming what it waited for (and the setting
    that bounds it: ``max_num_seqs`` for chat rows, ``max_jobs`` for encoder jobs)."""
    what = f"a free batch slot ({slot_setting})" if for_slot else "KV memory (mem)"
    return EngineBusyError(f"request waited {waited_s:.0f}s for {what} and timed out; retry shortly", retry_after=5)
