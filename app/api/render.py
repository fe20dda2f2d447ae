"""Parser events -> OpenAI chat completion chunks and responses.

One stream parser per request turns generated text into reasoning, content
and tool-call events. Streaming renders each event as a chunk; non-streaming
feeds the whole text and folds the same events with ``collect``: one code
path, so the two always agree.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from app.parsers import (
    ContentDelta,
    ReasoningDelta,
    ToolCallArgsDelta,
    ToolCallError,
    ToolCallStart,
    collect,
)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@dataclass
class ChunkWriter:
    """Builds the chunks of one streamed chat completion."""

    model: str
    reasoning_fields: tuple[str, ...] = ("reasoning_content", "reasoning")
    id: str = field(default_factory=lambda: new_id("chatcmpl"))
    created: int = field(default_factory=lambda: int(time.time()))
    tool_calls: int = 0
    parse_error: str | None = None

    def chunk(self, delta: dict[str, Any], finish_reason: str | None = None, **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": "tandem",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}],
            **extra,
        }

    def first(self) -> dict[str, Any]:
        return self.chunk({"role": "assistant", "content": ""})

    def events(self, events: list[Any]) -> list[dict[str, Any]]:
        """Chunks for parser events; empty deltas are never sent."""
        out = []
        for ev in events:
            delta = self._delta(ev)
            if delta:
                out.append(self.chunk(delta))
        return out

    def _delta(self, ev: Any) -> dict[str, Any] | None:
        if isinstance(ev, ContentDelta):
            return {"content": ev.text} if ev.text else None
        if isinstance(ev, ReasoningDelta):
            return {name: ev.text for name in self.reasoning_fields} if ev.text else None
        if isinstance(ev, ToolCallStart):
            self.tool_calls += 1
            return {"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                    "function": {"name": ev.name, "arguments": ""}}]}
        if isinstance(ev, ToolCallArgsDelta):
            return {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]} if ev.text else None
        if isinstance(ev, ToolCallError):
            self.parse_error = ev.message
        return None  # ToolCallEnd has no OpenAI delta of its own

    def last(self, finish_reason: str) -> dict[str, Any]:
        if self.parse_error is not None:
            return self.chunk({}, "error", error={"message": self.parse_error, "type": "tool_call_parse_error"})
        if self.tool_calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return self.chunk({}, finish_reason)

    def usage_chunk(self, u: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "system_fingerprint": "tandem", "choices": [], "usage": u}


def chat_response(
    model: str,
    events: list[Any],
    finish_reason: str,
    u: dict[str, Any],
    reasoning_fields: tuple[str, ...],
    extensions: dict[str, Any],
) -> dict[str, Any]:
    """The non-streaming chat completion, folded from the same parser events."""
    parsed = collect(events)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content or None}
    if parsed.reasoning:
        for name in reasoning_fields:
            message[name] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [
            {"id": tc.id, "type": "function", "function": {"name": tc.name, "arguments": tc.arguments_json}}
            for tc in parsed.tool_calls
        ]
        if finish_reason == "stop":
            finish_reason = "tool_calls"
    if message["content"] is None and not parsed.tool_calls:
        message["content"] = ""
    extensions = {**extensions, "reasoning_chunks": parsed.reasoning_chunks, "tool_call_chunks": parsed.tool_call_chunks}
    if parsed.errors:
        extensions["errors"] = [{"message": e, "type": "tool_call_parse_error"} for e in parsed.errors]
    return {
        "id": new_id("chatcmpl"),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": "tandem",
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish_reason}],
        "usage": u,
        "extensions": extensions,
    }


def sse(data: dict[str, Any] | str) -> str:
    return data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
