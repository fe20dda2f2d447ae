"""``ending_in_error``: the one stream-error tail every wire format shares."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from app.api.streaming import ending_in_error


def run(events: AsyncIterator[str]) -> list[str]:
    async def drain() -> list[str]:
        return [ev async for ev in events]

    return asyncio.run(drain())


def on_error(exc: Exception) -> list[str]:
    return [f"error:{exc}"]


async def failing() -> AsyncIterator[str]:
    yield "a"
    yield "b"
    raise RuntimeError("boom")
    yield "never"  # the format's own ending ([DONE], message_stop) is not reached


async def finishing() -> AsyncIterator[str]:
    yield "a"
    yield "[DONE]"


def test_a_failure_after_the_start_is_the_formats_error_events_then_the_end():
    assert run(ending_in_error(failing(), on_error)) == ["a", "b", "error:boom"]


def test_a_stream_that_ends_well_has_no_error_event():
    assert run(ending_in_error(finishing(), on_error)) == ["a", "[DONE]"]


def test_closing_the_stream_closes_the_formats_generator():
    """A vanished client closes the response's iterator; the format's generator (and the
    generation under it) must close with it, not wait for the garbage collector."""
    closed = []

    async def endless() -> AsyncIterator[str]:
        try:
            while True:
                yield "x"
        finally:
            closed.append(True)

    async def take_one() -> None:
        stream = ending_in_error(endless(), on_error)
        assert await stream.__anext__() == "x"
        await stream.aclose()  # type: ignore[attr-defined]

    asyncio.run(take_one())
    assert closed == [True]
