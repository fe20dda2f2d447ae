"""How a generation meets HTTP, for every wire format.

- ``EventStream``: Server-Sent Events framed with ``\\n`` (``data: ...\\n\\n``), as
  AG-UI's own encoder and OpenAI write them; clients that split on ``\\n\\n``
  (``@ag-ui/client``) read nothing from ``\\r\\n`` frames.
- ``started``: a stream's response begins only once its first item is in, so a
  refusal before the first token (429 queue full, 503 queue timeout) is an HTTP
  status, not a 200 stream with an error inside.
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

import json
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


def to_json(data: Any) -> str:
    """Compact JSON, as every event and chunk goes out."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


class EventStream(Stream):
    """A ``text/event-stream`` response of ``Event``s (or bare data strings)."""

    def __init__(self, events: AsyncIterator[Event | str], headers: dict[str, str] | None = None) -> None:
        super().__init__(
            _frames(events),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})},
        )

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        # Litestar would let the handler's media type (JSON, for the non-streaming answer) win.
        return super().to_asgi_response(*args, **{**kwargs, "media_type": None})


async def _frames(events: AsyncIterator[Event | str]) -> AsyncIterator[bytes]:
    async for ev in events:
        yield (ev if isinstance(ev, Event) else Event(ev)).frame()


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
    events on a failure after the start), or whole from every step (``None``: stream only)."""

    events: Callable[[AsyncIterator[Step]], AsyncIterator[Event | str]]
    error: Callable[[Exception], Iterable[Event | str]]
    whole: Callable[[list[Step]], Any] | None = None


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

    A stream's response starts only with its first step (``started``); a client that hangs
    up first cancels the work (``unless_disconnected``). The prepared request holds its
    model's lease, which the generation lets go when it ends; one that never started (the
    client gone first, a failure while rendering begins) lets it go here.
    """
    prepared = await prepare
    headers = warning_headers(prepared.warnings)
    try:
        rendering = render(prepared)
        if stream or rendering.whole is None:
            steps = await unless_disconnected(request, started(pipeline.steps(prepared)))
            return EventStream(ending_in_error(rendering.events(steps), rendering.error), headers)
        done = await unless_disconnected(request, _collect(pipeline.steps(prepared)))
    except BaseException:
        if prepared.lease is not None:
            prepared.lease.release()
        raise
    whole = rendering.whole(done)
    return Response(whole, headers=headers) if headers else whole
