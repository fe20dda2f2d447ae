"""POST /v1/chat/completions: OpenAI's chat format over the typed pipeline.

Streaming renders each ``Step``'s parser events as a chunk (reasoning in
``reasoning_content`` / ``reasoning``, tool calls as start + argument deltas);
non-streaming renders the folded ``Completion``: one code path, so the two
always agree.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from litestar import Request, post
from litestar.params import JSONBody

from app.api.errors import stream_error
from app.api.openai.protocol import ChatCompletionRequest
from app.api.state import AppState
from app.api.streaming import EventStream, started, to_json, unless_disconnected
from app.parsers import ContentDelta, Event, ReasoningDelta, ToolCallArgsDelta, ToolCallError, ToolCallStart
from app.pipeline.results import Completion, Step, Usage


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage_dict(u: Usage) -> dict[str, Any]:
    """OpenAI's usage object."""
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens, "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def tool_call_dict(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """OpenAI's ``tool_calls[]`` item (a response's message; a conversation's turns use
    ``app.pipeline.request.ToolCall.as_dict``)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def finish_reason(finish: str, tool_calls: int) -> str:
    """"tool_calls" when the model stopped after calling tools."""
    return "tool_calls" if tool_calls and finish == "stop" else finish


@dataclass
class ChunkWriter:
    """Builds the chunks of one streamed chat completion."""

    model: str
    reasoning_fields: tuple[str, ...] = ("reasoning_content", "reasoning")
    id: str = field(default_factory=lambda: new_id("chatcmpl"))
    created: int = field(default_factory=lambda: int(time.time()))
    tool_calls: int = 0
    parse_error: str | None = None

    def chunk(self, delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "system_fingerprint": "tandem",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            **extra,
        }

    def first(self) -> dict[str, Any]:
        return self.chunk({"role": "assistant", "content": ""})

    def events(self, events: list[Event]) -> list[dict[str, Any]]:
        """Chunks for parser events; empty deltas are never sent."""
        return [self.chunk(delta) for ev in events if (delta := self._delta(ev))]

    def _delta(self, ev: Event) -> dict[str, Any] | None:
        if isinstance(ev, ContentDelta):
            return {"content": ev.text} if ev.text else None
        if isinstance(ev, ReasoningDelta):
            return {name: ev.text for name in self.reasoning_fields} if ev.text else None
        if isinstance(ev, ToolCallStart):
            self.tool_calls += 1
            return {"tool_calls": [{"index": ev.index, **tool_call_dict(ev.id, ev.name, "")}]}
        if isinstance(ev, ToolCallArgsDelta):
            return {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]} if ev.text else None
        if isinstance(ev, ToolCallError):
            self.parse_error = ev.message
        return None  # ToolCallEnd has no OpenAI delta of its own

    def last(self, finish: str) -> dict[str, Any]:
        if self.parse_error is not None:
            return self.chunk({}, "error", error={"message": self.parse_error, "type": "tool_call_parse_error"})
        return self.chunk({}, finish_reason(finish, self.tool_calls))

    def usage_chunk(self, u: Usage) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "system_fingerprint": "tandem", "choices": [], "usage": usage_dict(u)}


def chat_response(model: str, done: Completion, reasoning_fields: tuple[str, ...],
                  extensions: dict[str, Any]) -> dict[str, Any]:
    """The non-streaming chat completion."""
    parsed = done.parsed
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content or None}
    if parsed.reasoning:
        for name in reasoning_fields:
            message[name] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [tool_call_dict(tc.id, tc.name, tc.arguments_json) for tc in parsed.tool_calls]
    elif message["content"] is None:
        message["content"] = ""
    extensions = {**extensions, "reasoning_chunks": parsed.reasoning_chunks,
                  "tool_call_chunks": parsed.tool_call_chunks}
    if parsed.errors:
        extensions["errors"] = [{"message": e, "type": "tool_call_parse_error"} for e in parsed.errors]
    return {
        "id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
        "system_fingerprint": "tandem",
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": finish_reason(done.finish_reason, len(parsed.tool_calls))}],
        "usage": usage_dict(done.usage),
        "extensions": extensions,
    }


async def chat_stream(model: str, reasoning_fields: tuple[str, ...], steps: AsyncIterator[Step],
                      extras: dict[str, Any], include_usage: bool) -> AsyncIterator[str]:
    """The chunks of a streamed chat completion, then ``[DONE]``; an error after the
    start travels as one error event and ends the stream."""
    writer = ChunkWriter(model, reasoning_fields)
    first = writer.first()
    if extras:
        first["extensions"] = extras
    yield to_json(first)
    try:
        async for step in steps:
            for chunk in writer.events(step.events):
                yield to_json(chunk)
            if step.finish_reason is not None:
                yield to_json(writer.last(step.finish_reason))
                if include_usage and step.usage is not None:
                    yield to_json(writer.usage_chunk(step.usage))
    except Exception as exc:  # noqa: BLE001 - once streaming, errors travel as one event
        yield to_json(stream_error(exc))
        return
    yield "[DONE]"


def _extras(extras: dict[str, Any], asked: bool) -> dict[str, Any]:
    """What goes out as ``extensions``: captions and warnings when the request had images,
    everything (the prompt too) when it asked for them."""
    return extras if asked else {k: extras[k] for k in ("captions", "warnings") if k in extras}


@post("/v1/chat/completions", status_code=200, summary="Create a chat completion")
async def chat_completions(data: JSONBody[ChatCompletionRequest], request: Request) -> Any:
    state: AppState = request.app.state.tandem
    req = data.to_request()
    prepared = await state.pipeline.prepare_chat(req)
    extras = _extras(prepared.extras, data.extensions)
    if data.stream:
        steps = await unless_disconnected(request, started(state.pipeline.steps(prepared)))
        include_usage = bool(data.stream_options and data.stream_options.include_usage)
        return EventStream(chat_stream(data.model, state.reasoning_fields, steps, extras, include_usage))
    done = await unless_disconnected(request, state.pipeline.complete(prepared))
    return chat_response(data.model, done, state.reasoning_fields, extras)
