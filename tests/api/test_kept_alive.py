"""``kept_alive``: a stream's events in the batches they came in, keep-alives while it is silent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from app.api.streaming import kept_alive


def test_events_that_come_together_go_out_together():
    async def scenario() -> list[list[str]]:
        go = asyncio.Event()

        async def events() -> AsyncIterator[str]:
            yield "a"
            await go.wait()
            for x in "bcd":  # three at once, as a reader behind the engine finds them
                yield x

        out = kept_alive(events(), 5.0, "ka")
        first = await out.__anext__()
        go.set()
        await asyncio.sleep(0.05)
        return [first, *[batch async for batch in out]]

    assert asyncio.run(scenario()) == [["a"], ["b", "c", "d"]]


def test_a_silent_stream_gets_keepalives_until_its_events_come():
    async def scenario() -> list[list[str]]:
        async def events() -> AsyncIterator[str]:
            await asyncio.sleep(0.35)
            yield "late"
            for x in "xy":
                await asyncio.sleep(0.02)  # events flowing: no keep-alive between them
                yield x

        return [batch async for batch in kept_alive(events(), 0.1, "ka")]

    batches = asyncio.run(scenario())
    assert batches[-3:] == [["late"], ["x"], ["y"]]
    assert 2 <= len(batches[:-3]) <= 3 and all(b == ["ka"] for b in batches[:-3])


def test_a_failure_comes_after_the_events_before_it():
    async def scenario() -> list[list[str]]:
        async def events() -> AsyncIterator[str]:
            yield "a"
            raise ValueError("boom")

        got = []
        with pytest.raises(ValueError, match="boom"):
            async for batch in kept_alive(events(), 5.0, "ka"):
                got.append(batch)
        return got

    assert asyncio.run(scenario()) == [["a"]]


def test_closing_the_stream_closes_its_events():
    closed = []

    async def scenario() -> None:
        async def events() -> AsyncIterator[str]:
            try:
                yield "a"
                await asyncio.sleep(60)
                yield "never"
            finally:
                closed.append(True)

        out = kept_alive(events(), 5.0, "ka")
        assert await out.__anext__() == ["a"]
        await out.aclose()
        await asyncio.sleep(0.05)

    asyncio.run(scenario())
    assert closed == [True]


def test_without_keepalives_each_event_is_its_own_batch():
    async def scenario() -> list[list[str]]:
        async def events() -> AsyncIterator[str]:
            for x in "abc":
                yield x

        return [batch async for batch in kept_alive(events(), 0, "ka")]

    assert asyncio.run(scenario()) == [["a"], ["b"], ["c"]]
