"""POST /v1/completions: OpenAI's text completion format over the typed pipeline."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, post
from litestar.params import JSONBody

from app.api.errors import stream_error
from app.api.openai.chat import new_id, usage_dict
from app.api.openai.protocol import CompletionRequest
from app.api.state import AppState
from app.api.streaming import EventStream, started, to_json, unless_disconnected
from app.pipeline.results import Step, Usage


def completion_body(cid: str, model: str, text: str, finish: str | None, usage: Usage | None) -> dict[str, Any]:
    """A text completion, or one chunk of a streamed one."""
    body: dict[str, Any] = {
        "id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
    }
    if usage is not None:
        body["usage"] = usage_dict(usage)
    return body


async def completion_stream(req: CompletionRequest, steps: AsyncIterator[Step]) -> AsyncIterator[str]:
    """Chunks of a streamed text completion, then ``[DONE]``."""
    cid = new_id("cmpl")
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    try:
        if req.echo:
            yield to_json(completion_body(cid, req.model, str(req.prompt), None, None))
        async for step in steps:
            if step.text or step.finish_reason:
                yield to_json(completion_body(cid, req.model, step.text, step.finish_reason, None))
            if step.usage is not None and include_usage:
                yield to_json({**completion_body(cid, req.model, "", None, step.usage), "choices": []})
    except Exception as exc:  # noqa: BLE001 - once streaming, errors travel as one event
        yield to_json(stream_error(exc))
        return
    yield "[DONE]"


@post("/v1/completions", status_code=200, summary="Create a text completion")
async def completions(data: JSONBody[CompletionRequest], request: Request) -> Any:
    state: AppState = request.app.state.tandem
    prepared = await state.pipeline.prepare_text(data.to_request())
    if data.stream:
        steps = await unless_disconnected(request, started(state.pipeline.steps(prepared)))
        return EventStream(completion_stream(data, steps))
    done = await unless_disconnected(request, state.pipeline.complete(prepared))
    text = (str(data.prompt) if data.echo else "") + done.text
    return completion_body(new_id("cmpl"), data.model, text, done.finish_reason, done.usage)
