"""POST /v1/chat/completions and POST /v1/completions."""

from __future__ import annotations

import functools
import logging
from contextlib import aclosing
import time
from dataclasses import replace
from typing import Any, AsyncIterator, Awaitable, TypeVar

import anyio
from litestar import Controller, Request, Response, post
from litestar.params import JSONBody
from litestar.response import ServerSentEvent

from app.api.prompting import PreparedChat, message_dict, prepare_chat, prepare_completion
from app.api.render import ChunkWriter, chat_response, new_id, sse, usage
from app.api.request_id import REQUEST_ID
from app.api.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest
from app.api.state import AppState
from app.engine.types import GenerationRequest, TokenDelta
from app.errors import AppError, ContextLengthError, InvalidRequestError, ModelNotFoundError
from app.parsers import make_parser
from app.vision.proxy import has_images, reject_images

log = logging.getLogger("tandem.api")
T = TypeVar("T")


def check_model(state: AppState, name: str) -> None:
    if name not in (state.profile.name, state.config.primary.hf_id):
        raise ModelNotFoundError(f"model {name!r} does not exist; this server serves {state.profile.name!r}", param="model")


@functools.lru_cache(maxsize=4)
def _longest_token_chars(tokenizer: Any) -> int:
    return max(map(len, tokenizer.get_vocab()))


def check_prompt_chars(state: AppState, chars: int, param: str) -> None:
    """Refuse, before tokenizing, a prompt that cannot fit the context whatever its tokens.

    A token spans at most the longest vocabulary entry in characters, so a prompt
    of more than max_model_len times that cannot fit (doubled, for normalizers
    that merge characters). Tokenizing megabytes takes seconds of CPU; this takes none.
    """
    limit = 2 * state.profile.max_model_len * _longest_token_chars(state.profile.tokenizer)
    if chars > limit:
        raise ContextLengthError(
            f"this model's maximum context length is {state.profile.max_model_len} tokens; "
            f"a prompt of {chars} characters cannot fit (at most {limit} are accepted)",
            param=param,
        )


def _vocab_size(state: AppState) -> int | None:
    config = state.engine.loaded.config
    return config.get("vocab_size") or config.get("text_config", {}).get("vocab_size")


def engine_stream(state: AppState, gen: GenerationRequest) -> AsyncIterator[TokenDelta]:
    """The engine's deltas for ``gen``, tagged with the request id and timed for /metrics."""
    vocab = _vocab_size(state)
    if vocab and gen.sampling.top_k >= vocab:
        # Keeping every token is no top-k at all; mlx-lm would raise mid-batch, failing its neighbours.
        gen = replace(gen, sampling=replace(gen.sampling, top_k=0))
    return state.metrics.observe(state.engine.stream(replace(gen, request_id=REQUEST_ID.get())))


class EventStream(ServerSentEvent):
    """An SSE response that keeps ``text/event-stream``: Litestar would let the handler's
    media type (JSON, for the non-streaming answer) override it."""

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        return super().to_asgi_response(*args, **{**kwargs, "media_type": None})


async def started(items: AsyncIterator[T]) -> AsyncIterator[T]:
    """``items`` once its first item is in, so that a refusal before the first token (queue
    full 429, queue timeout 503, over the KV budget 400) is an HTTP error, not a 200 stream."""
    first = await items.__anext__()

    async def chained() -> AsyncIterator[T]:
        try:
            yield first
            async for item in items:
                yield item
        finally:
            await items.aclose()  # a vanished client cancels the generation

    return chained()


async def _vision_messages(state: AppState, req: ChatCompletionRequest) -> tuple[list[dict] | None, dict]:
    """Proxy-mode rewrite of image parts into captions; None when there are no images."""
    raw = [m.model_dump(exclude_none=True) for m in req.messages]
    if not has_images(raw):
        return None, {}
    if state.vision.mode != "proxy":
        reject_images(raw, state.profile.name)
    result = await state.vision.proxy.rewrite(raw)
    ext = {"captions": [c.as_dict() for c in result.captions], "warnings": list(result.warnings)}
    return [message_dict(ChatMessage.model_validate(d)) for d in result.messages], ext


async def prepare(state: AppState, req: ChatCompletionRequest) -> tuple[PreparedChat, dict]:
    """Validate, caption images, render the template and tokenize (off the event loop)."""
    check_model(state, req.model)
    if len(req.messages) > state.config.server.max_messages:
        raise InvalidRequestError(f"at most {state.config.server.max_messages} messages", param="messages")
    check_prompt_chars(state, sum(len(m.text()) for m in req.messages), "messages")
    messages, ext = await _vision_messages(state, req)
    prepared = await anyio.to_thread.run_sync(prepare_chat, state.profile, req, messages)
    if req.extensions:
        ext["prompt"] = prepared.prompt_text
    return prepared, ext


async def generate_events(state: AppState, prepared: PreparedChat) -> AsyncIterator[tuple[list, TokenDelta]]:
    """Engine deltas run through the request's stream parser: (events, delta) pairs."""
    parser = make_parser(prepared.parser, reasoning=prepared.reasoning,
                         starts_in_reasoning=prepared.starts_in_reasoning, tools_offered=prepared.tools_offered)
    async for delta in engine_stream(state, prepared.gen):
        events = parser.feed(delta.text) if delta.text else []
        if delta.finish_reason is not None:
            events += parser.finish()
        yield events, delta


async def _generate_text(state: AppState, gen: GenerationRequest) -> tuple[str, TokenDelta]:
    parts, last = [], None
    async with aclosing(engine_stream(state, gen)) as deltas:
        async for delta in deltas:
            parts.append(delta.text)
            last = delta
    assert last is not None
    return "".join(parts), last


async def _collect_events(state: AppState, prepared: PreparedChat) -> tuple[list, TokenDelta]:
    events, last = [], None
    async with aclosing(generate_events(state, prepared)) as pairs:
        async for evs, last in pairs:
            events += evs
    assert last is not None
    return events, last


class ClientGone(Exception):
    """The client hung up before its (non-streaming) answer was ready."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first: a non-streaming
    request whose client gave up (an Open WebUI task, a timed-out SDK call) stops
    generating and frees its KV instead of running to max_tokens."""
    result: list[T] = []

    async def watch() -> None:
        # The body is already read: the next ASGI message is the disconnect, if any.
        while (await request.receive())["type"] != "http.disconnect":
            pass
        tg.cancel_scope.cancel()

    async def run() -> None:
        try:
            result.append(await work)
        except Exception as exc:  # noqa: BLE001 - re-raised below, not as an ExceptionGroup
            failed.append(exc)
        tg.cancel_scope.cancel()

    failed: list[Exception] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        tg.start_soon(run)
    if failed:
        raise failed[0]
    if not result:
        raise ClientGone
    return result[0]


class ChatController(Controller):
    path = "/v1"

    @post("/chat/completions", status_code=200, summary="Create a chat completion")
    async def chat_completions(self, data: JSONBody[ChatCompletionRequest], request: Request) -> Any:
        state: AppState = request.app.state.tandem
        prepared, ext = await prepare(state, data)
        if data.stream:
            try:
                pairs = await unless_disconnected(request, started(generate_events(state, prepared)))
            except ClientGone:  # hung up while queued or in prefill
                return Response(b"", status_code=499)
            return EventStream(_chat_stream(state, data, pairs, ext))
        try:
            events, last = await unless_disconnected(request, _collect_events(state, prepared))
        except ClientGone:
            return Response(b"", status_code=499)  # nobody is listening; nginx's "client closed request"
        u = usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens)
        return chat_response(data.model, events, last.finish_reason or "stop", u, state.reasoning_fields, ext)

    @post("/completions", status_code=200, summary="Create a text completion")
    async def completions(self, data: JSONBody[CompletionRequest], request: Request) -> Any:
        state: AppState = request.app.state.tandem
        check_model(state, data.model)
        check_prompt_chars(state, len(data.prompt), "prompt")
        gen = await anyio.to_thread.run_sync(prepare_completion, state.profile, data)
        if data.stream:
            try:
                deltas = await unless_disconnected(request, started(engine_stream(state, gen)))
            except ClientGone:
                return Response(b"", status_code=499)
            return EventStream(_completion_stream(data, deltas))
        try:
            text, last = await unless_disconnected(request, _generate_text(state, gen))
        except ClientGone:
            return Response(b"", status_code=499)
        return _completion_body(new_id("cmpl"), data.model, (data.prompt if data.echo else "") + text,
                                last.finish_reason, usage(last.prompt_tokens, last.completion_tokens, last.cached_tokens))


def _completion_body(cid: str, model: str, text: str, finish: str | None, u: dict | None) -> dict:
    body = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    if u is not None:
        body["usage"] = u
    return body


def _error_event(exc: Exception) -> str:
    err = exc if isinstance(exc, AppError) else AppError("internal error during generation")
    if not isinstance(exc, AppError):
        log.exception("stream failed", exc_info=exc)
    return sse(err.to_dict())


async def _chat_stream(
    state: AppState, req: ChatCompletionRequest, generated: AsyncIterator[tuple[list, TokenDelta]], ext: dict
) -> AsyncIterator[str]:
    writer = ChunkWriter(req.model, state.reasoning_fields)
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    first = writer.first()
    if ext.get("warnings") or ext.get("captions") or req.extensions:
        first["extensions"] = ext
    yield sse(first)
    try:
        async for events, delta in generated:
            for chunk in writer.events(events):
                yield sse(chunk)
            if delta.finish_reason is not None:
                yield sse(writer.last(delta.finish_reason))
                if include_usage:
                    yield sse(writer.usage_chunk(usage(delta.prompt_tokens, delta.completion_tokens, delta.cached_tokens)))
    except Exception as exc:  # noqa: BLE001 - once streaming, errors travel as one event
        yield _error_event(exc)
        return
    yield "[DONE]"


async def _completion_stream(req: CompletionRequest, deltas: AsyncIterator[TokenDelta]) -> AsyncIterator[str]:
    cid = new_id("cmpl")
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    try:
        if req.echo:
            yield sse(_completion_body(cid, req.model, req.prompt, None, None))
        async for delta in deltas:
            if delta.text or delta.finish_reason:
                yield sse(_completion_body(cid, req.model, delta.text, delta.finish_reason, None))
            if delta.finish_reason is not None and include_usage:
                body = _completion_body(cid, req.model, "", None, usage(delta.prompt_tokens, delta.completion_tokens, delta.cached_tokens))
                body["choices"] = []
                yield sse(body)
    except Exception as exc:  # noqa: BLE001
        yield _error_event(exc)
        return
    yield "[DONE]"
