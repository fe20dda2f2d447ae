"""POST /v1/responses, GET and DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items:
OpenAI's Responses API over the typed pipeline.

The parser's events become output items, one open at a time, each streamed as

    response.created, response.in_progress
    reasoning:      output_item.added, content_part.added, reasoning_text.delta*, reasoning_text.done,
                    content_part.done, output_item.done
    message:        output_item.added, content_part.added, output_text.delta*, output_text.done,
                    content_part.done, output_item.done
    function_call:  output_item.added, function_call_arguments.delta*, function_call_arguments.done,
                    output_item.done
    response.completed | response.incomplete (max_output_tokens)     or one ``error`` event

with ``sequence_number`` counting from 0. Non-streaming runs the very same
``ResponseWriter`` over the same steps and returns its final response, so the
two cannot disagree. A tool call the parser cannot read is closed ``incomplete``
and left out of the output (its raw text follows as message text).
With ``include: ["message.output_text.logprobs"]`` a message's text carries its
tokens' logprobs (chat's, in OpenAI's output_text shape), on each delta and on the
part. ``response_store`` keeps stored responses for ``previous_response_id``, GET
and the input items list (OpenAI's cursor page: ``input_items_page``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from litestar import Request, delete, get, post
from litestar.params import FromPath, FromQuery, JSONBody, QueryParameter

from app.api.errors import as_app_error
from app.api.openai.chat import logprob_entry
from app.api.openai.response_store import ResponseStore
from app.api.openai.responses_protocol import ResponsesRequest, encode_reasoning
from app.api.state import AppState
from app.api.streaming import Event, Rendering, answer, to_json
from app.api.wire import new_id
from app.errors import AppError, InvalidRequestError
from app.pipeline.logprobs import LogprobInfo
from app.pipeline.pipeline import Prepared
from app.pipeline.results import (
    ContentDelta,
    ReasoningDelta,
    Step,
    ToolCallArgsDelta,
    ToolCallEnd,
    ToolCallError,
    ToolCallStart,
    Usage,
)


def usage_dict(u: Usage) -> dict[str, Any]:
    """The Responses API's usage object."""
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": u.cache_write_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
            "total_tokens": u.total_tokens}


def response_skeleton(data: ResponsesRequest, prepared: Prepared, extras: dict[str, Any] | None) -> dict[str, Any]:
    """The response object before any output, with every field of the Open Responses spec's
    ``ResponseResource``: what the request asked for, echoed, with the sampling values
    actually used (the model's defaults where the request gave none), and Tandem's
    ``extensions`` (captions, warnings, the prompt) when the request asks for them."""
    sampling = prepared.gen.sampling
    body: dict[str, Any] = {
        "id": new_id("resp", "_"), "object": "response", "created_at": int(time.time()), "completed_at": None,
        "status": "in_progress", "error": None, "incomplete_details": None, "instructions": data.instructions,
        "max_output_tokens": data.max_output_tokens, "max_tool_calls": data.max_tool_calls, "model": data.model,
        "output": [], "parallel_tool_calls": data.parallel_tool_calls is not False,
        "previous_response_id": data.previous_response_id,
        "reasoning": data.reasoning.model_dump(exclude_none=True) if data.reasoning else None,
        "store": data.stores, "background": False, "service_tier": "default",
        "temperature": sampling.temperature, "top_p": sampling.top_p,
        "presence_penalty": sampling.presence_penalty, "frequency_penalty": sampling.frequency_penalty,
        # Alternatives returned per token: none unless the output text's logprobs are included.
        "top_logprobs": prepared.gen.logprobs or 0,
        "text": data.text.model_dump(by_alias=True, exclude_none=True) if data.text and data.text.format
        else {"format": {"type": "text"}},
        "tool_choice": data.tool_choice if data.tool_choice is not None else "auto",
        "tools": data.echoed_tools(), "truncation": "disabled", "usage": None, "metadata": data.metadata or {},
        "safety_identifier": data.safety_identifier, "prompt_cache_key": data.prompt_cache_key, "user": data.user,
    }
    if extras is not None:
        body["extensions"] = extras
    return body


def delta_logprob(info: LogprobInfo) -> dict[str, Any]:
    """A token's logprob as the text events carry it (the output_text part's, less the bytes)."""
    return {"token": info.chosen.token, "logprob": info.chosen.logprob,
            "top_logprobs": [{"token": t.token, "logprob": t.logprob} for t in info.top]}


@dataclass
class _Open:
    """The output item being written."""

    kind: str  # "message" | "reasoning" | "function_call"
    index: int
    item: dict[str, Any]
    text: list[str] = field(default_factory=list)
    # A message's output tokens, when the request included their logprobs.
    logprobs: list[LogprobInfo] = field(default_factory=list)


@dataclass
class ResponseWriter:
    """Parser events -> the Responses API's stream events, and the final response object."""

    response: dict[str, Any]
    # The model's name of each namespaced function -> (namespace, name).
    namespaces: dict[str, tuple[str, str]] = field(default_factory=dict)
    encrypt_reasoning: bool = False
    with_logprobs: bool = False
    output: list[dict[str, Any]] = field(default_factory=list)
    seq: int = 0
    next_index: int = 0
    open: _Open | None = None
    # Logprobs of tokens whose text the parser still holds back.
    held_logprobs: list[LogprobInfo] = field(default_factory=list)

    def _event(self, kind: str, **fields: Any) -> Event:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return Event(to_json(payload), kind)

    def start(self) -> list[Event]:
        return [self._event("response.created", response=self.response),
                self._event("response.in_progress", response=self.response)]

    def feed(self, step: Step) -> list[Event]:
        """The stream events of one pipeline step; the last one also ends the response."""
        out = self.step(step)
        if step.finish_reason is not None and step.usage is not None:
            out += self.finish(step.finish_reason, step.usage)
        return out

    def step(self, step: Step) -> list[Event]:
        """The item events of one pipeline step."""
        out: list[Event] = []
        logprobs = self._text_logprobs(step)
        for ev in step.events:
            if isinstance(ev, ReasoningDelta) and ev.text:
                out += self._ensure("reasoning")
                out.append(self._delta("response.reasoning_text.delta", ev.text))
            elif isinstance(ev, ContentDelta) and ev.text:
                out += self._ensure("message")
                assert self.open is not None
                self.open.logprobs += logprobs
                out.append(self._delta("response.output_text.delta", ev.text,
                                       logprobs=[delta_logprob(i) for i in logprobs]))
                logprobs = []
            elif isinstance(ev, ToolCallStart):
                out += self._close("completed")
                out += self._open_call(ev)
            elif isinstance(ev, ToolCallArgsDelta) and ev.text and self._is_call():
                out.append(self._delta("response.function_call_arguments.delta", ev.text))
            elif isinstance(ev, ToolCallEnd) and self._is_call():
                out += self._close("completed")
            elif isinstance(ev, ToolCallError) and ev.index is not None and self._is_call():
                out += self._close("incomplete", keep=False)
        return out

    def finish(self, finish_reason: str, usage: Usage) -> list[Event]:
        """Close what is open and end the response: completed, or incomplete at the token limit."""
        truncated = finish_reason == "length"
        out = self._close("incomplete" if truncated else "completed")
        self.response.update(status="incomplete" if truncated else "completed", output=self.output,
                             usage=usage_dict(usage), completed_at=int(time.time()),
                             incomplete_details={"reason": "max_output_tokens"} if truncated else None)
        kind = "response.incomplete" if truncated else "response.completed"
        return [*out, self._event(kind, response=self.response)]

    def error(self, err: AppError) -> Event:
        """The one event that ends a stream that failed after it started: OpenAI's fields at
        the top (its SDKs read them there), the Open Responses spec's in ``error``."""
        code = err.code or err.openai_type
        return self._event("error", code=code, message=err.message, param=err.param,
                           error={"type": err.openai_type, "code": code, "message": err.message, "param": err.param})

    def _text_logprobs(self, step: Step) -> list[LogprobInfo]:
        """The logprobs that go with this step's output text: its tokens' and those of the
        tokens held back before it. A step that writes reasoning or a tool call takes its
        held tokens with it (markers, arguments: not the message's text)."""
        if not self.with_logprobs:
            return []
        self.held_logprobs += step.logprobs
        if not step.events:
            return []
        mine, self.held_logprobs = self.held_logprobs, []
        return mine if any(isinstance(ev, ContentDelta) and ev.text for ev in step.events) else []

    # ---- items ----------------------------------------------------------------------

    def _is_call(self) -> bool:
        return self.open is not None and self.open.kind == "function_call"

    def _delta(self, kind: str, text: str, **extra: Any) -> Event:
        assert self.open is not None
        self.open.text.append(text)
        where: dict[str, Any] = {"item_id": self.open.item["id"], "output_index": self.open.index}
        if self.open.kind != "function_call":
            where["content_index"] = 0
        return self._event(kind, **where, delta=text, **extra)

    def _added(self, kind: str, item: dict[str, Any]) -> list[Event]:
        self.open = _Open(kind, self.next_index, item)
        self.next_index += 1
        return [self._event("response.output_item.added", output_index=self.open.index, item=item)]

    def _ensure(self, kind: str) -> list[Event]:
        if self.open is not None and self.open.kind == kind:
            return []
        out = self._close("completed")
        if kind == "message":
            item = {"id": new_id("msg", "_"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": new_id("rs", "_"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        out += self._added(kind, item)
        out.append(self._event("response.content_part.added", item_id=item["id"], output_index=self.next_index - 1,
                               content_index=0, part=part))
        return out

    def _open_call(self, ev: ToolCallStart) -> list[Event]:
        namespace, name = self.namespaces.get(ev.name, (None, ev.name))
        item: dict[str, Any] = {"id": new_id("fc", "_"), "type": "function_call", "call_id": ev.id, "name": name,
                                "arguments": "", "status": "in_progress"}
        if namespace is not None:
            item["namespace"] = namespace
        return self._added("function_call", item)

    def _close(self, status: str, keep: bool = True) -> list[Event]:
        """Finish the open item; ``keep`` False leaves it out of the output (a broken call)."""
        if self.open is None:
            return []
        o, self.open = self.open, None
        text = "".join(o.text)
        where = {"item_id": o.item["id"], "output_index": o.index}
        out: list[Event] = []
        item = {**o.item, "status": status}
        if o.kind == "function_call":
            item["arguments"] = text
            if keep:
                out.append(self._event("response.function_call_arguments.done", **where, name=item["name"],
                                       arguments=text))
        else:
            if o.kind == "message":
                part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": [],
                                        "logprobs": [logprob_entry(i) for i in o.logprobs]}
                out.append(self._event("response.output_text.done", **where, content_index=0, text=text,
                                       logprobs=[delta_logprob(i) for i in o.logprobs]))
            else:
                part = {"type": "reasoning_text", "text": text}
                out.append(self._event("response.reasoning_text.done", **where, content_index=0, text=text))
                if self.encrypt_reasoning:
                    item["encrypted_content"] = encode_reasoning(text)
            out.append(self._event("response.content_part.done", **where, content_index=0, part=part))
            item["content"] = [part]
        out.append(self._event("response.output_item.done", output_index=o.index, item=item))
        if keep:
            self.output.append(item)
        return out


# ---- routes -------------------------------------------------------------------------------


async def response_events(writer: ResponseWriter, steps: AsyncIterator[Step],
                          on_done: Callable[[ResponseWriter], None]) -> AsyncIterator[Event]:
    """The streamed response."""
    for ev in writer.start():
        yield ev
    async for step in steps:
        for ev in writer.feed(step):
            yield ev
    on_done(writer)


def _rendering(request: Request, data: ResponsesRequest, history: list[dict[str, Any]],
               prepared: Prepared) -> Rendering:
    store: ResponseStore = request.app.state.tandem.responses
    writer = ResponseWriter(response_skeleton(data, prepared, prepared.extras if data.extensions else None),
                            data.namespaces(), data.encrypted_reasoning, data.with_logprobs)
    conversation = [*history, *(i.model_dump(by_alias=True, exclude_none=True) for i in data.input)]

    def keep(w: ResponseWriter) -> None:
        if data.stores:
            store.put(w.response, [*conversation, *w.output], inputs=len(conversation))

    def whole(steps: list[Step]) -> dict[str, Any]:
        for step in steps:
            writer.feed(step)  # the same events as a stream, only the final response kept
        keep(writer)
        return writer.response

    # A failure after the start ends the stream with one ``error`` event (as_app_error logs
    # an unexpected one with its traceback).
    return Rendering(events=lambda steps: response_events(writer, steps, keep),
                     error=lambda exc: [writer.error(as_app_error(request, exc))], whole=whole)


@post("/v1/responses", status_code=200, summary="Create a model response (OpenAI's Responses API)")
async def create_response(data: JSONBody[ResponsesRequest], request: Request) -> Any:
    state: AppState = request.app.state.tandem
    history = (state.responses.get(data.previous_response_id, "previous_response_id").items
               if data.previous_response_id else [])
    return await answer(request, state.pipeline, state.pipeline.prepare_chat(data.to_request(history)), data.stream,
                        lambda prepared: _rendering(request, data, history, prepared))


@get("/v1/responses/{response_id:str}", summary="Retrieve a stored response")
async def get_response(response_id: FromPath[str], request: Request) -> dict[str, Any]:
    return request.app.state.tandem.responses.get(response_id).response


@get("/v1/responses/{response_id:str}/input_items", summary="List a stored response's input items")
async def list_input_items(response_id: FromPath[str], request: Request, after: FromQuery[str | None] = None,
                           before: FromQuery[str | None] = None,
                           limit: Annotated[int, QueryParameter(ge=1, le=100)] = 20,
                           order: FromQuery[Literal["asc", "desc"]] = "desc") -> dict[str, Any]:
    items = request.app.state.tandem.responses.get(response_id).input_items
    return input_items_page(items, after, before, limit, order)


def input_items_page(items: list[dict[str, Any]], after: str | None, before: str | None, limit: int,
                     order: str) -> dict[str, Any]:
    """OpenAI's cursor page of ``items``: in ``order`` (``desc``: the latest first), those
    after the item ``after`` and before the item ``before``, ``limit`` of them."""
    ordered = items[::-1] if order == "desc" else items
    ids = [item["id"] for item in ordered]
    start, end = 0, len(ordered)
    for name, cursor in (("after", after), ("before", before)):
        if cursor is None:
            continue
        if cursor not in ids:
            raise InvalidRequestError(f"{name}: no input item {cursor!r} in this response", param=name)
        if name == "after":
            start = ids.index(cursor) + 1
        else:
            end = ids.index(cursor)
    page = ordered[start:max(start, end)][:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + len(page) < end}


@delete("/v1/responses/{response_id:str}", status_code=200, summary="Delete a stored response")
async def delete_response(response_id: FromPath[str], request: Request) -> dict[str, Any]:
    request.app.state.tandem.responses.delete(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}
