"""Memory-bounded admission: a request runs only when its KV cache fits.

Each running sequence reserves prompt + max_tokens tokens of the model's KV
budget (``mem``) up front, so the batch can never outgrow memory mid-decode.
The prefix cache lives in the same budget: when a waiting request does not
fit, cached prefixes are evicted first. Requests that do not fit wait in a
bounded FIFO; a small request may pass a large one at the head (backfill)
unless the head has waited longer than ``starvation_s``. Pure Python: the
engine thread calls it, tests drive it directly.
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

    def release(self, tokens: int) -> None:
        self.reserved -= tokens
        self.running -= 1

    def expire(self, now: float | None = None) -> list[T]:
        """Waiting requests past the queue timeout, removed from the queue."""
        now = time.monotonic() if now is None else now
        expired = [w for w in self.waiting if now - w.since > self.queue_timeout_s]
        for w in expired:
            self.waiting.remove(w)
        return [w.item for w in expired]

    def admit(self, cache_tokens: int, evict: Callable[[int], int]) -> list[T]:
        """Pop every waiting request that fits now, evicting cache when that helps.

        ``cache_tokens`` is what the prefix cache holds; ``evict(n)`` frees at
        least ``n`` tokens of it if it can and returns the new cache size.
        """
        admitted: list[T] = []
        head_starving = bool(self.waiting) and (
            time.monotonic() - self.waiting[0].since > self.starvation_s
        )
        for w in list(self.waiting):
            if self.running >= self.max_seqs:
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


def busy_error(waited_s: float) -> EngineBusyError:
    return EngineBusyError(
        f"request waited {waited_s:.0f}s for KV memory and timed out; retry shortly", retry_after=5
    )
