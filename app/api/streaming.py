"""How a generation meets HTTP, for every wire format.

- ``EventStream``: Server-Sent Events framed with ``\\n`` (``data: ...\\n\\n``), as
  AG-UI's own encoder and OpenAI write them; clients that split on ``\\n\\n``
  (``@ag-ui/client``) read nothing from ``\\r\\n`` frames.
- ``started``: a stream's response begins only once its first item is in, so a
  refusal before the first token (429 queue full, 503 queue timeout) is an HTTP
  status, not a 200 stream with an error inside.
- ``unless_disconnected``: awaits work, cancelling it when the client hangs up;
  ``ClientGone`` then becomes nginx's 499 ("client closed request") at the edge.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from litestar import Request
from litestar.response import Stream

T = TypeVar("T")


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

    def __init__(self, events: AsyncIterator[Event | str]) -> None:
        super().__init__(
            _frames(events),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
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
