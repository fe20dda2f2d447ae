"""POST /v1/completions: OpenAI's text completion format over the typed pipeline."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from litestar import Request, post
from litestar.params import JSONBody

from app.api.openai.chat import openai_stream_error, usage_dict
from app.api.openai.protocol import CompletionRequest
from app.api.state import AppState
from app.api.streaming import Rendering, answer, to_json
from app.api.wire import new_id
from app.pipeline.logprobs import LogprobInfo
from app.pipeline.results import Completion, Step, Usage, total_usage


def legacy_logprobs(infos: list[LogprobInfo], offset: int) -> dict[str, Any]:
    """The completions API's logprobs: parallel lists, and the text offset of each token."""
    offsets = []
    for info in infos:
        offsets.append(offset)
        offset += len(info.chosen.token)
    return {"tokens": [i.chosen.token for i in infos], "token_logprobs": [i.chosen.logprob for i in infos],
            "top_logprobs": [{t.token: t.logprob for t in i.top} for i in infos], "text_offset": offsets}


def completion_body(cid: str, model: str, choices: list[dict[str, Any]], usage: Usage | None) -> dict[str, Any]:
    """A text completion, or one chunk of a streamed one."""
    body: dict[str, Any] = {"id": cid, "object": "text_completion", "created": int(time.time()), "model": model,
                            "choices": choices}
    if usage is not None:
        body["usage"] = usage_dict(usage)
    return body


def choice(index: int, text: str, finish: str | None, logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


async def completion_stream(req: CompletionRequest, steps: AsyncIterator[Step]) -> AsyncIterator[str]:
    """Chunks of a streamed text completion, then ``[DONE]``."""
    cid = new_id("cmpl")
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    prompt = str(req.prompt) if req.echo else ""
    offsets = dict.fromkeys(range(req.n), len(prompt))
    usages: list[Usage] = []
    if req.echo:
        for index in range(req.n):
            yield to_json(completion_body(cid, req.model, [choice(index, prompt, None)], None))
    async for step in steps:
        lp = None
        if req.logprobs is not None and step.logprobs:
            lp = legacy_logprobs(step.logprobs, offsets[step.index])
            offsets[step.index] += sum(len(i.chosen.token) for i in step.logprobs)
        if step.text or step.finish_reason or lp:
            yield to_json(completion_body(cid, req.model, [choice(step.index, step.text, step.finish_reason, lp)],
                                          None))
        if step.usage is not None:
            usages.append(step.usage)
    if include_usage and usages:
        yield to_json(completion_body(cid, req.model, [], total_usage(usages)))
    yield "[DONE]"


def completion_response(req: CompletionRequest, steps: list[Step]) -> dict[str, Any]:
    """The non-streaming text completion, every choice of it."""
    done = Completion.fold_choices(steps)
    prompt = str(req.prompt) if req.echo else ""
    choices = [choice(c.index, prompt + c.text, c.finish_reason,
                      legacy_logprobs(c.logprobs, len(prompt)) if req.logprobs is not None else None) for c in done]
    return completion_body(new_id("cmpl"), req.model, choices, total_usage([c.usage for c in done]))


@post("/v1/completions", status_code=200, summary="Create a text completion")
async def completions(data: JSONBody[CompletionRequest], request: Request[Any, Any, Any]) -> Any:
    state: AppState = request.app.state.tandem
    rendering = Rendering(events=lambda steps: completion_stream(data, steps), error=openai_stream_error,
                          whole=lambda steps: completion_response(data, steps))
    return await answer(request, state.pipeline, state.pipeline.prepare_text(data.to_request()), data.stream,
                        lambda _prepared: rendering)
