"""``AguiRenderer``: parser events -> AG-UI events in an order AG-UI's verifier accepts."""

from __future__ import annotations

from ag_ui.core import EventType

from app.api.agui import AguiRenderer
from app.parsers import make_parser
from tests.parsers.streams import counting_ids


def _types(text: str, family: str) -> tuple[list[EventType], AguiRenderer]:
    parser = make_parser(family, reasoning=False, tools_offered=True, id_factory=counting_ids())
    renderer = AguiRenderer()
    out = []
    for ch in text:  # one character at a time: the hardest split
        out += renderer.feed(parser.feed(ch))
    out += renderer.feed(parser.finish()) + renderer.finish()
    return [e.type for e in out], renderer


def test_a_call_found_broken_after_its_start_is_still_ended() -> None:
    types, renderer = _types("<function=f>{oops}</function>", "llama")
    assert renderer.error
    start = types.index(EventType.TOOL_CALL_START)
    end = types.index(EventType.TOOL_CALL_END)
    assert start < end
    assert types.count(EventType.TOOL_CALL_START) == types.count(EventType.TOOL_CALL_END) == 1
    # The raw text comes back as a text message, opened after the call ended.
    assert types.index(EventType.TEXT_MESSAGE_START) > end
    assert types[-1] == EventType.TEXT_MESSAGE_END


def test_a_good_call_is_ended_once() -> None:
    types, renderer = _types('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "mistral")
    assert renderer.error is None
    assert types.count(EventType.TOOL_CALL_START) == types.count(EventType.TOOL_CALL_END) == 1
    assert types[0] == EventType.TOOL_CALL_START and types[-1] == EventType.TOOL_CALL_END
