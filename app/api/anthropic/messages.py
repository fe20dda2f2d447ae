"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the typed pipeline.

A stream is Anthropic's event sequence, each ``event: <type>`` with its JSON:

    message_start, ping             at once, before the prompt is prefilled; a ping again while silent
    (content_block_start, content_block_delta*, content_block_stop)*   thinking, text, tool_use blocks
    message_delta                                                      stop_reason, stop_sequence, usage
    message_stop                    (or one ``error`` event, once the stream has started, and the end)

``BlockWriter`` turns the parser's events into the block events, a tool call's
input as several ``input_json_delta`` while the model writes it; the
non-streaming answer folds the very same events into its ``content`` (``fold``),
so the two agree (but for a tool call the parser gives up on halfway: left out
of the answer, it ends the stream in an error event). Every error on these routes, body validation and the
API key guard included, is rendered in Anthropic's shape (``anthropic_error``).
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from litestar import Request, Router, post
from litestar.params import JSONBody
from pydantic_core import from_json

from app.api.anthropic.protocol import CountTokensRequest, MessagesRequest, anthropic_tool_id
from app.api.errors import exception_handlers, stream_error
from app.api.state import AppState
from app.api.streaming import Event, Rendering, answer, to_json
from app.api.wire import new_id
from app.errors import AppError
from app.pipeline.pipeline import Prepared
from app.pipeline.results import (
    Completion,
    ContentDelta,
    ReasoningDelta,
    Step,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallError,
    ToolCallStart,
    Usage,
)
from app.pipeline.results import Event as ParserEvent

# Anthropic's error types by status; other 4xx are invalid requests, other 5xx api_error.
_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error(err: AppError) -> dict[str, Any]:
    """Anthropic's error body."""
    kind = _ERROR_TYPES.get(err.status_code, "api_error" if err.status_code >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def thinking_signature(thinking: str) -> str:
    """Anthropic requires a signature on thinking blocks. Tandem's is the SHA-256 of the
    text; nothing checks it: a thinking block that comes back is read as reasoning."""
    return base64.b64encode(hashlib.sha256(thinking.encode()).digest()).decode()


def usage_dict(u: Usage) -> dict[str, Any]:
    """Anthropic's usage: the prompt is input_tokens + cache_creation_input_tokens (written to the
    prefix cache at its breakpoints) + cache_read_input_tokens (read from it)."""
    fresh = u.prompt_tokens - u.cached_tokens - u.cache_write_tokens
    return {"input_tokens": fresh, "output_tokens": u.completion_tokens,
            "cache_creation_input_tokens": u.cache_write_tokens, "cache_read_input_tokens": u.cached_tokens}


def stop_reason(finish: str, stop_sequence: str | None, tool_uses: int) -> str:
    """Anthropic's stop_reason for how the engine ended and what the model wrote."""
    if finish == "length":
        return "max_tokens"
    if stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if tool_uses else "end_turn"


@dataclass
class _Input:
    """A tool_use block's input being streamed: what has gone out, what is held back."""

    sent: str = ""
    held: str = ""


@dataclass
class BlockWriter:
    """Parser events -> content-block events, each block started, filled and stopped before
    the next.

    A tool call's input streams as it is generated (``stream_inputs``): its block starts
    with the call, and each piece of the arguments goes out as an ``input_json_delta`` once
    the text sent so far still reads as the start of a JSON value (pydantic's partial
    parse, the check the SDK's accumulator makes on every delta with jiter), so the client
    never holds text it refuses. A streamed call the parser gives up on is closed where it
    stands and counted in ``broken``; the stream then ends in an error event rather than
    hand a client half a call to run (``message_events``). The non-streaming answer sends
    each call whole once the parser ends it, and leaves a broken one out: its raw text
    comes as text, in both.
    """

    show_thinking: bool = True
    stream_inputs: bool = False
    index: int = -1
    open: str | None = None  # "text" | "thinking" | "tool_use"
    thinking: list[str] = field(default_factory=list)
    calls: dict[int, tuple[ToolCallStart, list[str]]] = field(default_factory=dict)
    inputs: dict[int, _Input] = field(default_factory=dict)
    tool_uses: int = 0
    # Why each streamed call the parser gave up on was given up.
    broken: list[str] = field(default_factory=list)

    def feed(self, events: list[ParserEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for ev in events:
            if isinstance(ev, ContentDelta) and ev.text:
                out += self._ensure("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": ev.text}))
            elif isinstance(ev, ReasoningDelta) and ev.text:
                out += self._ensure("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                self.thinking.append(ev.text)
                if self.show_thinking:
                    out.append(self._delta({"type": "thinking_delta", "thinking": ev.text}))
            elif isinstance(ev, ToolCallStart):
                self.calls[ev.index] = (ev, [])
                if self.stream_inputs:
                    out += [*self._close(), self._start(self._tool_block(ev))]
                    self.open, self.inputs[ev.index] = "tool_use", _Input()
            elif isinstance(ev, ToolCallArgsDelta) and ev.index in self.calls:
                self.calls[ev.index][1].append(ev.text)
                if ev.index in self.inputs:
                    out += self._input(self.inputs[ev.index], ev.text)
            elif isinstance(ev, ToolCallEnd) and ev.index in self.calls:
                start, args = self.calls.pop(ev.index)
                self.tool_uses += 1
                if ev.index in self.inputs:  # the parser has read it whole: the rest goes out
                    out += self._input(self.inputs.pop(ev.index), "", whole=True)
                    out += self._close()
                else:
                    out += self._tool_use(start, args)
            elif isinstance(ev, ToolCallError) and ev.index is not None:
                self.calls.pop(ev.index, None)
                if self.inputs.pop(ev.index, None) is not None:
                    self.broken.append(ev.message)
                    out += self._close()
        return out

    def finish(self) -> list[dict[str, Any]]:
        """Close the open block."""
        return self._close()

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def _start(self, block: dict[str, Any]) -> dict[str, Any]:
        self.index += 1
        return {"type": "content_block_start", "index": self.index, "content_block": block}

    def _ensure(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        if self.open == kind:
            return []
        out = self._close()
        self.open = kind
        return [*out, self._start(block)]

    def _close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            signature = thinking_signature("".join(self.thinking))
            out.append(self._delta({"type": "signature_delta", "signature": signature}))
            self.thinking = []
        self.open = None
        return [*out, {"type": "content_block_stop", "index": self.index}]

    def _input(self, state: _Input, text: str, whole: bool = False) -> list[dict[str, Any]]:
        """The held-back arguments and ``text``, sent once they begin a JSON value (all of
        them when ``whole``: the parser has checked the complete text)."""
        state.held += text
        if not state.held or not (whole or _json_prefix(state.sent + state.held)):
            return []
        piece, state.held = state.held, ""
        state.sent += piece
        return [self._delta({"type": "input_json_delta", "partial_json": piece})]

    @staticmethod
    def _tool_block(start: ToolCallStart) -> dict[str, Any]:
        return {"type": "tool_use", "id": anthropic_tool_id(start.id), "name": start.name, "input": {}}

    def _tool_use(self, start: ToolCallStart, args: list[str]) -> list[dict[str, Any]]:
        """A call the parser has ended, whole: its block and its input in one delta."""
        out = [*self._close(), self._start(self._tool_block(start))]
        out.append(self._delta({"type": "input_json_delta", "partial_json": "".join(args)}))
        return [*out, {"type": "content_block_stop", "index": self.index}]


def _json_prefix(text: str) -> bool:
    """Whether ``text`` reads as the start of a JSON value (what the SDKs' partial parse takes)."""
    try:
        from_json(text, allow_partial=True)
    except ValueError:
        return False
    return True


def fold(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The content blocks a run of block events builds, as the SDK's accumulator builds them."""
    blocks: list[dict[str, Any]] = []
    inputs: dict[int, str] = {}
    for ev in events:
        if ev["type"] == "content_block_start":
            blocks.append(dict(ev["content_block"]))
        elif ev["type"] == "content_block_delta":
            block, delta = blocks[ev["index"]], ev["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            elif delta["type"] == "input_json_delta":
                inputs[ev["index"]] = inputs.get(ev["index"], "") + delta["partial_json"]
    for i, text in inputs.items():
        blocks[i]["input"] = json.loads(text) if text else {}
    return blocks


@dataclass
class MessageView:
    """What every rendering of one answer shares."""

    model: str
    show_thinking: bool
    input_tokens: int
    id: str = field(default_factory=lambda: new_id("msg", "_"))

    def message(self, content: list[dict[str, Any]], stop: str | None, stop_sequence: str | None,
                usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop, "stop_sequence": stop_sequence, "usage": usage}


def _event(data: dict[str, Any]) -> Event:
    return Event(to_json(data), data["type"])


# Right after message_start, then while the stream is silent (a long prompt queued or prefilling).
PING = _event({"type": "ping"})


async def message_events(view: MessageView, steps: AsyncIterator[Step]) -> AsyncIterator[Event]:
    """The stream of one answer."""
    start_usage = {"input_tokens": view.input_tokens, "output_tokens": 0, "cache_creation_input_tokens": 0,
                   "cache_read_input_tokens": 0}
    yield _event({"type": "message_start", "message": view.message([], None, None, start_usage)})
    yield PING  # as Anthropic's API does, before the first block: the client knows the stream is alive
    writer = BlockWriter(view.show_thinking, stream_inputs=True)
    async for step in steps:
        for ev in writer.feed(step.events):
            yield _event(ev)
        if step.finish_reason is not None and step.usage is not None:
            for ev in writer.finish():
                yield _event(ev)
            if writer.broken and step.finish_reason != "length":
                # Half a call has gone out: an error, not a turn a client would act on. (Cut
                # short by max_tokens, it is Anthropic's own max_tokens stop.)
                err = AppError(f"the model wrote a tool call that cannot be read ({writer.broken[0]}); "
                               "retry the request", code="tool_call_parse_error")
                yield _event(anthropic_error(err))
                return
            delta = {"stop_reason": stop_reason(step.finish_reason, step.stop_sequence, writer.tool_uses),
                     "stop_sequence": step.stop_sequence}
            yield _event({"type": "message_delta", "delta": delta, "usage": usage_dict(step.usage)})
    yield _event({"type": "message_stop"})


def message_response(view: MessageView, steps: list[Step]) -> dict[str, Any]:
    """The non-streaming answer, folded from the same steps as a stream."""
    done = Completion.fold(steps)
    writer = BlockWriter(view.show_thinking)
    content = fold(writer.feed(done.events) + writer.finish())
    stop = stop_reason(done.finish_reason, done.stop_sequence, writer.tool_uses)
    return view.message(content, stop, done.stop_sequence, usage_dict(done.usage))


def _rendering(data: MessagesRequest, prepared: Prepared) -> Rendering:
    view = MessageView(data.model, data.thinking_shown(), len(prepared.gen.prompt_tokens))
    # A failure after the start is one ``error`` event in Anthropic's shape, then the end.
    return Rendering(events=lambda steps: message_events(view, steps),
                     error=lambda exc: [_event(stream_error(exc, anthropic_error))],
                     whole=lambda steps: message_response(view, steps), keepalive=PING)


@post("/", status_code=200, summary="Create a message (Anthropic Messages API)")
async def create_message(data: JSONBody[MessagesRequest], request: Request) -> Any:
    state: AppState = request.app.state.tandem
    return await answer(request, state.pipeline, state.pipeline.prepare_chat(data.to_request()), data.stream,
                        lambda prepared: _rendering(data, prepared))


@post("/count_tokens", status_code=200, summary="Count a message's input tokens (Anthropic Messages API)")
async def count_tokens(data: JSONBody[CountTokensRequest], request: Request) -> dict[str, int]:
    state: AppState = request.app.state.tandem
    return {"input_tokens": await state.pipeline.count_chat(data.to_request())}


def anthropic_router(guards: list[Callable[..., Any]]) -> Router:
    """The Messages routes, whose every error (the body's validation and ``guards`` too)
    comes out in Anthropic's shape."""
    return Router("/v1/messages", route_handlers=[create_message, count_tokens], guards=guards,
                  exception_handlers=exception_handlers(anthropic_error))
