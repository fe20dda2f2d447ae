"""POST /v1/agui: an AG-UI 1.0 agent endpoint over the typed pipeline.

Takes a ``RunAgentInput`` (messages, tools), runs it through the same pipeline
as /v1/chat/completions, and answers with an SSE stream of AG-UI events built
with the official ``ag-ui-protocol`` models:

    RUN_STARTED
    (REASONING_START, REASONING_MESSAGE_START, REASONING_MESSAGE_CONTENT*, REASONING_MESSAGE_END, REASONING_END)?
    (TEXT_MESSAGE_START, TEXT_MESSAGE_CONTENT*, TEXT_MESSAGE_END)?
    (TOOL_CALL_START, TOOL_CALL_ARGS*, TOOL_CALL_END)*
    RUN_FINISHED | RUN_ERROR

Reasoning, text and tool calls may interleave as the model emits them; each
open block is closed before another kind starts. Everything that can be
checked is checked before the run starts, so a client mistake is a 4xx, never
a RUN_ERROR "internal error".
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, Literal

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
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.api.errors import as_app_error
from app.api.state import AppState
from app.api.streaming import Event, EventStream, Rendering, answer
from app.api.wire import JsonBool, new_id
from app.errors import InvalidRequestError
from app.pipeline import request as typed
from app.pipeline.results import (
    ContentDelta,
    ReasoningDelta,
    Step,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallError,
    ToolCallStart,
)
from app.pipeline.results import Event as ParserEvent


class ForwardedProps(BaseModel):
    """What a run may set through ``forwardedProps``; anything else is ignored."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    max_tokens: int | None = Field(default=None, ge=1)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    thinking: JsonBool | None = None
    # How much to reason: an effort level (the model's reasoning_budgets), or a budget in tokens.
    reasoning_effort: Literal["minimal", "low", "medium", "high", "xhigh"] | None = None
    thinking_budget: int | None = Field(default=None, ge=0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    # vLLM's, as on every format: runs with different salts never share cached prefixes.
    cache_salt: str | None = None


def _props(inp: RunAgentInput) -> ForwardedProps:
    raw = inp.forwarded_props if isinstance(inp.forwarded_props, dict) else {}
    try:
        return ForwardedProps.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise InvalidRequestError(f"forwardedProps.{where}: {err['msg']}", param=f"forwardedProps.{where}") from exc


def _part(part: Any, where: str) -> typed.Part:
    if part.type == "text":
        return typed.TextPart(part.text)
    if part.type == "image" and part.source.type in ("data", "url"):
        src = part.source
        url = f"data:{src.mime_type};base64,{src.value}" if src.type == "data" else src.value
        return typed.ImagePart(url, where)
    raise InvalidRequestError(f"{where}: AG-UI content part {part.type!r} is not supported", param=where)


def _message(m: Any, i: int) -> typed.Message | None:
    where = f"messages[{i}]"
    if m.role in ("system", "developer"):
        return typed.Message.of("system", m.content, param=where)
    if m.role == "user":
        if isinstance(m.content, str):
            return typed.Message.of("user", m.content, param=where)
        return typed.Message("user", tuple(_part(p, f"{where}.content[{j}]") for j, p in enumerate(m.content)),
                             param=where)
    if m.role == "assistant":
        calls = tuple(typed.ToolCall(tc.id, tc.function.name, tc.function.arguments or "{}")
                      for tc in m.tool_calls or ())
        if not m.content and not calls:
            raise InvalidRequestError(f"{where}: an assistant message needs content or toolCalls", param=where)
        return typed.Message("assistant", (typed.TextPart(m.content),) if m.content else (), tool_calls=calls,
                             param=where)
    if m.role == "tool":
        content = m.content if isinstance(m.content, str) else json.dumps([p.model_dump() for p in m.content])
        return typed.Message.of("tool", content, tool_call_id=m.tool_call_id, param=where)
    return None  # activity and reasoning messages are UI state, not model input


def _tool(t: Any, i: int) -> typed.Tool:
    where = f"tools[{i}]"
    if not 0 < len(t.name) <= 64:
        raise InvalidRequestError(f"{where}.name: a tool name has 1 to 64 characters", param=f"{where}.name")
    parameters = t.parameters if t.parameters is not None else {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise InvalidRequestError(f"{where}.parameters: must be a JSON schema object", param=f"{where}.parameters")
    return typed.Tool(t.name, t.description, parameters)


def to_chat_request(inp: RunAgentInput, default_model: str) -> typed.ChatRequest:
    """An AG-UI run as the pipeline's typed request; every client mistake is a 400 here."""
    props = _props(inp)
    messages = tuple(t for i, m in enumerate(inp.messages) if (t := _message(m, i)) is not None)
    if not messages:
        raise InvalidRequestError("messages: a run needs at least one message", param="messages")
    sampling = typed.Sampling(temperature=props.temperature, top_p=props.top_p,
                              seed=None if props.seed is None else props.seed % 2**64)
    options = typed.Options(props.model or default_model, sampling, props.max_tokens,
                            max_tokens_param="forwardedProps.max_tokens", cache_salt=props.cache_salt)
    tools = tuple(_tool(t, i) for i, t in enumerate(inp.tools or ()))
    return typed.ChatRequest(options, messages, tools=tools, thinking=props.thinking,
                             reasoning_effort=props.reasoning_effort, reasoning_budget=props.thinking_budget)


class AguiRenderer:
    """Parser events -> AG-UI events, opening and closing blocks in a legal order."""

    def __init__(self) -> None:
        self.open: str | None = None  # "text" | "reasoning"
        self.message_id = ""
        self.tool_ids: dict[int, str] = {}
        self.open_calls: set[int] = set()
        self.error: str | None = None

    def _close(self) -> list[BaseEvent]:
        out: list[BaseEvent] = []
        if self.open == "text":
            out.append(TextMessageEndEvent(message_id=self.message_id))
        elif self.open == "reasoning":
            out += [ReasoningMessageEndEvent(message_id=self.message_id), ReasoningEndEvent(message_id=self.message_id)]
        self.open = None
        return out

    def _ensure(self, kind: str) -> list[BaseEvent]:
        if self.open == kind:
            return []
        out = self._close()
        self.open, self.message_id = kind, new_id("msg", "_", 16)
        if kind == "text":
            out.append(TextMessageStartEvent(message_id=self.message_id, role="assistant"))
        else:
            out += [ReasoningStartEvent(message_id=self.message_id),
                    ReasoningMessageStartEvent(message_id=self.message_id)]
        return out

    def feed(self, events: list[ParserEvent]) -> list[BaseEvent]:
        out: list[BaseEvent] = []
        for ev in events:
            if isinstance(ev, ContentDelta) and ev.text:
                out += self._ensure("text") + [TextMessageContentEvent(message_id=self.message_id, delta=ev.text)]
            elif isinstance(ev, ReasoningDelta) and ev.text:
                content = ReasoningMessageContentEvent(message_id=self.message_id, delta=ev.text)
                out += self._ensure("reasoning") + [content]
            elif isinstance(ev, ToolCallStart):
                out += self._close()
                self.tool_ids[ev.index] = ev.id
                self.open_calls.add(ev.index)
                out.append(ToolCallStartEvent(tool_call_id=ev.id, tool_call_name=ev.name))
            elif isinstance(ev, ToolCallArgsDelta) and ev.text:
                out.append(ToolCallArgsEvent(tool_call_id=self.tool_ids[ev.index], delta=ev.text))
            elif isinstance(ev, ToolCallEnd):
                out += self._end_call(ev.index)
            elif isinstance(ev, ToolCallError):
                # A call found broken after its start still gets its end, so the
                # client's event order stays legal; the run then ends in RUN_ERROR.
                self.error = ev.message
                out += self._end_call(ev.index)
        return out

    def _end_call(self, index: int | None) -> list[BaseEvent]:
        if index is None or index not in self.open_calls:
            return []
        self.open_calls.discard(index)
        return [ToolCallEndEvent(tool_call_id=self.tool_ids[index])]

    def finish(self) -> list[BaseEvent]:
        out = self._close()
        for index in sorted(self.open_calls):
            out += self._end_call(index)
        return out


def encode(event: BaseEvent) -> Event:
    """One AG-UI event as SSE data, the way AG-UI's own ``EventEncoder`` writes it."""
    return Event(event.model_dump_json(by_alias=True, exclude_none=True))


async def agui_events(inp: RunAgentInput, renderer: AguiRenderer, steps: AsyncIterator[Step]) -> AsyncIterator[Event]:
    """The run's events, ending in RUN_FINISHED (or RUN_ERROR for a broken tool call)."""
    yield encode(RunStartedEvent(thread_id=inp.thread_id, run_id=inp.run_id, protocol_version=PROTOCOL_VERSION))
    async for step in steps:
        for ev in renderer.feed(step.events):
            yield encode(ev)
    for ev in renderer.finish():
        yield encode(ev)
    if renderer.error is not None:
        yield encode(RunErrorEvent(message=renderer.error, code="tool_call_parse_error"))
        return
    yield encode(RunFinishedEvent(thread_id=inp.thread_id, run_id=inp.run_id))


def run_error(request: Request, renderer: AguiRenderer, exc: Exception) -> list[Event]:
    """A failure after the start: what is open closes, so the event order stays legal, then RUN_ERROR."""
    err = as_app_error(request, exc)  # logs an unexpected error with its traceback
    return [*(encode(ev) for ev in renderer.finish()),
            encode(RunErrorEvent(message=err.message, code=err.code or err.openai_type))]


def _rendering(request: Request, inp: RunAgentInput) -> Rendering:
    renderer = AguiRenderer()
    # No whole answer: AG-UI streams. No keep-alive: AG-UI defines no such event.
    return Rendering(events=lambda steps: agui_events(inp, renderer, steps),
                     error=lambda exc: run_error(request, renderer, exc), keepalive=None)


@post("/v1/agui", status_code=200, summary="Run the model as an AG-UI agent (SSE of AG-UI events)")
async def agui(data: JSONBody[RunAgentInput], request: Request) -> EventStream:
    state: AppState = request.app.state.tandem
    prepare = state.pipeline.prepare_chat(to_chat_request(data, state.default_model))
    return await answer(request, state.pipeline, prepare, True, lambda _prepared: _rendering(request, data))
