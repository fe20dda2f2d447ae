"""POST /v1/agui: an AG-UI 1.0 agent endpoint over the same chat path.

Takes a ``RunAgentInput`` (messages, tools), runs it through the same vision
proxy, chat template, engine and stream parser as /v1/chat/completions, and
answers with an SSE stream of AG-UI events built with the official
``ag-ui-protocol`` models:

    RUN_STARTED
    (REASONING_START, REASONING_MESSAGE_START, REASONING_MESSAGE_CONTENT*, REASONING_MESSAGE_END, REASONING_END)?
    (TEXT_MESSAGE_START, TEXT_MESSAGE_CONTENT*, TEXT_MESSAGE_END)?
    (TOOL_CALL_START, TOOL_CALL_ARGS*, TOOL_CALL_END)*
    RUN_FINISHED | RUN_ERROR

Reasoning, text and tool calls may interleave as the model emits them; each
open block is closed before another kind starts.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from ag_ui.core import (
    PROTOCOL_VERSION,
    BaseEvent,
    ReasoningEndEvent,
    ReasoningMessageContentEvent,
    ReasoningMessageEndEvent,
    ReasoningMessageStartEvent,
    ReasoningStartEvent,
    RunAgentInput,
    RunErrorEvent,
    RunFinishedEvent,
    RunStartedEvent,
    TextMessageContentEvent,
    TextMessageEndEvent,
    TextMessageStartEvent,
    ToolCallArgsEvent,
    ToolCallEndEvent,
    ToolCallStartEvent,
)
from litestar import Request, post
from litestar.params import JSONBody
from litestar.response import ServerSentEvent

from app.api.schemas import ChatCompletionRequest
from app.api.state import AppState
from app.errors import AppError, InvalidRequestError
from app.parsers import ContentDelta, ReasoningDelta, ToolCallArgsDelta, ToolCallEnd, ToolCallError, ToolCallStart


def _part(part: Any) -> dict[str, Any]:
    if part.type == "text":
        return {"type": "text", "text": part.text}
    if part.type == "image":
        src = part.source
        if src.type == "data":
            return {"type": "image_url", "image_url": {"url": f"data:{src.mime_type};base64,{src.value}"}}
        if src.type == "url":
            return {"type": "image_url", "image_url": {"url": src.value}}
    raise InvalidRequestError(f"AG-UI content part {part.type!r} is not supported", param="messages")


def to_chat_request(inp: RunAgentInput, model: str) -> ChatCompletionRequest:
    """An AG-UI run as the equivalent chat completion request."""
    messages: list[dict[str, Any]] = []
    for m in inp.messages:
        if m.role in ("system", "developer"):
            messages.append({"role": "system", "content": m.content})
        elif m.role == "user":
            content = m.content if isinstance(m.content, str) else [_part(p) for p in m.content]
            messages.append({"role": "user", "content": content})
        elif m.role == "assistant":
            msg: dict[str, Any] = {"role": "assistant", "content": m.content}
            if m.tool_calls:
                msg["tool_calls"] = [{"id": tc.id, "type": "function",
                                      "function": {"name": tc.function.name, "arguments": tc.function.arguments}}
                                     for tc in m.tool_calls]
            messages.append(msg)
        elif m.role == "tool":
            content = m.content if isinstance(m.content, str) else json.dumps([p.model_dump() for p in m.content])
            messages.append({"role": "tool", "content": content, "tool_call_id": m.tool_call_id})
        # activity and reasoning messages are UI state, not model input
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": t.parameters or {"type": "object", "properties": {}}}}
             for t in inp.tools or []]
    props = inp.forwarded_props if isinstance(inp.forwarded_props, dict) else {}
    body = {"model": model, "messages": messages, "stream": True, **({"tools": tools} if tools else {})}
    for key in ("temperature", "max_tokens", "top_p", "thinking", "seed"):
        if key in props:
            body[key] = props[key]
    return ChatCompletionRequest.model_validate(body)


class AguiRenderer:
    """Parser events -> AG-UI events, opening and closing blocks in a legal order."""

    def __init__(self) -> None:
        self.open: str | None = None  # "text" | "reasoning"
        self.message_id = ""
        self.tool_ids: dict[int, str] = {}
        self.error: str | None = None

    def _close(self) -> list[BaseEvent]:
        out: list[BaseEvent] = []
        if self.open == "text":
            out.append(TextMessageEndEvent(messageId=self.message_id))
        elif self.open == "reasoning":
            out += [ReasoningMessageEndEvent(messageId=self.message_id), ReasoningEndEvent(messageId=self.message_id)]
        self.open = None
        return out

    def _ensure(self, kind: str) -> list[BaseEvent]:
        if self.open == kind:
            return []
        out = self._close()
        self.open, self.message_id = kind, f"msg_{uuid.uuid4().hex[:16]}"
        if kind == "text":
            out.append(TextMessageStartEvent(messageId=self.message_id, role="assistant"))
        else:
            out += [ReasoningStartEvent(messageId=self.message_id), ReasoningMessageStartEvent(messageId=self.message_id)]
        return out

    def feed(self, events: list[Any]) -> list[BaseEvent]:
        out: list[BaseEvent] = []
        for ev in events:
            if isinstance(ev, ContentDelta) and ev.text:
                out += self._ensure("text") + [TextMessageContentEvent(messageId=self.message_id, delta=ev.text)]
            elif isinstance(ev, ReasoningDelta) and ev.text:
                out += self._ensure("reasoning") + [ReasoningMessageContentEvent(messageId=self.message_id, delta=ev.text)]
            elif isinstance(ev, ToolCallStart):
                out += self._close()
                self.tool_ids[ev.index] = ev.id
                out.append(ToolCallStartEvent(toolCallId=ev.id, toolCallName=ev.name))
            elif isinstance(ev, ToolCallArgsDelta) and ev.text:
                out.append(ToolCallArgsEvent(toolCallId=self.tool_ids[ev.index], delta=ev.text))
            elif isinstance(ev, ToolCallEnd):
                out.append(ToolCallEndEvent(toolCallId=self.tool_ids[ev.index]))
            elif isinstance(ev, ToolCallError):
                self.error = ev.message
        return out

    def finish(self) -> list[BaseEvent]:
        return self._close()


def encode(event: BaseEvent) -> str:
    return event.model_dump_json(by_alias=True, exclude_none=True)


async def agui_events(state: AppState, inp: RunAgentInput) -> AsyncIterator[str]:
    from app.api.chat import generate_events, prepare

    yield encode(RunStartedEvent(threadId=inp.thread_id, runId=inp.run_id, protocolVersion=PROTOCOL_VERSION))
    renderer = AguiRenderer()
    try:
        req = to_chat_request(inp, state.profile.name)
        prepared, _ = await prepare(state, req)
        async for events, _delta in generate_events(state, prepared):
            for ev in renderer.feed(events):
                yield encode(ev)
        for ev in renderer.finish():
            yield encode(ev)
        if renderer.error is not None:
            yield encode(RunErrorEvent(message=renderer.error, code="tool_call_parse_error"))
            return
    except Exception as exc:  # noqa: BLE001 - any failure ends the run with RUN_ERROR
        err = exc if isinstance(exc, AppError) else AppError("internal error during the run")
        for ev in renderer.finish():
            yield encode(ev)
        yield encode(RunErrorEvent(message=err.message, code=err.code or err.openai_type))
        return
    yield encode(RunFinishedEvent(threadId=inp.thread_id, runId=inp.run_id))


@post("/v1/agui", status_code=200, summary="Run the model as an AG-UI agent (SSE of AG-UI events)")
async def agui(data: JSONBody[RunAgentInput], request: Request) -> ServerSentEvent:
    state: AppState = request.app.state.tandem
    return ServerSentEvent(agui_events(state, data))
