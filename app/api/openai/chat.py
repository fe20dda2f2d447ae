"""POST /v1/chat/completions: OpenAI's chat format over the typed pipeline.

Streaming renders each ``Step``'s parser events as a chunk (reasoning in
``reasoning_content`` / ``reasoning``, tool calls as start + argument deltas);
non-streaming renders the folded ``Completion``: one code path, so the two
always agree.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from litestar import Request, post
from litestar.params import JSONBody

from app.api.errors import stream_error
from app.api.openai.protocol import ChatCompletionRequest
from app.api.state import AppState
from app.api.streaming import Rendering, answer, to_json
from app.api.wire import new_id
from app.pipeline.logprobs import LogprobInfo
from app.pipeline.pipeline import Prepared
from app.pipeline.results import (
    Completion,
    ContentDelta,
    Event,
    ReasoningDelta,
    Step,
    ToolCallArgsDelta,
    ToolCallError,
    ToolCallStart,
    Usage,
    total_usage,
)


def usage_dict(u: Usage) -> dict[str, Any]:
    """OpenAI's usage object."""
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": u.cache_write_tokens},
            "completion_tokens_details": {"reasoning_tokens": u.reasoning_tokens,
                                          "accepted_prediction_tokens": u.accepted_prediction_tokens,
                                          "rejected_prediction_tokens": u.rejected_prediction_tokens}}


def tool_call_dict(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """OpenAI's ``tool_calls[]`` item (a response's message; a conversation's turns use
    ``app.pipeline.request.ToolCall.as_dict``)."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def finish_reason(finish: str, tool_calls: int) -> str:
    """"tool_calls" when the model stopped after calling tools."""
    return "tool_calls" if tool_calls and finish == "stop" else finish


def logprob_entry(info: LogprobInfo) -> dict[str, Any]:
    """OpenAI's ``logprobs.content[]`` item."""
    c = info.chosen
    return {"token": c.token, "logprob": c.logprob, "bytes": list(c.bytes),
            "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in info.top]}


def logprobs_object(infos: list[LogprobInfo]) -> dict[str, Any]:
    return {"content": [logprob_entry(i) for i in infos], "refusal": None}


@dataclass
class ChunkWriter:
    """Builds the chunks of one streamed chat completion, every choice of it."""

    model: str
    reasoning_fields: tuple[str, ...] = ("reasoning_content", "reasoning")
    with_logprobs: bool = False
    id: str = field(default_factory=lambda: new_id("chatcmpl"))
    created: int = field(default_factory=lambda: int(time.time()))
    tool_calls: dict[int, int] = field(default_factory=dict)
    parse_errors: dict[int, str] = field(default_factory=dict)
    # Choices whose role has gone out (on their first delta).
    opened: set[int] = field(default_factory=set)
    # Logprobs of a choice's tokens held back before its role went out.
    held_logprobs: dict[int, list[LogprobInfo]] = field(default_factory=dict)
    # The content of a role chunk sent before the first token (the engine has queued the
    # request): OpenAI's "" where the answer cannot be a tool call; null where it may be one,
    # since a tool-call stream must not carry an empty content delta (llama.cpp does the same).
    early_content: str | None = ""
    # Every chunk's fields before ``choices``, as JSON (``content_json``).
    _head: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._head = to_json({"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                              "model": self.model, "system_fingerprint": "tandem"})[:-1]

    def plain_content(self, step: Step) -> str | None:
        """The step's text when all it writes is one content delta of a choice already open
        (nearly every token of an answer), else None."""
        if step.finish_reason is not None or len(step.events) != 1 or step.index not in self.opened:
            return None
        ev = step.events[0]
        if type(ev) is not ContentDelta or not ev.text or (self.with_logprobs and step.logprobs):
            return None
        return ev.text

    def content_json(self, text: str, index: int) -> str:
        """``to_json(self.chunk({"content": text}, index=index))``, written without the dicts:
        the per-token path of a streamed answer."""
        return (f'{self._head},"choices":[{{"index":{index},"delta":{{"content":{to_json(text)}}},'
                f'"logprobs":null,"finish_reason":null}}]}}')

    def chunk(self, delta: dict[str, Any], finish: str | None = None, index: int = 0,
              logprobs: list[LogprobInfo] | None = None, **extra: Any) -> dict[str, Any]:
        lp = logprobs_object(logprobs) if logprobs else None
        return {
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "system_fingerprint": "tandem",
            "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}],
            **extra,
        }

    def first(self, index: int = 0, content: str | None = "") -> dict[str, Any]:
        """A choice's opening chunk, the role alone: OpenAI's ``content: ""`` before text."""
        self.opened.add(index)
        return self.chunk({"role": "assistant", "content": content}, index=index)

    def _opening(self, index: int, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``deltas`` with the choice's role in front, if it has not gone out yet. As OpenAI's
        streams: an answer that begins with a tool call carries the role on that call's delta
        with ``content: null`` (llama.cpp's tests and some clients refuse an empty content
        delta there); any other answer opens with the role and ``content: ""`` on its own."""
        if index in self.opened or not deltas:
            return deltas
        if "tool_calls" in deltas[0]:
            self.opened.add(index)
            return [{"role": "assistant", "content": None, **deltas[0]}, *deltas[1:]]
        return [self.first(index)["choices"][0]["delta"], *deltas]

    def step(self, step: Step) -> list[dict[str, Any]]:
        """Chunks for one step's parser events; its logprobs ride on the first (on a chunk of
        their own when the step's text is still held back, or, before the choice's role has
        gone out, on its opening chunk). Empty deltas are never sent."""
        i = step.index
        if step.tokens == 0 and i not in self.opened:  # queued: the stream starts before the prefill
            return [self.first(i, self.early_content)]
        deltas = self._opening(i, [d for ev in step.events if (d := self._delta(ev, i))])
        chunks = [self.chunk(delta, index=i) for delta in deltas]
        logprobs = [*self.held_logprobs.pop(i, []), *step.logprobs] if self.with_logprobs else []
        if logprobs and chunks:
            chunks[0]["choices"][0]["logprobs"] = logprobs_object(logprobs)
        elif logprobs and i in self.opened:
            chunks.append(self.chunk({}, index=i, logprobs=logprobs))
        elif logprobs:
            self.held_logprobs[i] = logprobs
        return chunks

    def _delta(self, ev: Event, index: int) -> dict[str, Any] | None:
        if isinstance(ev, ContentDelta):
            return {"content": ev.text} if ev.text else None
        if isinstance(ev, ReasoningDelta):
            return {name: ev.text for name in self.reasoning_fields} if ev.text else None
        if isinstance(ev, ToolCallStart):
            self.tool_calls[index] = self.tool_calls.get(index, 0) + 1
            return {"tool_calls": [{"index": ev.index, **tool_call_dict(ev.id, ev.name, "")}]}
        if isinstance(ev, ToolCallArgsDelta):
            return {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]} if ev.text else None
        if isinstance(ev, ToolCallError):
            self.parse_errors[index] = ev.message
        return None  # ToolCallEnd has no OpenAI delta of its own

    def last(self, finish: str, index: int = 0) -> list[dict[str, Any]]:
        """A choice's finish chunk (after its role, for a choice that wrote nothing)."""
        if index in self.opened:
            return [self._finish(finish, index)]
        opening = self.first(index)
        if index in self.held_logprobs:
            opening["choices"][0]["logprobs"] = logprobs_object(self.held_logprobs.pop(index))
        return [opening, self._finish(finish, index)]

    def _finish(self, finish: str, index: int) -> dict[str, Any]:
        if index in self.parse_errors and finish != "length":  # cut by max_tokens: a "length" finish
            return self.chunk({}, "error", index, error={"message": self.parse_errors[index],
                                                         "type": "tool_call_parse_error"})
        return self.chunk({}, finish_reason(finish, self.tool_calls.get(index, 0)), index)

    def usage_chunk(self, u: Usage) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "system_fingerprint": "tandem", "choices": [], "usage": usage_dict(u)}


def _choice(done: Completion, reasoning_fields: tuple[str, ...], with_logprobs: bool) -> dict[str, Any]:
    parsed = done.parsed
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content or None}
    if parsed.reasoning:
        for name in reasoning_fields:
            message[name] = parsed.reasoning
    if parsed.tool_calls:
        message["tool_calls"] = [tool_call_dict(tc.id, tc.name, tc.arguments_json) for tc in parsed.tool_calls]
    elif message["content"] is None:
        message["content"] = ""
    return {"index": done.index, "message": message,
            "logprobs": logprobs_object(done.logprobs) if with_logprobs else None,
            "finish_reason": finish_reason(done.finish_reason, len(parsed.tool_calls))}


def chat_response(model: str, choices: list[Completion], reasoning_fields: tuple[str, ...],
                  extensions: dict[str, Any] | None, with_logprobs: bool = False) -> dict[str, Any]:
    """The non-streaming chat completion, every choice of it; ``extensions`` (None: not
    asked for) with the first choice's reasoning and tool-call chunks and any parse errors."""
    body = {
        "id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()), "model": model,
        "system_fingerprint": "tandem",
        "choices": [_choice(c, reasoning_fields, with_logprobs) for c in choices],
        "usage": usage_dict(total_usage([c.usage for c in choices])),
    }
    if extensions is not None:
        parsed = choices[0].parsed
        extensions = {**extensions, "reasoning_chunks": parsed.reasoning_chunks,
                      "tool_call_chunks": parsed.tool_call_chunks}
        errors = [e for c in choices for e in c.parsed.errors]
        if errors:
            extensions["errors"] = [{"message": e, "type": "tool_call_parse_error"} for e in errors]
        body["extensions"] = extensions
    return body


async def chat_stream(writer: ChunkWriter, steps: AsyncIterator[Step], extras: dict[str, Any] | None,
                      include_usage: bool) -> AsyncIterator[str]:
    """The chunks of a streamed chat completion, then ``[DONE]``. Each choice's role goes
    out with its first delta (``ChunkWriter._opening``); ``extras`` ride on the first chunk."""
    usages: list[Usage] = []
    pending = extras
    async for step in steps:
        text = None if pending else writer.plain_content(step)
        if text is not None:
            yield writer.content_json(text, step.index)
            continue
        chunks = writer.step(step)
        if step.finish_reason is not None:
            chunks += writer.last(step.finish_reason, step.index)
            if step.usage is not None:
                usages.append(step.usage)
        for chunk in chunks:
            if pending:
                chunk["extensions"], pending = pending, {}
            yield to_json(chunk)
    if include_usage and usages:
        yield to_json(writer.usage_chunk(total_usage(usages)))
    yield "[DONE]"


def openai_stream_error(exc: Exception) -> list[str]:
    """A chat or text completion stream's tail after a failure: one OpenAI error event, no ``[DONE]``."""
    return [to_json(stream_error(exc))]


def _rendering(data: ChatCompletionRequest, state: AppState, prepared: Prepared) -> Rendering:
    # Tandem's non-standard ``extensions`` object (captions, warnings, the prompt, the parser's
    # chunks) only for a request that asks (``extensions: true``): clients that compare
    # OpenAI's shapes byte for byte see none. Warnings also travel as a response header.
    extras = prepared.extras if data.extensions else None
    with_logprobs = bool(data.logprobs)
    include_usage = bool(data.stream_options and data.stream_options.include_usage)
    writer = ChunkWriter(data.model, state.reasoning_fields, with_logprobs,
                         early_content=None if data.tools and data.tool_choice != "none" else "")
    return Rendering(
        events=lambda steps: chat_stream(writer, steps, extras, include_usage),
        error=openai_stream_error,
        whole=lambda steps: chat_response(data.model, Completion.fold_choices(steps), state.reasoning_fields,
                                          extras, with_logprobs))


@post("/v1/chat/completions", status_code=200, summary="Create a chat completion")
async def chat_completions(data: JSONBody[ChatCompletionRequest], request: Request[Any, Any, Any]) -> Any:
    state: AppState = request.app.state.tandem
    return await answer(request, state.pipeline, state.pipeline.prepare_chat(data.to_request()), data.stream,
                        lambda prepared: _rendering(data, state, prepared))
