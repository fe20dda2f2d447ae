"""The hand-off from the engine thread to a stream's reader: order, merging, waking.

The engine thread here is the test's own; each reader runs on an event loop in a thread of
its own, as the server's handlers do.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest

from app.engine.batch.channel import TokenChannel, deferred_wakes
from app.engine.types import TokenDelta, TokenLogprob


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def channel(loop: asyncio.AbstractEventLoop, maxsize: int = 32) -> TokenChannel:
    async def make() -> TokenChannel:
        return TokenChannel(asyncio.get_running_loop(), maxsize)

    return asyncio.run_coroutine_threadsafe(make(), loop).result(5)


def get(loop: asyncio.AbstractEventLoop, ch: TokenChannel, timeout: float = 5) -> list[TokenDelta]:
    return asyncio.run_coroutine_threadsafe(ch.get(), loop).result(timeout)


def lp(token: int) -> TokenLogprob:
    return TokenLogprob(token, -0.5)


def test_a_reader_behind_takes_what_is_pending_as_one_delta(loop):
    ch = channel(loop)
    for i in range(5):
        ch.put(TokenDelta(text=f"t{i} ", tokens=1, logprobs=[lp(i)]))
    ch.put(TokenDelta(text="end", tokens=1, logprobs=[lp(5)], finish_reason="stop", prompt_tokens=7,
                      completion_tokens=6, cached_tokens=3, reasoning_tokens=2, stop_sequence="###",
                      accepted_prediction_tokens=4, rejected_prediction_tokens=1))
    (delta,) = get(loop, ch)
    assert delta.text == "t0 t1 t2 t3 t4 end" and delta.tokens == 6
    assert [x.token for x in delta.logprobs] == [0, 1, 2, 3, 4, 5]
    assert (delta.finish_reason, delta.stop_sequence) == ("stop", "###")
    assert (delta.prompt_tokens, delta.completion_tokens, delta.cached_tokens, delta.reasoning_tokens) == (7, 6, 3, 2)
    assert (delta.accepted_prediction_tokens, delta.rejected_prediction_tokens) == (4, 1)
    ch.put(TokenDelta(text="after the end", tokens=1))  # dropped: the channel closed with the end
    assert ch.closed


def test_an_error_comes_after_the_text_before_it(loop):
    ch = channel(loop)
    ch.put(TokenDelta(text="a", tokens=1))
    ch.put(TokenDelta(text="b", tokens=1))
    boom = RuntimeError("boom")
    ch.put(TokenDelta(error=boom))
    text, error = get(loop, ch)
    assert (text.text, text.tokens, text.error) == ("ab", 2, None)
    assert error.error is boom and error.text == ""


def test_a_full_channel_merges_into_its_last_delta_and_keeps_the_end(loop):
    ch = channel(loop, maxsize=2)
    for i in range(4):
        ch.put(TokenDelta(text=str(i), tokens=1))
    ch.put(TokenDelta(text="!", tokens=1, finish_reason="length", completion_tokens=5, reasoning_tokens=3,
                      accepted_prediction_tokens=2))
    (delta,) = get(loop, ch)
    assert (delta.text, delta.tokens, delta.finish_reason) == ("0123!", 5, "length")
    assert (delta.completion_tokens, delta.reasoning_tokens, delta.accepted_prediction_tokens) == (5, 3, 2)


def test_a_steps_puts_wake_their_readers_when_the_step_ends(loop):
    channels = [channel(loop) for _ in range(3)]
    readers = [asyncio.run_coroutine_threadsafe(ch.get(), loop) for ch in channels]
    time.sleep(0.05)  # every reader waits
    with deferred_wakes():
        for i, ch in enumerate(channels):
            ch.put(TokenDelta(text=str(i), tokens=1))
        time.sleep(0.2)
        assert not any(r.done() for r in readers)  # held until the step's tokens are all in
    assert [r.result(5)[0].text for r in readers] == ["0", "1", "2"]


def test_outside_a_step_a_put_wakes_its_reader_at_once(loop):
    ch = channel(loop)
    reader = asyncio.run_coroutine_threadsafe(ch.get(), loop)
    ch.put(TokenDelta(text="x", tokens=1))
    assert reader.result(5)[0].text == "x"


def test_a_put_after_the_loop_is_gone_does_not_raise():
    loop = asyncio.new_event_loop()

    async def make() -> TokenChannel:
        return TokenChannel(asyncio.get_running_loop())

    ch = loop.run_until_complete(make())
    loop.close()
    ch.put(TokenDelta(text="late", tokens=1))
    with deferred_wakes():
        ch.put(TokenDelta(text="later", tokens=1))


def test_a_loop_is_not_kept_alive_by_its_channels_waker():
    import gc
    import weakref

    loop = asyncio.new_event_loop()

    async def make() -> TokenChannel:
        return TokenChannel(asyncio.get_running_loop())

    ch = loop.run_until_complete(make())
    loop.close()
    gone = weakref.ref(loop)
    del loop, ch
    gc.collect()
    assert gone() is None
