"""Memory-bounded admission: a request runs only when its KV cache fits.

Each running sequence reserves prompt + max_tokens tokens of the model's KV
budget (``mem``) up front, so the batch can never outgrow memory mid-decode.
The prefix cache lives in the same budget: when a waiting request does not
fit, cached prefixes are evicted first. Requests that do not fit wait in a
bounded FIFO; a small request may pass a large one at the head (backfill)
unless the head has waited longer than ``starvation_s``. Interactive requests
are admitted before background ones (``rank`` 0 before 1), and background
ones not at all while the engine says so. A paused sequence (``suspend``)
keeps its KV reservation but frees its batch slot. Pure Python: the engine
thread calls it, tests drive it directly.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from app.errors import ContextLengthError, EngineBusyError, RateLimitError

T = TypeVar("T")


@dataclass
class Waiting(Generic[T]):
    item: T
    tokens: int
    since: float = field(default_factory=time.monotonic)
    # 0: interactive, 1: background (admitted after every interactive request).
    rank: int = 0


class Admission(Generic[T]):
    """Tracks reserved KV tokens and the queue of requests waiting for them."""

    def __init__(
        self,
        budget_tokens: int,
        max_seqs: int,
        max_queue: int,
        queue_timeout_s: float,
        starvation_s: float = 5.0,
    ) -> None:
        self.budget_tokens = budget_tokens
        self.max_seqs = max_seqs
        self.max_queue = max_queue
        self.queue_timeout_s = queue_timeout_s
        self.starvation_s = starvation_s
        self.reserved = 0
        self.running = 0
        self.waiting: deque[Waiting[T]] = deque()

    def check(self, tokens: int, arriving: int = 0) -> None:
        """Refuse at once what could never run, or what finds the queue full.

        ``arriving`` counts requests submitted but not yet seen by the engine thread:
        they wait too, except those that free batch slots will take at once.
        """
        if tokens > self.budget_tokens:
            raise ContextLengthError(
                f"prompt + max_tokens = {tokens} tokens exceeds this model's KV budget of "
                f"{self.budget_tokens} tokens (raise `mem` in models.yaml or lower max_tokens)",
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
        self.reserved -= tokens
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
        free = self.budget_tokens - self.reserved
        return any(w.rank == 0 and w.tokens <= free for w in self.waiting)

    def expire(self, now: float | None = None) -> list[T]:
        """Waiting requests past the queue timeout, removed from the queue."""
        now = time.monotonic() if now is None else now
        expired = [w for w in self.waiting if now - w.since > self.queue_timeout_s]
        for w in expired:
            self.waiting.remove(w)
        return [w.item for w in expired]

    def admit(self, cache_tokens: int, evict: Callable[[int], int], *, background: bool = True) -> list[T]:
        """Pop every waiting request that fits now, evicting cache when that helps.

        ``cache_tokens`` is what the prefix cache holds; ``evict(n)`` frees at
        least ``n`` tokens of it if it can and returns the new cache size.
        Interactive requests go first; ``background=False`` holds background ones back.
        """
        admitted: list[T] = []
        queue = sorted(self.waiting, key=lambda w: w.rank)  # stable: FIFO within a rank
        head_starving = bool(queue) and (time.monotonic() - queue[0].since > self.starvation_s)
        for w in queue:
            if self.running >= self.max_seqs:
                break
            if w.rank and not background:
                break
            free = self.budget_tokens - self.reserved - cache_tokens
            if w.tokens > free and cache_tokens > 0:
                cache_tokens = evict(w.tokens - free)
                free = self.budget_tokens - self.reserved - cache_tokens
            if w.tokens <= free:
                self.waiting.remove(w)
                self.reserved += w.tokens
                self.running += 1
                admitted.append(w.item)
            elif head_starving:
                break  # the oldest waits first: no more backfill past it
        return admitted

    def fail_all(self) -> list[T]:
        items = [w.item for w in self.waiting]
        self.waiting.clear()
        return items


def busy_error(waited_s: float, for_slot: bool) -> EngineBusyError:
    """The 503 of a request that waited too long, naming what it waited for."""
    what = "a free batch slot (max_num_seqs)" if for_slot else "KV memory (mem)"
    return EngineBusyError(f"request waited {waited_s:.0f}s for {what} and timed out; retry shortly", retry_after=5)
