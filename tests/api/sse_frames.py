"""The bytes of a Server-Sent Events stream, read raw and checked strictly.

Every Tandem stream, whatever its wire format, is a run of events of this exact shape:

    event: <name>\\n            only in formats with named events (Responses, Anthropic
                               Messages), where <name> is also the data's "type"
    data: <JSON or [DONE]>\\n
    \\n

and nothing else: no ``\\r`` anywhere (clients that split on ``\\n\\n``, ``@ag-ui/client``
among them, read nothing from ``\\r\\n`` frames), no other comments, no empty
events, one data line per event (JSON never needs two), UTF-8 throughout, ``[DONE]``
only last. The one comment is the keep-alive (``: keep-alive``, OpenAI's formats, on a
stream silent for ``server.sse_keepalive_s``), left out of the frames; Anthropic's is
its ``ping`` event. ``iter_lines`` would forgive most of these; the bytes do not.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

DONE = "[DONE]"
KEEPALIVE = ": keep-alive"


@dataclass(frozen=True)
class Frame:
    """One event as it was on the wire."""

    data: str
    name: str | None = None

    def json(self) -> Any:
        return json.loads(self.data)


def parse_frames(raw: bytes, *, named: bool = False) -> list[Frame]:
    """``raw``'s events, asserting the shape above (``named``: each has an ``event:`` line)."""
    assert raw, "the stream is empty"
    cr = raw.find(b"\r")
    assert cr == -1, f"a \\r on the wire at byte {cr}: {raw[max(0, cr - 60):cr + 60]!r}"
    text = raw.decode("utf-8")  # strict: a bad byte fails here
    assert text.endswith("\n\n"), f"the stream does not end with a whole event: {text[-120:]!r}"
    frames = [_frame(block, named) for block in text[:-2].split("\n\n") if block != KEEPALIVE]
    assert DONE not in (f.data for f in frames[:-1]), "[DONE] before the last event"
    return frames


def _frame(block: str, named: bool) -> Frame:
    lines = block.split("\n")
    name = None
    if named:
        assert len(lines) == 2 and lines[0].startswith("event: "), f"not an event: line, then data: {block!r}"
        name = lines.pop(0).removeprefix("event: ")
    assert len(lines) == 1 and lines[0].startswith("data: "), f"not one data line: {block!r}"
    data = lines[0].removeprefix("data: ")
    if data != DONE:
        body = json.loads(data)
        assert isinstance(body, dict), f"data is not a JSON object: {data!r}"
        if named:
            assert body.get("type") == name, f"event {name!r} carries type {body.get('type')!r}"
    return Frame(data, name)


def read_stream(base_url: str, path: str, body: dict[str, Any]) -> bytes:
    """POST ``body`` and return the response's bytes exactly as sent, after checking it is a 200
    ``text/event-stream``."""
    return b"".join(stream_chunks(base_url, path, body))


def stream_chunks(base_url: str, path: str, body: dict[str, Any], timeout: float = 120) -> Iterator[bytes]:
    """The raw chunks of a streamed response, as they arrive."""
    with httpx.stream("POST", base_url + path, json=body, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].split(";")[0] == "text/event-stream", r.headers["content-type"]
        assert "content-encoding" not in r.headers  # iter_raw is then the bytes the server wrote
        yield from r.iter_raw()
