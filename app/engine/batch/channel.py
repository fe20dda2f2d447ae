"""A bounded, coalescing hand-off from the engine thread to one async handler.

The engine thread must never block on a slow client (it would stall every
other stream), so when a consumer falls behind, text deltas are merged into
the last pending one instead of growing a queue: memory per request stays
bounded by its own output, and the reader gets everything in order.
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque

from app.engine.types import TokenDelta


class TokenChannel:
    """Engine thread ``put``s, the event loop ``get``s lists of deltas."""

    def __init__(self, loop: asyncio.AbstractEventLoop, maxsize: int = 32) -> None:
        self._loop = loop
        self._maxsize = maxsize
        self._items: deque[TokenDelta] = deque()
        self._lock = threading.Lock()
        self._ready = asyncio.Event()
        self.closed = False

    def put(self, delta: TokenDelta) -> None:
        """Called from the engine thread; never blocks."""
        with self._lock:
            if self.closed:
                return
            last = self._items[-1] if self._items else None
            if (
                len(self._items) >= self._maxsize
                and last is not None
                and last.finish_reason is None
                and last.error is None
            ):
                last.text += delta.text
                last.tokens += delta.tokens
                last.logprobs += delta.logprobs
                last.finish_reason = delta.finish_reason
                last.error = delta.error
                last.prompt_tokens = delta.prompt_tokens or last.prompt_tokens
                last.cached_tokens = delta.cached_tokens or last.cached_tokens
                last.completion_tokens = delta.completion_tokens or last.completion_tokens
                last.stop_sequence = delta.stop_sequence
                return
            wake = not self._items
            self._items.append(delta)
            if delta.finish_reason is not None or delta.error is not None:
                self.closed = True
        if wake:
            try:
                self._loop.call_soon_threadsafe(self._ready.set)
            except RuntimeError:  # the loop is gone: nobody is listening any more
                pass

    async def get(self) -> list[TokenDelta]:
        """Everything pending, waiting until there is something."""
        while True:
            with self._lock:
                if self._items:
                    items = list(self._items)
                    self._items.clear()
                    self._ready.clear()
                    return items
                self._ready.clear()
            await self._ready.wait()


class OpenStreams:
    """One engine's open channels, so they can all be ended at once from the event loop
    when the MLX thread cannot do it (a shutdown waiting behind a long prefill step)."""

    def __init__(self, maxsize: int) -> None:
        self._maxsize = maxsize
        self._channels: weakref.WeakSet[TokenChannel] = weakref.WeakSet()

    def open(self) -> TokenChannel:
        """A channel for a new stream, on the running event loop."""
        channel = TokenChannel(asyncio.get_running_loop(), self._maxsize)
        self._channels.add(channel)
        return channel

    def end_all(self, exc: BaseException) -> None:
        """Every open stream ends with ``exc`` now; what the engine thread puts later is dropped."""
        for channel in list(self._channels):
            channel.put(TokenDelta(error=exc))
