"""How a generation meets HTTP, for every wire format.

- ``EventStream``: Server-Sent Events framed with ``\\n`` (``data: ...\\n\\n``), as
  AG-UI's own encoder and OpenAI write them; clients that split on ``\\n\\n``
  (``@ag-ui/client``) read nothing from ``\\r\\n`` frames.
- ``started``: a stream's response begins only once its first item is in: the
  pipeline's first step, empty, as soon as the engine has queued the request. A
  refusal at submission (429 queue full, a dead engine) is then an HTTP status, and
  the headers and the format's opening event (``message_start`` and ``ping``,
  ``response.created``, the role chunk, ``RUN_STARTED``) go out at once, not after a
  prefill that takes minutes for a long prompt on a small machine: Claude Code gives
  up on a stream with no first event after 300 s. What comes later (503 queue
  timeout) is the format's error event.
- ``kept_alive``: while nothing else is sent (queued, prefilling), the format's
  keep-alive every ``server.sse_keepalive_s``: Anthropic's ``ping`` event, an SSE
  comment line for OpenAI's formats; proxies and clients drop silent streams. The
  events that came while the last ones were written go out together, in one write.
- ``unless_disconnected``: awaits work, cancelling it when the client hangs up;
  ``ClientGone`` then becomes nginx's 499 ("client closed request") at the edge.
- ``answer``: every generating route's skeleton after its format has validated and
  converted the body: prepare, submit, then render through the format's ``Rendering``
  (a stream, or the whole answer), holding the model's lease until the generation ends.
  The prepared request's warnings (images the model could not see) go out in the
  ``x-tandem-warning`` header, on every format, streaming or not.
- ``ending_in_error``: a stream's tail once it has started: a failure becomes the
  format's own error event(s), then the stream closes.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from litestar import Request, Response
from litestar.response import Stream

if TYPE_CHECKING:  # annotations only: `tandem pull` and friends import the HTTP side without MLX
    from app.pipeline.pipeline import Pipeline, Prepared
    from app.pipeline.results import Step

T = TypeVar("T")

# The header that carries a request's warnings, whatever its format's body can hold.
WARNING_HEADER = "x-tandem-warning"
# A header line stays well under the limits of proxies and clients (8 KB and less).
_WARNING_MAX_CHARS = 1024


@dataclass(frozen=True)
class Event:
    """One SSE event: its data, and a name for formats that use ``event:`` lines."""

    data: str
    name: str | None = None

    def frame(self) -> bytes:
        head = f"event: {self.name}\n" if self.name else ""
        return f"{head}data: {self.data}\n\n".encode()


@dataclass(frozen=True)
class Comment:
    """An SSE comment line, which every SSE reader skips: OpenAI's formats' keep-alive."""

    text: str

    def frame(self) -> bytes:
        return f": {self.text}\n\n".encode()


Frame = Event | Comment | str  # a bare string is an unnamed event's data


def to_json(data: Any) -> str:
    """Compact JSON, as every event and chunk goes out."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


class EventStream(Stream):
    """A ``text/event-stream`` response of ``Event``s and ``Comment``s (or bare data strings),
    one at a time or in lists that go out in one write."""

    def __init__(self, events: AsyncIterator[Frame | list[Frame]], headers: dict[str, str] | None = None) -> None:
        super().__init__(
            _frames(events),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        # Litestar would let the handler's media type (JSON, for the non-streaming answer) win.
        return super().to_asgi_response(*args, **{**kwargs, "media_type": None})


async def _frames(events: AsyncIterator[Frame | list[Frame]]) -> AsyncIterator[bytes]:
    async for ev in events:
        if isinstance(ev, list):  # what came together goes out in one write
            yield b"".join(_frame(e) for e in ev)
        else:
            yield _frame(ev)


def _frame(ev: Frame) -> bytes:
    return (Event(ev) if isinstance(ev, str) else ev).frame()


# Items a stream's pump may hold for its writer before it waits (``kept_alive``): a client
# that reads slowly then holds the engine's channel, which merges what waits there.
RELAY_ROOM = 64


class _Relay:
    """Items from a pump task to one reader, who takes all that came at once."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.items: deque[Any] = deque()
        self.ended = False
        self.failure: Exception | None = None
        # When the last item (or keep-alive) went out, on the loop's clock.
        self.last = loop.time()
        self.keepalive_due = False
        self._loop = loop
        self._reader: asyncio.Future[None] | None = None
        self._writer: asyncio.Future[None] | None = None

    async def put(self, item: Any) -> None:
        while len(self.items) >= RELAY_ROOM:
            self._writer = self._loop.create_future()
            await self._writer
        self.items.append(item)
        self.last = self._loop.time()
        self.wake()

    def end(self, failure: Exception | None = None) -> None:
        self.ended, self.failure = True, failure
        self.wake()

    def wake(self) -> None:
        if self._reader is not None and not self._reader.done():
            self._reader.set_result(None)

    async def take(self) -> list[Any]:
        """What came since the last take; empty when woken for a keep-alive."""
        if not self.items and not self.ended and not self.keepalive_due:
            self._reader = self._loop.create_future()
            await self._reader
        items = list(self.items)
        self.items.clear()
        if self._writer is not None and not self._writer.done():
            self._writer.set_result(None)
        return items


async def kept_alive(events: AsyncIterator[T], every: float, keepalive: T | None) -> AsyncIterator[list[T]]:
    """``events`` in batches (what came while the last batch was written: one item when
    the client keeps up), and ``[keepalive]`` each time ``every`` seconds pass without one
    of them (None, or ``every`` 0: none, and one item a batch). ``events`` run in a task of
    their own, so waiting for the next one can end in a keep-alive without cancelling it;
    closing the result cancels them. No timer or task per item: one timer per stream
    checks, every ``every`` seconds, whether anything went out since."""
    if keepalive is None or every <= 0:
        async with aclosing(events) as inner:  # type: ignore[type-var]  # an async generator underneath
            async for ev in inner:
                yield [ev]
        return
    loop = asyncio.get_running_loop()
    relay = _Relay(loop)

    async def pump() -> None:
        try:
            async with aclosing(events) as inner:  # type: ignore[type-var]
                async for ev in inner:
                    await relay.put(ev)
        except Exception as exc:  # noqa: BLE001 - raised again by the reader
            relay.end(exc)
        else:
            relay.end()

    def tick() -> None:
        idle = loop.time() - relay.last
        if idle < every:  # something went out since: check again ``every`` after it
            timers[0] = loop.call_later(every - idle, tick)
            return
        relay.keepalive_due, relay.last = True, loop.time()
        relay.wake()
        timers[0] = loop.call_later(every, tick)

    task = asyncio.ensure_future(pump())  # the context (request id) goes with it
    timers = [loop.call_later(every, tick)]
    try:
        while True:
            items = await relay.take()
            if items:
                relay.keepalive_due = False
                yield items
            elif relay.keepalive_due:
                relay.keepalive_due = False
                yield [keepalive]
            if relay.ended and not relay.items:
                if relay.failure is not None:
                    raise relay.failure
                return
    finally:
        timers[0].cancel()
        task.cancel()  # runs the generation's own cleanup (the engine's cancel) in that task


async def started(items: AsyncIterator[T]) -> AsyncIterator[T]:
    """``items`` once its first item is in; closing the result closes ``items``."""
    first = await items.__anext__()

    async def chained() -> AsyncIterator[T]:
        try:
            yield first
            async for item in items:
                yield item
        finally:
            await items.aclose()  # type: ignore[attr-defined]  # a vanished client cancels the generation

    return chained()


class ClientGone(Exception):
    """The client hung up before its answer (or its stream's start) was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first: a non-streaming
    request whose client gave up (an Open WebUI task, a timed-out SDK call) stops
    generating and frees its KV instead of running to max_tokens."""
    result: list[T] = []
    failed: list[Exception] = []
    # Not the request: the cancelled watcher's frames stay in a reference cycle (anyio's
    # task_done keeps the CancelledError it caught), and the request holds its body.
    receive = request.receive

    async def watch() -> None:
        # The body is already read: the next ASGI message is the disconnect, if any.
        while (await receive())["type"] != "http.disconnect":
            pass
        tg.cancel_scope.cancel()

    async def run() -> None:
        try:
            result.append(await work)
        except Exception as exc:  # noqa: BLE001 - re-raised below, not as an ExceptionGroup
            failed.append(exc)
        tg.cancel_scope.cancel()

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        tg.start_soon(run)
    if failed:
        raise failed.pop()  # not left in the list: run's closure holds it, its traceback holds run
    if not result:
        raise ClientGone
    return result[0]


async def ending_in_error(events: AsyncIterator[T], on_error: Callable[[Exception], Iterable[T]]) -> AsyncIterator[T]:
    """``events``; if they fail after the stream has started, ``on_error``'s events (the
    format's one error event, in its own shape), then the end: the status line has gone."""
    async with aclosing(events) as inner:  # type: ignore[type-var]  # an async generator underneath
        try:
            async for ev in inner:
                yield ev
        except Exception as exc:  # noqa: BLE001 - once streaming, errors travel as events
            for ev in on_error(exc):
                yield ev


@dataclass(frozen=True)
class Rendering:
    """How one wire format writes one answer: as a stream of events (ended by ``error``'s
    events on a failure after the start, kept alive by ``keepalive`` while silent), or whole
    from every step (``None``: stream only)."""

    events: Callable[[AsyncIterator[Step]], AsyncIterator[Frame]]
    error: Callable[[Exception], Iterable[Frame]]
    whole: Callable[[list[Step]], Any] | None = None
    keepalive: Frame | None = Comment("keep-alive")


async def _collect(steps: AsyncIterator[Step]) -> list[Step]:
    async with aclosing(steps) as s:  # type: ignore[type-var]  # an async generator underneath
        return [step async for step in s]


def warning_headers(warnings: list[str]) -> dict[str, str]:
    """``warnings`` as one ``x-tandem-warning`` header (none without warnings): on one line, in
    ASCII, "; "-joined, cut to a length every proxy passes."""
    if not warnings:
        return {}
    text = "; ".join(" ".join(w.split()) for w in warnings).encode("ascii", "replace").decode()
    return {WARNING_HEADER: text if len(text) <= _WARNING_MAX_CHARS else text[: _WARNING_MAX_CHARS - 3] + "..."}


async def answer(request: Request, pipeline: Pipeline, prepare: Awaitable[Prepared], stream: bool,
                 render: Callable[[Prepared], Rendering]) -> Any:
    """Prepare the request, submit it, and render it as ``render``'s format does.

    A stream's response starts with its first step, as soon as the engine has queued the
    request (``started``), and is kept alive while silent (``kept_alive``); a client that
    hangs up first cancels the work (``unless_disconnected``). The prepared request holds its
    model's lease, which the generation lets go when it ends; one that never started (the
    client gone first, a failure while rendering begins) lets it go here.
    """
    prepared = await prepare
    headers = warning_headers(prepared.warnings)
    try:
        rendering = render(prepared)
        if stream or rendering.whole is None:
            steps = await unless_disconnected(request, started(pipeline.steps(prepared)))
            events = ending_in_error(rendering.events(steps), rendering.error)
            return EventStream(kept_alive(events, pipeline.server.sse_keepalive_s, rendering.keepalive), headers)
        done = await unless_disconnected(request, _collect(pipeline.steps(prepared)))
    except BaseException:
        if prepared.lease is not None:
            prepared.lease.release()
        raise
    whole = rendering.whole(done)
    return Response(whole, headers=headers) if headers else whole
