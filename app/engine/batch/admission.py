"""Memory-bounded admission: a request runs only when the KV that MLX will allocate fits.

What MLX allocates is not prompt + max_tokens per sequence. mlx-lm's batch caches
are rectangles: every row (sequence) is as wide as the widest one, its KV
right-aligned after left padding, and the buffer grows in steps of 256 tokens
(``KV_STEP``), so up to 255 columns are allocated but not yet used. While prompts
are prefilled together, a row that processes fewer tokens than its neighbours in
a step is padded to theirs (up to one prefill chunk per prompt segment). So a
sequence's whole *width* is ``sequence_width``: prompt + max_tokens, or its prompt
plus that prefill padding when larger.

A row does not reserve its whole width up front: a client that asks for 32,000
tokens and stops after 300 would hold the budget for nothing, and every row is as
wide as the widest. It reserves what it holds now plus its next allocation step
(``reservation``; while it prefills, its prompt with the prefill padding), within
its width, and the engine grows that before every step (``resize``). The running
set's footprint is

    rows x cost(widest reservation + KV_STEP - 1)         (``Admission.footprint``)

rows counting running and paused sequences, in bytes: ``cost`` is what one row that
wide holds, layer by layer (``app.engine.kv.geometry``: full-attention layers by tokens,
sliding windows capped at their window, recurrent states a constant per row). The prefix cache's entries (their
own exact-size copies) live in the same budget (``mem``): when a waiting request
does not fit, cached prefixes are evicted first. When the rows' growth does not
fit either, the engine pauses the lowest-priority row (``victim``): its KV goes to
the prefix cache, its reservation is given back, and it waits at the head of the
queue (``requeue``) to resume from that prefix when room returns; a paused row
never times out in the queue (the rows ahead of it end within their max_tokens).
Requests that do not fit wait in a bounded FIFO; a small request may pass a large
one at the head (backfill) unless the head has waited longer than
``starvation_s``. Interactive requests are admitted before background ones
(``rank`` 0 before 1), and background ones not at all while the engine says so. A
sequence paused for interactive work (``suspend``) keeps its reservation but frees
its batch slot. Pure Python: the engine thread calls it, tests drive it directly.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from app.engine.kv.geometry import widest
from app.errors import ContextLengthError, EngineBusyError, RateLimitError

T = TypeVar("T")

# mlx-lm's KV caches (and kv_quant's) grow their buffers by this many tokens at a time.
KV_STEP = 256


def prefill_span(prompt_len: int, *, segments: int, chunk: int) -> int:
    """Columns a prompt may span while it is prefilled: in ``segments`` pieces (two when its
    cached prefix ends mid-prompt) of up to ``chunk`` tokens a step, whatever a row already
    holds (a cached prefix) plus each step's widest chunk is what it spans, so at most its
    prompt plus ``chunk - 1`` per segment (the last token is decoded, not prefilled)."""
    return prompt_len - 1 + segments * (chunk - 1)


def sequence_width(prompt_len: int, max_tokens: int, *, segments: int, chunk: int) -> int:
    """Columns of a batch cache one sequence may need: prompt + max_tokens, or, when larger,
    its prompt padded during prefill (``prefill_span``)."""
    return max(prompt_len + max_tokens, prefill_span(prompt_len, segments=segments, chunk=chunk))


def reservation(width: int, held: int, *, prefill: int = 0, step: int = KV_STEP) -> int:
    """What a row reserves now: the ``held`` tokens in its KV plus the next allocation step
    (or, while it prefills, ``prefill``: its prompt with the padding prefill may add), never
    more than its whole ``width`` (``sequence_width``)."""
    return min(width, max(prefill, held + step))


@dataclass
class Waiting(Generic[T]):
    item: T
    # The sequence's width (``sequence_width``), in tokens.
    tokens: int
    since: float = field(default_factory=time.monotonic)
    # 0: interactive, 1: background (admitted after every interactive request).
    rank: int = 0
    # A running row paused for memory: it resumes first and never expires in the queue.
    paused: bool = False


class Admission(Generic[T]):
    """Tracks the reserved rows (by width) and the queue of requests waiting for room; the
    budget and every figure of memory are bytes, ``cost(width)`` being one row's (the
    default, one byte a token, lets a test count in tokens)."""

    def __init__(
        self,
        budget_bytes: int,
        max_seqs: int,
        max_queue: int,
        queue_timeout_s: float,
        starvation_s: float = 5.0,
        step: int = KV_STEP,
        cost: Callable[[int], int] = lambda width: width,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.cost = cost
        self.max_seqs = max_seqs
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.starvation_s = starvation_s
        self.step = step
        # Reserved rows, running and paused, and what each reserves now (``reservation``).
        self._rows: dict[T, int] = {}
        self.running = 0
        self.waiting: deque[Waiting[T]] = deque()

    def footprint(self, *extra: int) -> int:
        """Bytes of KV the reserved rows (and ``extra`` widths, as if admitted) can make MLX
        hold: every row as wide as the widest, plus an allocation step not yet used."""
        rows = len(self._rows) + len(extra)
        if rows == 0:
            return 0
        return rows * self.cost(max([*self._rows.values(), *extra]) + self.step - 1)

    @property
    def reserved(self) -> int:
        """The footprint of what runs now, in bytes."""
        return self.footprint()

    @property
    def reserved_tokens(self) -> int:
        """The token columns the reserved rows hold room for (each row its own reservation)."""
        return sum(self._rows.values())

    @property
    def budget_tokens(self) -> int:
        """The widest row the budget holds alone (allocation step included)."""
        return self._widest(self.budget_bytes)

    @property
    def max_sequence_tokens(self) -> int:
        """The longest prompt + max_tokens one sequence alone can have."""
        return max(0, self.budget_tokens - (self.step - 1))

    def _widest(self, nbytes: int) -> int:
        return widest(self.cost, nbytes)

    def check(self, tokens: int, arriving: int = 0) -> None:
        """Refuse at once what could never run (``tokens`` is the sequence's width), or what
        finds the queue full.

        ``arriving`` counts requests submitted but not yet seen by the engine thread:
        they wait too, except those that free batch slots will take at once.
        """
        if self.cost(tokens + self.step - 1) > self.budget_bytes:
            raise ContextLengthError(
                f"this request needs {tokens + self.step - 1} tokens of KV cache (prompt + max_tokens, "
                f"prefill padding and the cache's {self.step}-token allocation step), more than this model's "
                f"KV budget holds for one sequence ({self.max_sequence_tokens + self.step - 1} tokens; raise "
                f"`mem` in models.yaml or lower max_tokens)",
                param="max_tokens",
            )
        waiting = len(self.waiting) + arriving - max(0, self.max_seqs - self.running)
        if waiting >= self.max_queue:
            raise RateLimitError(
                f"server is at capacity ({self.running} running, {max(0, waiting)} waiting); retry shortly",
                retry_after=2,
            )

    def release(self, item: T, *, running: bool = True) -> None:
        """Free a sequence's reservation (and its batch slot, unless it was suspended)."""
        del self._rows[item]
        if running:
            self.running -= 1

    def resize(self, item: T, tokens: int) -> None:
        """What a reserved row reserves now (it grows as the row decodes)."""
        self._rows[item] = tokens

    def over(self, cache_bytes: int) -> int:
        """Bytes the reservations and ``cache_bytes`` of prefix cache exceed the budget by."""
        return self.footprint() + cache_bytes - self.budget_bytes

    def victim(self, keys: dict[T, tuple[int, int, float]]) -> T | None:
        """The row to pause when the reservations do not fit, of those ``keys`` names (item:
        its rank, its whole width, when it was submitted): the lowest priority (background
        first), then the widest (it would hold the most the longest: pausing it lets the
        small ones finish), then the newest. None when one row or fewer is reserved (a row
        alone always fits: ``check``)."""
        if len(self._rows) <= 1 or not keys:
            return None
        return max(keys, key=lambda item: keys[item])

    def requeue(self, item: T, tokens: int, since: float, rank: int, *, running: bool = True) -> None:
        """A reserved row paused for memory: its reservation freed, it waits at the head of its
        rank to be admitted again with ``tokens``."""
        self.release(item, running=running)
        self.waiting.appendleft(Waiting(item, tokens, since, rank, paused=True))

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
        return any(w.rank == 0 and self.footprint(w.tokens) <= self.budget_bytes for w in self.waiting)

    def expire(self, now: float | None = None, held: Callable[[T], bool] = lambda _: False) -> list[T]:
        """Waiting requests past the queue timeout, removed from the queue; not those ``held``
        (waiting, by the engine's choice, for a running row's work they will reuse): their
        wait for memory starts when the hold ends (a decision's questions wait for its input's
        prefill, which may take longer than the timeout, then run)."""
        now = time.monotonic() if now is None else now
        for w in self.waiting:
            if held(w.item):
                w.since = now
        expired = [w for w in self.waiting if not w.paused and now - w.since > self.queue_timeout_s]
        for w in expired:
            self.waiting.remove(w)
        return [w.item for w in expired]

    def admit(self, cache_bytes: int, evict: Callable[[int, T], int], *, background: bool = True,
              limit: int | None = None, held: Callable[[T], bool] = lambda _: False) -> list[T]:
        """Pop every waiting request that fits now (at most ``limit``), evicting cache when that helps.

        ``cache_bytes`` is what the prefix cache holds; ``evict(n, item)`` frees at
        least ``n`` bytes of it if it can, to admit ``item``, and returns the new cache
        size (the engine takes ``item``'s own cached prefix first: making room for a
        request never evicts the prefix it is about to read).
        Interactive requests go first; ``background=False`` holds background ones back, and
        ``held`` any the engine holds back itself (they neither run nor block backfill).
        """
        admitted: list[T] = []
        queue = sorted(self.waiting, key=lambda w: w.rank)  # stable: FIFO within a rank
        # A paused row goes first but never stops backfill: the rows it waits for can be long.
        fresh = [w for w in queue if not w.paused]
        head_starving = bool(fresh) and (time.monotonic() - fresh[0].since > self.starvation_s)
        for w in queue:
            if self.running >= self.max_seqs or len(admitted) == limit:
                break
            if w.rank and not background:
                break
            if held(w.item):
                continue
            need = self.footprint(w.tokens)
            if need + cache_bytes > self.budget_bytes and cache_bytes > 0 and need <= self.budget_bytes:
                cache_bytes = evict(need + cache_bytes - self.budget_bytes, w.item)
            if need + cache_bytes <= self.budget_bytes:
                self.waiting.remove(w)
                self._rows[w.item] = w.tokens
                self.running += 1
                admitted.append(w.item)
            elif head_starving and not w.paused:
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
