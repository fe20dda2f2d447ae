"""POST /v1/decisions: OpenAI's Decisions API over the typed pipeline.

The body is parsed (``decisions_protocol``), the pipeline answers every question from the
model's distribution (``Pipeline.decide``; how, in ``app.pipeline.decisions.reading``), and the
answers are rendered as the openai SDK types them (``openai/types/decision.py``): in
question order, each a predicate's ``probability``, a choice's ``choice``, ``confidence``
and ``probabilities``, a score's expected ``score``, ``confidence`` and ``probabilities``,
or a ``refusal``; usage with nothing generated.
"""

from __future__ import annotations

from typing import Any

from litestar import Request, post
from litestar.params import JSONBody

from app.api.openai.decisions_protocol import DecisionCreateRequest
from app.api.state import AppState
from app.api.streaming import unless_disconnected
from app.pipeline.decisions.request import Answer, Decision
from app.pipeline.results import Usage


def answer_dict(a: Answer) -> dict[str, Any]:
    """One answer, as ``openai.types.decision.Answer``."""
    q = a.question
    if a.refused:
        return {"type": "refusal", "name": q.name}
    if q.kind == "predicate":
        return {"type": "predicate", "name": q.name, "probability": a.probabilities[0]}
    if q.kind == "choice":
        return {"type": "choice", "name": q.name, "choice": q.choices[a.best].value, "confidence": a.confidence,
                "probabilities": [{"value": c.value, "probability": p} for c, p in zip(q.choices, a.probabilities)]}
    return {"type": "score", "name": q.name, "score": a.expected, "confidence": a.confidence,
            "probabilities": [{"label": level.label, "value": i, "probability": p}
                              for i, (level, p) in enumerate(zip(q.levels, a.probabilities))]}


def usage_dict(u: Usage) -> dict[str, Any]:
    """A decision's usage: every question's prompt read, nothing generated."""
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": u.cache_write_tokens},
            "output_tokens": 0, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": u.prompt_tokens}


def decision_dict(d: Decision) -> dict[str, Any]:
    """The response, as ``openai.types.decision.Decision``."""
    return {"answers": [answer_dict(a) for a in d.answers], "model": d.model, "usage": usage_dict(d.usage)}


@post("/v1/decisions", status_code=200, summary="Create a decision")
async def create_decision(data: JSONBody[DecisionCreateRequest], request: Request[Any, Any, Any]) -> dict[str, Any]:
    state: AppState = request.app.state.tandem
    decision = await unless_disconnected(request, state.pipeline.decide(data.to_request()))
    state.metrics.on_decision(decision)
    return decision_dict(decision)
