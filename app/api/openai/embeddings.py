"""POST /v1/embeddings: OpenAI's embeddings format over the pipeline's encoders.

An input longer than the model takes is cut to its first tokens when the model's
models.yaml ``truncate`` is on (the default) or the request sends ``"truncate": true``,
and refused with a 400 ``context_length_exceeded`` otherwise. What was cut is counted in
``usage.truncated_inputs`` / ``usage.truncated_tokens`` (only when something was) and in
``/metrics`` (``tandem_encoder_truncated_*``).
"""

from __future__ import annotations

import base64
from typing import Any

from litestar import Request, post
from litestar.params import JSONBody
from pydantic import BaseModel, ConfigDict, Field

from app.api.state import AppState
from app.api.streaming import unless_disconnected
from app.api.wire import JsonBool
from app.pipeline.request import EmbedRequest


class EmbeddingRequest(BaseModel):
    """OpenAI's request; ``input`` is read item by item into the typed request (``EmbedRequest.of``:
    400s name the item)."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    # A string, a list of strings, a list of token ids, or a list of those lists.
    input: Any
    encoding_format: str = Field(default="float", pattern="^(float|base64)$")
    dimensions: int | None = Field(default=None, ge=1)
    # Hugging Face TEI's: cut inputs longer than the model takes (true) or refuse them with a
    # 400 (false); absent: the model's models.yaml ``truncate`` (on unless the entry says).
    truncate: JsonBool | None = None


@post("/v1/embeddings", status_code=200, summary="Create embeddings")
async def embeddings(data: JSONBody[EmbeddingRequest], request: Request[Any, Any, Any]) -> dict[str, Any]:
    state: AppState = request.app.state.tandem
    req = EmbedRequest.of(data.model, data.input, truncate=data.truncate, dimensions=data.dimensions)
    work = state.pipeline.embed(req)
    result, _ = await unless_disconnected(request, work)
    if data.encoding_format == "base64":  # little-endian float32, as OpenAI's SDK decodes it
        vectors: list[Any] = [base64.b64encode(v.astype("<f4").tobytes()).decode() for v in result.vectors]
    else:
        vectors = result.vectors.tolist()
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": v} for i, v in enumerate(vectors)],
        "model": data.model,
        "usage": usage(result.prompt_tokens, result.truncated_inputs, result.truncated_tokens),
    }


def usage(prompt_tokens: int, truncated_inputs: int, truncated_tokens: int) -> dict[str, Any]:
    """OpenAI's usage, and Tandem's count of what truncation cut when it cut something
    (``truncated_inputs``, ``truncated_tokens``): an answer with nothing cut is OpenAI's shape."""
    out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    if truncated_inputs:
        out.update(truncated_inputs=truncated_inputs, truncated_tokens=truncated_tokens)
    return out
