"""POST /v1/rerank: the Jina / Cohere rerank format that vLLM and llama.cpp serve.

    {"model", "query", "documents": [str | {"text": str}], "top_n", "return_documents"}
    -> {"id", "model", "results": [{"index", "relevance_score", "document"?: {"text"}}], "usage"}

Results are sorted by score, best first. Any embedding model reranks by cosine
similarity; a cross-encoder (``role: rerank``) by its classifier's score.
"""

from __future__ import annotations

import uuid
from typing import Any

from litestar import Request, post
from litestar.params import JSONBody
from pydantic import BaseModel, ConfigDict, Field

from app.api.openai.embeddings import usage
from app.api.state import AppState
from app.api.streaming import unless_disconnected
from app.api.wire import JsonBool
from app.pipeline.request import RerankRequest as TypedRerank


class RerankRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    query: Any
    # Strings, or Jina's {"text": ...} objects.
    documents: list[Any] = Field(min_length=1)
    top_n: int | None = Field(default=None, ge=1)
    return_documents: JsonBool = True
    # As on /v1/embeddings: absent takes the model's models.yaml ``truncate``.
    truncate: JsonBool | None = None

    def texts(self) -> list[Any]:
        return [d.get("text") if isinstance(d, dict) else d for d in self.documents]


@post("/v1/rerank", status_code=200, summary="Rank documents by relevance to a query")
async def rerank(data: JSONBody[RerankRequest], request: Request[Any, Any, Any]) -> dict[str, Any]:
    state: AppState = request.app.state.tandem
    texts = data.texts()
    req = TypedRerank.of(data.model, data.query, texts, truncate=data.truncate)
    ranking = await unless_disconnected(request, state.pipeline.rerank(req))
    results = []
    for index, score in ranking.top(data.top_n):
        result: dict[str, Any] = {"index": index, "relevance_score": score}
        if data.return_documents:
            result["document"] = {"text": texts[index]}
        results.append(result)
    return {"id": f"rerank-{uuid.uuid4().hex[:24]}", "model": data.model, "results": results,
            "usage": usage(ranking.prompt_tokens, ranking.truncated_inputs, ranking.truncated_tokens)}
