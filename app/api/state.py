"""What the route handlers share: the runtime (the pipeline and the state of what serves
it, ``app/pipeline/runtime.py``), plus what only the HTTP side keeps: its metrics and the
Responses API's stored responses."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from app.api.metrics import Metrics
from app.api.openai.response_store import ResponseStore
from app.pipeline.runtime import Runtime


@dataclass
class AppState(Runtime):
    metrics: Metrics = field(default_factory=Metrics)
    # The Responses API's stored responses (server.responses_store_*).
    responses: ResponseStore = field(init=False)
    # The shutdown's drain, once begun (``app.main.drain``: the signal handler and the app's
    # shutdown both ask for it; it runs once).
    draining: asyncio.Future[None] | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        server = self.settings
        self.responses = ResponseStore(server.responses_store_entries, server.responses_store_mb * 2**20)
