"""What the dashboard shows over time: the last requests, and 15 minutes of samples.

Two feeds, joined by request id:

- ``middleware`` sees every HTTP request: its route template, client, status and
  duration (a stream's duration runs to its last byte);
- the registry's ``GenerationRecord`` listener (the MLX thread) adds the model, tokens
  in, out and cached, and the time to first token of each generation that ended;
- the request's ``RequestNote`` (``app.request_context``), which the middleware sets and
  the pipeline fills in, gives the model of every request that named one, those that
  generate nothing (embeddings, rerank, the admin buttons) included, and an encoder's
  input tokens.

``Activity.sample()`` runs once a second on the event loop (``run``): it reads the
runtime's ``Overview`` and folds the generations that ended since the last sample into
per-model decode speed (tokens after the first / the gaps between them), time to first
token, the prefix-cache hit rate (cached / prompt tokens) and each model's speculative
acceptance (tokens its drafters proposed since the last sample that it kept). ``SAMPLES`` of them are
kept, so a page opened now draws the last 15 minutes; ``/ui/events`` streams each new
one, with the ``Overview`` read for it (``view``) and its JSON built once for every open
page (``once_per_sample``): a page costs the server the bytes it is sent, not another
read of the registry and another encoding. No prompt or answer text is kept: there is
nothing to show without a ``--log-prompts`` switch, which Tandem does not have.

The samples are the live charts' data: a new series is a field of the sample (or of
each model's row in ``models``) here, and one ``drawChart`` call in ``static/app.js``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from litestar.types import ASGIApp, Message, Receive, Scope, Send

from app.api.request_id import client_request_id, request_id
from app.pipeline.runtime import GenerationRecord, Overview
from app.request_context import CLIENT, NOTE, RequestNote

# One sample a second, 15 minutes of them.
SAMPLE_S = 1.0
SAMPLES = 900
# Requests the Requests panel lists.
REQUESTS = 100
# Paths that are the dashboard, probes or docs: not client requests worth listing.
_QUIET = ("/ui", "/health", "/metrics", "/docs")
T = TypeVar("T")


def _ttft(record: GenerationRecord) -> float | None:
    """A generation's time to first token; None for a scored prompt (a decision's), which has none."""
    return None if record.outcome == "scored" else record.ttft_s


@dataclass
class RequestRow:
    """One request as the Requests panel lists it; the generation's fields fill in when it ends."""

    id: str
    time: float
    method: str = ""
    route: str = ""
    client: str = ""
    status: int | None = None
    duration_s: float | None = None
    model: str | None = None
    outcome: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None
    # The id the client sent (x-client-request-id or x-request-id), kept beside the server's own.
    client_request_id: str | None = None
    # The name of the API key it presented ("" with none): whose row it is (not sent to pages).
    key: str = ""


class Activity:
    """The request log and the sample ring; one per app."""

    def __init__(self, overview: Callable[[], Overview]) -> None:
        self._overview = overview
        self._lock = threading.Lock()  # the listener runs on the MLX thread
        self._rows: OrderedDict[str, RequestRow] = OrderedDict()
        self._ended: list[GenerationRecord] = []  # since the last sample
        self.samples: deque[dict[str, Any]] = deque(maxlen=SAMPLES)
        self.version = 0  # bumped when the request list changes
        self._tick: asyncio.Event | None = None
        # Per model: its drafters' proposed and accepted tokens at the last sample.
        self._drafted: dict[str, tuple[int, int]] = {}
        # The runtime as the last sample read it, and what was built from it for the pages.
        self.view: Overview | None = None
        self._memo: dict[Hashable, Any] = {}

    # ---- the two feeds ------------------------------------------------------------------------

    def on_generation(self, record: GenerationRecord) -> None:
        """The registry's listener (MLX thread)."""
        with self._lock:
            self._ended.append(record)
            row = self._row(record.request_id or f"gen-{id(record)}", time.time() - record.total_s)
            row.model, row.outcome = record.model, record.outcome
            # n > 1 choices are several generations of one request, a decision's questions several
            # scored prompts (outcome "scored", no first token): their tokens add up.
            row.prompt_tokens += record.prompt_tokens
            row.cached_tokens += record.cached_tokens
            row.completion_tokens += record.completion_tokens
            ttft = _ttft(record)
            if ttft is not None and (row.ttft_s is None or ttft < row.ttft_s):
                row.ttft_s = ttft
            self.version += 1

    def _row(self, rid: str, started: float) -> RequestRow:
        row = self._rows.get(rid)
        if row is None:
            row = self._rows[rid] = RequestRow(rid, started)
            while len(self._rows) > REQUESTS:
                self._rows.popitem(last=False)
        return row

    def middleware(self, app: ASGIApp) -> ASGIApp:
        """Litestar middleware: each routed request's route, client, status and duration."""

        async def logged(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or scope["path"] == "/" or scope["path"].startswith(_QUIET):
                await app(scope, receive, send)
                return
            started, wall = time.monotonic(), time.time()
            note = RequestNote()

            async def sending(message: Message) -> None:
                if message["type"] == "http.response.start" and scope.get("path_template"):
                    key = CLIENT.get()
                    client = key or (scope.get("client") or ("",))[0]
                    with self._lock:
                        row = self._row(request_id(scope), wall)
                        row.time = wall
                        row.method, row.route, row.client = str(scope.get("method", "")), scope["path_template"], client
                        row.key, row.client_request_id = key, client_request_id(scope)
                        row.status = message["status"]
                        row.model = row.model or note.model
                        row.prompt_tokens = row.prompt_tokens or note.input_tokens
                        self.version += 1
                elif message["type"] == "http.response.body" and not message.get("more_body"):
                    with self._lock:
                        row_ = self._rows.get(request_id(scope))
                        if row_ is not None and row_.route:
                            row_.duration_s = round(time.monotonic() - started, 3)
                            self.version += 1
                await send(message)

            token = NOTE.set(note)
            try:
                await app(scope, receive, sending)
            finally:
                NOTE.reset(token)

        return logged

    def requests(self, key: str | None = None) -> list[dict[str, Any]]:
        """The last requests, newest first: every key's (``key`` None), or those of the API key named ``key``."""
        with self._lock:
            rows = [asdict(row) for row in reversed(self._rows.values())
                    if row.route and (key is None or row.key == key)]
        for row in rows:
            del row["key"]
        return rows

    # ---- samples ----------------------------------------------------------------------------

    def sample(self) -> dict[str, Any]:
        """Read the runtime and the generations that ended since the last sample; keep and return it."""
        with self._lock:
            ended, self._ended = self._ended, []
        view = self._overview()
        per_model: dict[str, dict[str, Any]] = {}
        for m in view.models:
            if m.state == "loaded":
                per_model[m.name] = {"running": m.running, "waiting": m.waiting, "kv_used_mb": m.kv_used_mb,
                                     "acceptance": self._acceptance(m.name, m.speculation.values())}
        prompt = cached = 0
        for name in {r.model for r in ended}:
            mine = [r for r in ended if r.model == name]
            gaps = sum(sum(r.token_gaps_s) for r in mine)
            tokens = sum(len(r.token_gaps_s) for r in mine)
            ttfts = [t for r in mine if (t := _ttft(r)) is not None]
            row = per_model.setdefault(name, {"running": 0, "waiting": 0, "kv_used_mb": 0.0})
            row["tok_s"] = round(tokens / gaps, 2) if gaps > 0 else None
            row["ttft_s"] = round(sum(ttfts) / len(ttfts), 4) if ttfts else None
            prompt += sum(r.prompt_tokens for r in mine)
            cached += sum(r.cached_tokens for r in mine)
        sample = {
            "t": round(time.time(), 3),
            "used_mb": view.used_mb, "limit_mb": view.limit_mb, "mlx_active_mb": view.mlx.get("active_mb"),
            "running": sum(m.running for m in view.models), "queued": sum(m.waiting for m in view.models),
            "hit_rate": round(cached / prompt, 4) if prompt else None,
            "models": per_model,
        }
        self.samples.append(sample)
        self.view, self._memo = view, {}
        return sample

    def _acceptance(self, model: str, counts: Any) -> float | None:
        """The share of the tokens ``model``'s drafters proposed since the last sample that it
        kept; None when none were proposed (or the model was loaded again, its counts reset)."""
        proposed = accepted = 0
        for c in counts:
            proposed, accepted = proposed + c.proposed, accepted + c.accepted
        last_proposed, last_accepted = self._drafted.get(model, (0, 0))
        self._drafted[model] = (proposed, accepted)
        if proposed <= last_proposed:
            return None
        return round((accepted - last_accepted) / (proposed - last_proposed), 4)
    def once_per_sample(self, key: Hashable, build: Callable[[], T]) -> T:
        """``build()`` for the current sample, built once however many pages ask (event loop)."""
        if key not in self._memo:
            self._memo[key] = build()
        return self._memo[key]

    async def run(self) -> None:
        """Sample every ``SAMPLE_S`` and wake the event streams (a task on the server's loop)."""
        self._tick = asyncio.Event()
        while True:
            self.sample()
            tick, self._tick = self._tick, asyncio.Event()
            tick.set()
            await asyncio.sleep(SAMPLE_S)

    async def next_sample(self, timeout: float = 5.0) -> dict[str, Any] | None:
        """The next sample once it is taken (None if none came within ``timeout``)."""
        if self._tick is None:
            await asyncio.sleep(SAMPLE_S)
            return None
        try:
            await asyncio.wait_for(self._tick.wait(), timeout)
        except asyncio.TimeoutError:
            return None
        return self.samples[-1] if self.samples else None
