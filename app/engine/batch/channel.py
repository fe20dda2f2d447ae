"""A bounded, coalescing hand-off from the engine thread to one async handler.

The engine thread must never block on a slow client (it would stall every
other stream), so when a consumer falls behind, text deltas are merged into
the last pending one instead of growing a queue: memory per request stays
bounded by its own output, and the reader gets everything in order. A reader
takes what is pending as one delta (``get``): one that fell behind the engine
catches up in one pass through the pipeline and one write to its client, not
one per token, so under load the per-token cost of the event loop shrinks.

Waking a reader from another thread costs a write to the event loop's self-pipe
(``call_soon_threadsafe``), and the loop a wake-up to read it: once per token and
stream, a system call on the engine thread between two steps. So the channels of one
loop share a ``_Waker``, which sets many readers' events in one callback: the engine
puts a step's tokens inside ``deferred_wakes()``, and the loop is woken once when
it ends, whatever the streams; outside it, a put wakes its reader at once (joining
a callback already scheduled, if any).
"""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import fields

from app.engine.types import TokenDelta

# Per thread: inside ``deferred_wakes``, the readers to wake when it ends, by waker.
_deferred = threading.local()


class _Waker:
    """Sets asyncio events of one loop from another thread, many per ``call_soon_threadsafe``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        # Weakly: ``_WAKERS`` keys on the loop, which its value must not keep alive.
        self._loop = weakref.ref(loop)
        self._lock = threading.Lock()
        self._pending: list[asyncio.Event] = []

    def wake(self, event: asyncio.Event) -> None:
        """Set ``event`` on its loop soon (when ``deferred_wakes`` ends, inside one); never blocks."""
        held: dict[_Waker, list[asyncio.Event]] | None = getattr(_deferred, "held", None)
        if held is not None:
            held.setdefault(self, []).append(event)
            return
        self.wake_all([event])

    def wake_all(self, events: list[asyncio.Event]) -> None:
        """Set ``events`` on the loop soon, in one callback; never blocks."""
        with self._lock:
            scheduled = bool(self._pending)  # a callback that has not run yet takes these too
            self._pending.extend(events)
            if scheduled:
                return
        try:
            loop = self._loop()
            if loop is None:
                raise RuntimeError("the event loop is gone")
            loop.call_soon_threadsafe(self._run)
        except RuntimeError:  # the loop is gone: nobody is listening any more
            with self._lock:
                self._pending.clear()

    def _run(self) -> None:
        with self._lock:
            events, self._pending = self._pending, []
        for event in events:
            event.set()


_WAKERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Waker] = weakref.WeakKeyDictionary()
_WAKERS_LOCK = threading.Lock()


@contextmanager
def deferred_wakes() -> Iterator[None]:
    """The readers that puts on this thread wake inside the block are woken when it ends,
    one callback per event loop (a batch step's tokens: one wake for every stream)."""
    if getattr(_deferred, "held", None) is not None:  # nested: the outer block wakes them
        yield
        return
    held: dict[_Waker, list[asyncio.Event]] = {}
    _deferred.held = held
    try:
        yield
    finally:
        _deferred.held = None
        for waker, events in held.items():
            waker.wake_all(events)


def _waker(loop: asyncio.AbstractEventLoop) -> _Waker:
    with _WAKERS_LOCK:
        waker = _WAKERS.get(loop)
        if waker is None:
            waker = _WAKERS[loop] = _Waker(loop)
        return waker


class TokenChannel:
    """Engine thread ``put``s, the event loop ``get``s lists of deltas."""

    def __init__(self, loop: asyncio.AbstractEventLoop, maxsize: int = 32) -> None:
        self._loop = loop
        self._maxsize = maxsize
        self._items: deque[TokenDelta] = deque()
        self._lock = threading.Lock()
        self._ready = asyncio.Event()
        self._waker = _waker(loop)
        self.closed = False

    def put(self, delta: TokenDelta) -> None:
        """Called from the engine thread; never blocks."""
        with self._lock:
            if self.closed:
                return
            if len(self._items) >= self._maxsize and _mergeable(self._items[-1], delta):
                _merge(self._items[-1], delta)
                return
            wake = not self._items
            self._items.append(delta)
            if delta.finish_reason is not None or delta.error is not None:
                self.closed = True
        if wake:
            self._waker.wake(self._ready)

    async def get(self) -> list[TokenDelta]:
        """Everything pending, waiting until there is something: its text as one delta (with
        the end, if it came), and an error after it in a delta of its own."""
        while True:
            with self._lock:
                if self._items:
                    items: list[TokenDelta] = []
                    for delta in self._items:
                        if items and _mergeable(items[-1], delta):
                            _merge(items[-1], delta)
                        else:
                            items.append(delta)
                    self._items.clear()
                    self._ready.clear()
                    return items
                self._ready.clear()
            await self._ready.wait()


def _mergeable(last: TokenDelta, delta: TokenDelta) -> bool:
    """Whether ``delta`` can join ``last``: neither is an error, and ``last`` is not the end."""
    return last.finish_reason is None and last.error is None and delta.error is None


def _merge(last: TokenDelta, delta: TokenDelta) -> None:
    """``delta`` appended to ``last``: its text, tokens and logprobs, and, when it is the end,
    everything else the end carries (usage, the stop string, scores)."""
    last.text += delta.text
    last.tokens += delta.tokens
    last.logprobs += delta.logprobs
    if delta.finish_reason is not None:
        for f in _END_FIELDS:
            setattr(last, f, getattr(delta, f))


# What only a final delta carries: every field but the streamed ones.
_END_FIELDS = tuple(f.name for f in fields(TokenDelta) if f.name not in ("text", "tokens", "logprobs"))


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
