"""POST /v1/embeddings: OpenAI's embeddings format over the pipeline's encoders."""

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
    # Hugging Face TEI's: cut inputs longer than the model takes instead of refusing them.
    truncate: JsonBool = False


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
        "usage": {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens},
    }
